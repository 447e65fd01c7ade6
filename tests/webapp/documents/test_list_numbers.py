"""Lists keep their numbers: Word's (which the file does not store: they are counted from
numbering.xml), Markdown's and HTML's, in the parsed text, in the chunks the model reads and on
the document's page; and a list stays in one chunk with its heading."""

from __future__ import annotations

import io

import docx
import pytest
from django.urls import reverse
from docx.oxml import parse_xml

from tests.webapp.documents.conftest import upload
from webapp.documents import parsing, services
from webapp.documents.chunking import chunk_text, llm_tokenizer, split_sentences
from webapp.documents.models import Document

W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def _level(ilvl: int, number_format: str, text: str, start: int = 1) -> str:
    return (
        f'<w:lvl w:ilvl="{ilvl}"><w:start w:val="{start}"/><w:numFmt w:val="{number_format}"/>'
        f'<w:lvlText w:val="{text}"/></w:lvl>'
    )


def _definition(key: int, *levels: str) -> str:
    return f'<w:abstractNum {W} w:abstractNumId="{key}">{"".join(levels)}</w:abstractNum>'


def _list(num_id: int, definition: int, restart_at: int | None = None) -> str:
    override = (
        f'<w:lvlOverride w:ilvl="0"><w:startOverride w:val="{restart_at}"/></w:lvlOverride>'
        if restart_at is not None
        else ""
    )
    definition_xml = f'<w:abstractNumId w:val="{definition}"/>'
    return f'<w:num {W} w:numId="{num_id}">{definition_xml}{override}</w:num>'


def word_file(numbering: list[str], paragraphs: list[tuple[str, int | None, int]]) -> bytes:
    """A Word file whose numbering.xml also holds ``numbering`` (definitions before lists, as
    the schema orders them), with paragraphs (text, numId or None, level)."""
    document = docx.Document()
    root = document.part.numbering_part.element
    first_list = root.index(root.find("{*}num"))
    for xml in numbering:
        element = parse_xml(xml)
        if element.tag.endswith("abstractNum"):
            root.insert(first_list, element)
            first_list += 1
        else:
            root.append(element)
    for text, num_id, level in paragraphs:
        paragraph = document.add_paragraph(text)
        if num_id is not None:
            numbering_properties = paragraph._p.get_or_add_pPr().get_or_add_numPr()
            numbering_properties.get_or_add_ilvl().val = level
            numbering_properties.get_or_add_numId().val = num_id
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def hall_booking_docx() -> bytes:
    """Word's own "List Number" style: the numbering comes from the style, not the paragraph."""
    document = docx.Document()
    document.add_heading("Booking the village hall", level=2)
    document.add_paragraph("Bookings open on the first of each month.")
    steps = [
        "Check the calendar in the porch.",
        "Fill in the green form.",
        "Pay the deposit at the post office.",
        "Collect the key from Mrs Pike.",
    ]
    for step in steps:
        document.add_paragraph(step, style="List Number")
    document.add_paragraph("The hall seats eighty.")
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


HALL_TEXT = (
    "Booking the village hall\n\nBookings open on the first of each month.\n\n"
    "1. Check the calendar in the porch.\n\n2. Fill in the green form.\n\n"
    "3. Pay the deposit at the post office.\n\n4. Collect the key from Mrs Pike.\n\n"
    "The hall seats eighty."
)


def test_a_word_list_number_list_keeps_its_numbers() -> None:
    assert parsing.parse(hall_booking_docx(), parsing.DOCX).text == HALL_TEXT


def test_word_numbers_are_counted_in_each_format_level_and_restart() -> None:
    numbering = [
        _definition(
            901,
            _level(0, "decimal", "%1."),
            _level(1, "lowerLetter", "%2)"),
            _level(2, "lowerRoman", "%3."),
        ),
        _definition(
            902, _level(0, "upperRoman", "%1.", start=4), _level(1, "upperLetter", "%1.%2.")
        ),
        _definition(903, _level(0, "bullet", "\uf0b7")),
        _list(901, 901),
        _list(902, 901, restart_at=1),
        _list(903, 902),
        _list(904, 903),
    ]
    paragraphs = [
        ("Allotment winter jobs", None, 0),
        ("Dig the beds.", 901, 0),
        ("Turn the compost.", 901, 1),
        ("Cover the heap.", 901, 1),
        ("Use the old carpet.", 901, 2),
        ("Weigh it down.", 901, 2),
        ("Prune the apple tree.", 901, 0),
        ("Cut dead wood first.", 901, 1),
        ("Spring jobs", None, 0),
        ("Sow broad beans.", 901, 0),  # the same list, counting on after a paragraph
        ("Order seed potatoes.", 902, 0),
        ("Chit them on a windowsill.", 902, 0),  # restarted
        ("Water", 903, 0),
        ("Empty the butts.", 903, 1),
        ("Check the hose.", 903, 1),
        ("Bring gloves.", 904, 0),
    ]
    text = parsing.parse(word_file(numbering, paragraphs), parsing.DOCX).text
    assert text.split("\n\n") == [
        "Allotment winter jobs",
        "1. Dig the beds.",
        "a) Turn the compost.",
        "b) Cover the heap.",
        "i. Use the old carpet.",
        "ii. Weigh it down.",
        "2. Prune the apple tree.",
        "a) Cut dead wood first.",
        "Spring jobs",
        "3. Sow broad beans.",
        "1. Order seed potatoes.",
        "2. Chit them on a windowsill.",
        "IV. Water",
        "IV.A. Empty the butts.",
        "IV.B. Check the hose.",
        "- Bring gloves.",
    ]


