from __future__ import annotations

import pytest

from tests.webapp.documents import files
from webapp.documents import parsing


@pytest.mark.parametrize(
    ("make", "filename", "expected_type"),
    [
        (files.text_bytes, "notes.txt", parsing.TEXT),
        (files.markdown_bytes, "notes.md", parsing.MARKDOWN),
        (files.html_bytes, "page.html", parsing.HTML),
        (files.docx_bytes, "report.docx", parsing.DOCX),
        (files.pdf_bytes, "paper.pdf", parsing.PDF),
    ],
)
def test_each_format_is_detected_from_content_and_parsed(make, filename, expected_type) -> None:
    data = make()
    # The name does not decide the type: a PDF named .txt is still a PDF.
    binary = expected_type in (parsing.PDF, parsing.DOCX, parsing.HTML)
    misleading = "upload.txt" if binary else filename
    assert parsing.detect_type(data, misleading) == expected_type
    parsed = parsing.parse(data, expected_type)
    assert "lighthouse keeper of Skerryvore" in parsed.text


def test_html_drops_scripts_and_styles_and_keeps_the_title() -> None:
    parsed = parsing.parse(files.html_bytes(), parsing.HTML)
    assert "NOT TEXT" not in parsed.text and "color: red" not in parsed.text
    assert parsed.title == "Skerryvore html"


FERRY_PAGE = b"""<!doctype html><html><head><title>Annual report</title></head>
<body class="cookie-consent-open">
<header><a href="/">Brightwater Ferries</a><nav><a href="/">Home</a> <a>Timetable</a></nav></header>
<div id="cookie-banner" role="dialog">We use cookies. <button>Accept all</button></div>
<main><article><header><h1>Annual report 2024</h1></header>
<p>The cooperative reported revenue of 48.2 million euros in 2024.</p>
<aside>Figures are unaudited.</aside>
<p>Write to helpdesk@brightwater.coop for a printed copy.</p></article></main>
<aside class="sidebar">Related pages: Fares, Timetable</aside>
<div role="contentinfo">Harbour Road 1, Brightwater</div>
<footer>&copy; 2025 Brightwater Ferry Cooperative &middot; Privacy &middot; Imprint</footer>
</body></html>"""


def test_html_boilerplate_is_stripped_before_chunking() -> None:
    """Navigation, the page's header, footer and sidebars, cookie banners: gone. The
    article's own header and aside stay, each a paragraph of its own."""
    text = parsing.parse(FERRY_PAGE, parsing.HTML).text
    assert text == (
        "Annual report 2024\n\n"
        "The cooperative reported revenue of 48.2 million euros in 2024.\n\n"
        "Figures are unaudited.\n\n"
        "Write to helpdesk@brightwater.coop for a printed copy."
    )


def test_a_page_that_is_all_boilerplate_is_still_read() -> None:
    page = b"<html><body><header><h1>Closed today</h1><p>No ferries sail.</p></header></body>"
    assert parsing.parse(page, parsing.HTML).text == "Closed today\n\nNo ferries sail."


def test_a_page_about_cookies_is_not_taken_for_a_cookie_banner() -> None:
    policy = "We store a session cookie to keep you signed in. " * 60  # a page, not a banner
    page = f'<html><body><div class="cookie-policy"><p>{policy}</p></div></body></html>'
    assert "session cookie" in parsing.parse(page.encode(), parsing.HTML).text


def test_markdown_is_rendered_to_plain_text() -> None:
    parsed = parsing.parse(files.markdown_bytes(), parsing.MARKDOWN)
    assert "##" not in parsed.text and "](https" not in parsed.text
    assert parsed.title == "Skerryvore markdown"


def test_a_txt_file_is_plain_text_and_keeps_its_numbered_steps() -> None:
    steps = (
        "Closing the yard\n\n1. Lock the gate.\n2. Switch off the lights.\n3. Call the warden.\n"
    )
    data = steps.encode()
    assert parsing.detect_type(data, "closing.txt") == parsing.TEXT  # not "Markdown"
    assert parsing.detect_type(data, "closing") == parsing.MARKDOWN  # no name: the content
    text = parsing.parse(data, parsing.detect_type(data, "closing.txt")).text
    assert "1. Lock the gate." in text and "3. Call the warden." in text