def test_a_damaged_word_list_loses_its_numbers_not_its_text() -> None:
    numbering = [
        f'<w:abstractNum {W} w:abstractNumId="905"><w:lvl w:ilvl="x"><w:start w:val="one"/>'
        '<w:numFmt w:val="decimal"/><w:lvlText w:val="%1."/></w:lvl></w:abstractNum>',
        _list(905, 905),
        _list(906, 999),  # a definition that does not exist
    ]
    paragraphs = [
        ("Feed the hens.", 905, 0),
        ("Collect the eggs.", 906, 0),
        ("Shut the coop.", 777, 0),
    ]
    text = parsing.parse(word_file(numbering, paragraphs), parsing.DOCX).text
    # Word starts a level without a readable start at 0
    assert text == "0. Feed the hens.\n\nCollect the eggs.\n\nShut the coop."


@pytest.mark.parametrize(
    ("number", "number_format", "written"),
    [
        (3, "decimal", "3"),
        (28, "lowerLetter", "bb"),
        (2, "upperLetter", "B"),
        (14, "lowerRoman", "xiv"),
        (1999, "upperRoman", "MCMXCIX"),
        (7, "decimalZero", "07"),
        (12, "ordinal", "12th"),
        (22, "ordinal", "22nd"),
        (5, "hebrew1", "5"),
        (0, "lowerLetter", "0"),
    ],
)
def test_list_numbers_are_written_in_their_format(number, number_format, written) -> None:
    assert parsing.list_number(number, number_format) == written


def test_markdown_lists_keep_their_numbers_and_bullets() -> None:
    markdown = (
        b"# Allotment rota\n\nBefore you leave:\n\n7. Close the shed.\n8. Lock the gate.\n"
        b"   - the padlock code is on the board\n9. Sign the book.\n\n"
        b"Every morning:\n\n* Water the seedlings\n* Feed the hens\n\n"
        b"Loose steps:\n\n1. Rake the path.\n\n2. Empty the bins.\n"
    )
    assert parsing.parse(markdown, parsing.MARKDOWN).text.split("\n\n") == [
        "Allotment rota",
        "Before you leave:",
        "7. Close the shed.",
        "8. Lock the gate.",
        "- the padlock code is on the board",
        "9. Sign the book.",
        "Every morning:",
        "- Water the seedlings",
        "- Feed the hens",
        "Loose steps:",
        "1. Rake the path.",
        "2. Empty the bins.",
    ]


def test_html_lists_are_numbered_as_a_browser_numbers_them() -> None:
    page = (
        b"<html><body><ol type='a' start='3'><li>Oil the hinges</li><li value='9'>Paint the"
        b" door</li><li>Fit the latch</li></ol><ol reversed><li>Three</li><li>Two</li>"
        b"<li>One</li></ol><ol type='I'><li>Plan</li><li><p>Build</p><ul><li>with care</li>"
        b"</ul></li></ol></body></html>"
    )
    assert parsing.parse(page, parsing.HTML).text.split("\n\n") == [
        "c. Oil the hinges",
        "i. Paint the door",
        "j. Fit the latch",
        "3. Three",
        "2. Two",
        "1. One",
        "I. Plan",
        "II. Build",
        "- with care",
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return llm_tokenizer()


def test_a_list_items_number_stays_with_its_words_on_a_line_of_its_own(tokenizer) -> None:
    text = "Closing the barn\n1. Feed the goats.\n2. Bolt the door. Then rest.\nb) Sweep."
    assert split_sentences(text) == [
        "Closing the barn",
        "\n1. Feed the goats.",
        "\n2. Bolt the door.",
        "Then rest.",
        "\nb) Sweep.",
    ]
    (chunk,) = chunk_text(text, tokenizer=tokenizer, max_tokens=64)
    assert chunk.text == text  # before: "Closing the barn\n1. Feed the goats. 2. Bolt ..."


def test_a_list_is_not_split_from_its_heading_when_a_chunk_can_hold_both(tokenizer) -> None:
    before = " ".join(f"The barn roof was patched in week {n}." for n in range(1, 7))
    steps = "\n\n".join(
        f"{n}. {step}"
        for n, step in enumerate(
            [
                "Feed the goats.",
                "Check the water trough.",
                "Bolt the top door.",
                "Switch off the lamp.",
                "Leave the key under the stone.",
            ],
            start=1,
        )
    )
    text = f"Barn notes\n\n{before}\n\nClosing the barn\n\nDo these in order:\n\n{steps}\n\nDone."
    chunks = chunk_text(text, tokenizer=tokenizer, max_tokens=100)
    (with_steps,) = [chunk for chunk in chunks if "Feed the goats" in chunk.text]
    assert with_steps.text.startswith(f"Closing the barn\n\nDo these in order:\n\n{steps}")
    assert all(chunk.token_count <= 100 for chunk in chunks)
    assert "".join("".join(c.text for c in chunks).split()) == "".join(text.split())


@pytest.mark.django_db
def test_the_document_page_shows_a_word_lists_numbers(client, user) -> None:
    document = services.document_upload(
        owner=user, uploaded_file=upload("hall.docx", hall_booking_docx())
    )
    services.document_ingest(document_id=document.pk)
    document.refresh_from_db()
    assert document.status != Document.Status.FAILED, document.error_message
    client.force_login(user)
    page = client.get(reverse("documents:detail", args=[document.pk])).content.decode()
    assert "2. Fill in the green form.<br><br>3. Pay the deposit at the post office." in page