def test_a_numbered_list_keeps_its_numbers_in_markdown_and_html() -> None:
    markdown = parsing.parse(
        b"# Yard\n\n3. Lock the gate.\n4. Call the warden.\n", parsing.MARKDOWN
    )
    assert "3. Lock the gate." in markdown.text and "4. Call the warden." in markdown.text
    html = b"<html><body><ol><li>Lock the gate.</li><li>Call the warden.</li></ol></body></html>"
    page = parsing.parse(html, parsing.HTML).text
    assert "1. Lock the gate." in page and "2. Call the warden." in page


def test_latin1_text_is_decoded_not_failed() -> None:
    parsed = parsing.parse(files.latin1_bytes(), parsing.detect_type(files.latin1_bytes()))
    assert files.LATIN1_PROBE in parsed.text


def test_utf16_text_is_decoded() -> None:
    data = files.utf16_bytes()
    assert parsing.detect_type(data) == parsing.TEXT
    assert "naïveté, façade, Ærø and Straße" in parsing.parse(data, parsing.TEXT).text


def test_docx_tables_are_included() -> None:
    assert "48 metres" in parsing.parse(files.docx_bytes(), parsing.DOCX).text


def test_html_and_markdown_table_cells_do_not_run_together() -> None:
    html = (
        "<h1>Pool hours</h1><table><tr><th>Day</th><th>Lanes</th></tr>"
        "<tr><td>Tuesday</td><td>7:00 to 21:00</td></tr><tr><td>Sunday</td><td>Closed</td></tr>"
        "</table>"
    )
    text = parsing.parse_html(html).text
    assert "Day | Lanes" in text and "Tuesday | 7:00 to 21:00" in text
    assert "Sunday | Closed" in text and "SundayClosed" not in text
    markdown = "# Pool\n\n| Day | Lanes |\n|---|---|\n| Sunday | Closed |\n"
    assert "Sunday | Closed" in parsing.parse_markdown(markdown).text


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"  \n\t ", "empty"),
        (files.png_bytes(), "Unsupported file type (image/png)"),
        (bytes(range(256)) * 64, "Unsupported file type"),
    ],
)
def test_refused_at_detection(data: bytes, message: str) -> None:
    with pytest.raises(parsing.ParseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parsing.detect_type(data, "file.txt")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (files.encrypted_pdf_bytes, "password-protected"),
        (files.corrupt_pdf_bytes, "damaged or truncated"),
        (files.zip_bomb_docx_bytes, "zip bomb"),
    ],
)
def test_bad_files_fail_with_a_human_message(make, message: str) -> None:
    data = make()
    with pytest.raises(parsing.ParseError, match=message):
        parsing.parse(data, parsing.detect_type(data, "file.docx"))


def test_zip_bomb_is_refused_by_total_size_too() -> None:
    limits = parsing.DocxLimits(max_uncompressed_bytes=1024 * 1024, max_compression_ratio=10**9)
    with pytest.raises(parsing.ParseError, match="would unpack to"):
        parsing.parse(files.zip_bomb_docx_bytes(2 * 1024 * 1024), parsing.DOCX, docx_limits=limits)


def test_a_part_that_inflates_past_its_declared_size_is_refused_without_inflating_it() -> None:
    """The directory and local header claim 1 KB; the part inflates to 32 MB. zipfile trusts
    the claim and inflates the part whole in one call; the check counts in 1 MB pieces."""
    import tracemalloc

    data = files.lying_zip_docx_bytes(32 * 1024**2)
    tracemalloc.start()
    try:
        with pytest.raises(parsing.ParseError, match="misstates the size of its part"):
            parsing.parse(data, parsing.DOCX)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024**2


def test_pdf_without_text_says_so() -> None:
    data = files.pdf_bytes(lines=[])
    with pytest.raises(parsing.ParseError, match="No text found in this PDF"):
        parsing.parse(data, parsing.PDF)


def test_zip_that_is_not_a_word_document_is_unsupported() -> None:
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("hello.txt", "hi")
    with pytest.raises(parsing.ParseError, match="ZIP archive"):
        parsing.detect_type(out.getvalue(), "report.docx")
