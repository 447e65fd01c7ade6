"""From uploaded bytes to plain text: type detection from the content, then one parser per type.

Pure functions over bytes (no Django, no S3), so the worker, the bench and the tests call them
alike. Every refusal is a ``ParseError`` whose message is written for the person who uploaded
the file.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass, replace

import filetype
from charset_normalizer import from_bytes

PDF = "pdf"
DOCX = "docx"
HTML = "html"
MARKDOWN = "markdown"
TEXT = "text"

_MARKDOWN_SUFFIXES = (".md", ".markdown", ".mdown", ".mkd")
_TEXT_SUFFIXES = (".txt", ".text")
_HTML_START = re.compile(rb"^\s*(<!--.*?-->\s*)*<(!doctype\s+html|html|head|body)\b", re.I | re.S)
_HTML_TAGS = re.compile(r"</?(p|div|h[1-6]|body|table|ul|ol|li|span|a|br)\b[^>]*>", re.I)
_MARKDOWN_HINTS = re.compile(
    r"^(#{1,6} \S|```|\s*[-*+] \S|\s*\d+\. \S|> \S)|\[[^\]]+\]\([^)]+\)", re.M
)


class ParseError(ValueError):
    """The file cannot become text; ``str(err)`` is the message shown to the user."""


@dataclass(frozen=True)
class ParsedDocument:
    text: str
    title: str = ""


@dataclass(frozen=True)
class DocxLimits:
    max_uncompressed_bytes: int = 200 * 1024 * 1024
    max_compression_ratio: int = 100
    max_entries: int = 10_000


def _human_size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} bytes"


# --------------------------------------------------------------------------------------------
# Detection


def detect_type(data: bytes, filename: str = "") -> str:
    """The document type from the content (the name only separates Markdown from plain text,
    which no content test can do reliably). Raises ``ParseError`` for anything unsupported."""
    if not data or not data.strip():
        raise ParseError("The file is empty.")
    head = data[:8192]
    if head.startswith(b"%PDF-") or b"%PDF-" in head[:1024]:
        return PDF
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _detect_zip(data)
    kind = filetype.guess(head)
    if kind is not None:
        raise ParseError(
            f"Unsupported file type ({kind.mime}). Upload a PDF, Word (.docx), HTML, "
            "Markdown or plain-text file."
        )
    text = decode_text(data)  # raises for binary content
    if _HTML_START.search(data[:4096]) or len(_HTML_TAGS.findall(text[:20000])) >= 3:
        return HTML
    name = filename.lower()
    if name.endswith(_MARKDOWN_SUFFIXES):
        return MARKDOWN
    if name.endswith(_TEXT_SUFFIXES):  # its writer said plain text: "1." stays a number
        return TEXT
    return MARKDOWN if len(_MARKDOWN_HINTS.findall(text[:20000])) >= 3 else TEXT


def _detect_zip(data: bytes) -> str:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = set(archive.namelist())  # the central directory only; nothing is inflated
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise ParseError("The file looks like a ZIP archive but is damaged.") from err
    if "word/document.xml" in names:
        return DOCX
    if "[Content_Types].xml" in names:
        raise ParseError(
            "This Office file is not a Word document. Upload a PDF, Word (.docx), HTML, "
            "Markdown or plain-text file."
        )
    raise ParseError(
        "Unsupported file type (a ZIP archive). Upload a PDF, Word (.docx), HTML, Markdown "
        "or plain-text file."
    )


# Short Western-European texts decode almost equally well in several single-byte code pages
# (cp1252 vs cp1257 differ only in accented letters). Where windows-1252 (the web's own
# fallback, a superset of Latin-1's printable range) is nearly as plausible as the top guess,
# it is the better bet.
_PREFERRED_ENCODINGS = ("cp1252", "latin_1", "iso8859_15")
_CHAOS_TOLERANCE = 0.05


def _best_encoding(data: bytes) -> str | None:
    matches = list(from_bytes(data))
    if not matches:
        return None
    best = matches[0]
    for preferred in _PREFERRED_ENCODINGS:
        for match in matches:
            if match.encoding == preferred and match.chaos <= best.chaos + _CHAOS_TOLERANCE:
                return match.encoding
    return best.encoding


def decode_text(data: bytes) -> str:
    """Bytes of a text file to str: BOMs and UTF-8 first, then charset detection."""
    for bom, codec in (
        (b"\xef\xbb\xbf", "utf-8-sig"),
        (b"\xff\xfe\x00\x00", "utf-32"),
        (b"\x00\x00\xfe\xff", "utf-32"),
        (b"\xff\xfe", "utf-16"),
        (b"\xfe\xff", "utf-16"),
    ):
        if data.startswith(bom):
            try:
                return data.decode(codec)
            except UnicodeDecodeError as err:
                raise ParseError(f"The file claims to be {codec} text but is not.") from err
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        best = _best_encoding(data[: 1024 * 1024])
        if best is None:
            raise ParseError(
                "Unsupported file type (binary data). Upload a PDF, Word (.docx), HTML, "
                "Markdown or plain-text file."
            ) from None
        try:
            text = data.decode(best)
        except (UnicodeDecodeError, LookupError) as err:
            raise ParseError("The text's character encoding could not be recognised.") from err
    if "\x00" in text:
        raise ParseError(
            "Unsupported file type (binary data). Upload a PDF, Word (.docx), HTML, Markdown "
            "or plain-text file."
        )
    return text


# --------------------------------------------------------------------------------------------
# Parsers


def parse(data: bytes, doc_type: str, *, docx_limits: DocxLimits | None = None) -> ParsedDocument:
    """Extract the text of a document of a detected type; raises ``ParseError``."""
    if doc_type == PDF:
        parsed = parse_pdf(data)
    elif doc_type == DOCX:
        parsed = parse_docx(data, docx_limits or DocxLimits())
    elif doc_type == HTML:
        parsed = parse_html(decode_text(data))
    elif doc_type == MARKDOWN:
        parsed = parse_markdown(decode_text(data))
    elif doc_type == TEXT:
        parsed = ParsedDocument(text=normalize_text(decode_text(data)))
    else:
        raise ParseError(f"Unsupported file type ({doc_type}).")
    if not parsed.text.strip():
        if doc_type == PDF:
            raise ParseError(
                "No text found in this PDF (is it a scan? Text recognition is not supported)."
            )
        raise ParseError("No text found in this file.")
    return parsed


# Control characters other than tab and newlines: no meaning in text, and PostgreSQL's text
# type refuses NUL. (Carriage returns and form feeds are turned into newlines first.)
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def normalize_text(text: str) -> str:
    """Unify newlines, drop control characters, collapse runs of blank lines and spaces."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x0c", "\n\n")
    text = CONTROL_CHARS.sub("", text)
    text = re.sub(r"[ \t\u00a0]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def parse_pdf(data: bytes) -> ParsedDocument:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            # An owner password alone (printing/copy restrictions) still opens with "".
            try:
                opened = reader.decrypt("")
            except Exception:  # noqa: BLE001 - pypdf raises several kinds here
                opened = 0
            if not opened:
                raise ParseError(
                    "This PDF is password-protected. Remove the password and upload it again."
                )
        pages = [page.extract_text() or "" for page in reader.pages]
        title = ""
        try:
            title = str((reader.metadata or {}).get("/Title") or "").strip()
        except Exception:  # noqa: BLE001 - broken metadata must not fail the document
            title = ""
    except ParseError:
        raise
    except (
        PyPdfError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        OSError,
        IndexError,
        AssertionError,
        RecursionError,
        zlib.error,
    ) as err:
        raise ParseError("This PDF could not be read: it looks damaged or truncated.") from err
    return ParsedDocument(text=normalize_text("\n\n".join(pages)), title=title)


def check_zip_bomb(data: bytes, limits: DocxLimits) -> None:
    """Refuse an archive that would inflate too far: by what its directory says, then by what
    each part really inflates to (counted in pieces, so never held whole)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise ParseError("This Word file is damaged (it is not a valid ZIP archive).") from err
    if len(infos) > limits.max_entries:
        raise ParseError(f"This Word file has too many parts ({len(infos)}); it is refused.")
    uncompressed = sum(info.file_size for info in infos)
    compressed = sum(info.compress_size for info in infos)
    if uncompressed > limits.max_uncompressed_bytes:
        raise ParseError(
            f"This Word file would unpack to {_human_size(uncompressed)} (the limit is "
            f"{_human_size(limits.max_uncompressed_bytes)}); it looks like a zip bomb and is "
            "refused."
        )
    if compressed and uncompressed / compressed > limits.max_compression_ratio:
        raise ParseError(
            f"This Word file is compressed {uncompressed / compressed:.0f}:1 (the limit is "
            f"{limits.max_compression_ratio}:1); it looks like a zip bomb and is refused."
        )
    for info in infos:
        if _real_size(data, info) != info.file_size:
            raise ParseError(
                f"This Word file's directory misstates the size of its part {info.filename!r}; "
                "it looks damaged or crafted and is refused."
            )


def _real_size(data: bytes, info: zipfile.ZipInfo) -> int:
    """How many bytes a member really inflates to, counted in 1 MB pieces and at most one
    past what its directory entry says. ``zipfile`` trusts the directory and inflates a member
    whole in one call, so a member that claims 1 KB and inflates to 3 GB takes 3 GB."""
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise ParseError(f"This Word file uses an unsupported compression in {info.filename!r}.")
    try:
        name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    except struct.error as err:
        raise ParseError("This Word file is damaged (it is not a valid ZIP archive).") from err
    start = info.header_offset + 30 + name_length + extra_length
    packed = memoryview(data)[start : start + info.compress_size]
    if info.compress_type == zipfile.ZIP_STORED:
        return len(packed)
    inflater, size, pending = zlib.decompressobj(-zlib.MAX_WBITS), 0, packed
    try:
        while pending and size <= info.file_size:
            size += len(inflater.decompress(pending, 1 << 20))
            pending = inflater.unconsumed_tail
        if size <= info.file_size:
            size += len(inflater.flush())
    except zlib.error as err:
        raise ParseError("This Word file could not be read: it looks damaged.") from err
    return size


def parse_docx(data: bytes, limits: DocxLimits) -> ParsedDocument:
    check_zip_bomb(data, limits)
    import docx
    from docx.opc.exceptions import PackageNotFoundError

    try:
        document = docx.Document(io.BytesIO(data))
        numbering = WordNumbering(document)
        blocks = [numbering.numbered(paragraph) for paragraph in document.paragraphs]
        for table in document.tables:
            for row in table.rows:
                blocks.append(" | ".join(cell.text for cell in row.cells))
        title = (document.core_properties.title or "").strip()
    except (PackageNotFoundError, KeyError, ValueError, zipfile.BadZipFile, OSError) as err:
        raise ParseError("This Word file could not be read: it looks damaged.") from err
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - lxml and python-docx raise many kinds
        raise ParseError("This Word file could not be read: it looks damaged.") from err
    return ParsedDocument(text=normalize_text("\n\n".join(blocks)), title=title)


# --------------------------------------------------------------------------------------------
# List numbers. A Word file stores none (Word counts them as it lays the page out) and an
# HTML list only its kind, yet a text refers to them ("go back to step 3") and a question asks
# for "the third step": each parser writes them into the text, as the reader sees them.

BULLET = "-"  # what a bulleted item starts with, whatever the format's bullet glyph
_ROMAN = [
    (1000, "m"),
    (900, "cm"),
    (500, "d"),
    (400, "cd"),
    (100, "c"),
    (90, "xc"),
    (50, "l"),
    (40, "xl"),
    (10, "x"),
    (9, "ix"),
    (5, "v"),
    (4, "iv"),
    (1, "i"),
]


def list_number(number: int, number_format: str, *, word_letters: bool = True) -> str:
    """``number`` as a list writes it, in Word's ``numFmt`` names: ``decimal``, ``decimalZero``
    (01), ``lowerLetter``/``upperLetter``, ``lowerRoman``/``upperRoman``, ``ordinal`` (1st),
    ``none``. Past z, Word repeats the letter (27: aa, 28: bb) and HTML counts on (27: aa,
    28: ab): ``word_letters`` says which. Any other format (Word has sixty, most of them
    national) and a number a format cannot write (0 in letters) are written in digits: the
    number is kept."""
    if number_format == "none":
        return ""
    if number_format in ("lowerLetter", "upperLetter") and number > 0:
        letters = _word_letters(number) if word_letters else _html_letters(number)
        return letters.upper() if number_format == "upperLetter" else letters
    if number_format in ("lowerRoman", "upperRoman") and 0 < number < 4000:
        roman = _roman(number)
        return roman.upper() if number_format == "upperRoman" else roman
    if number_format == "decimalZero" and 0 <= number < 10:
        return f"0{number}"
    if number_format == "ordinal" and number > 0:
        teens = number % 100 in (11, 12, 13)
        return f"{number}{'th' if teens else {1: 'st', 2: 'nd', 3: 'rd'}.get(number % 10, 'th')}"
    return str(number)


def _roman(number: int) -> str:
    digits = []
    for value, letters in _ROMAN:
        count, number = divmod(number, value)
        digits.append(letters * count)
    return "".join(digits)


def _word_letters(number: int) -> str:
    return chr(ord("a") + (number - 1) % 26) * ((number - 1) // 26 + 1)


def _html_letters(number: int) -> str:
    letters = ""
    while number > 0:
        number, digit = divmod(number - 1, 26)
        letters = chr(ord("a") + digit) + letters
    return letters


_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_LEVEL_FIELD = re.compile(r"%([1-9])")


def _w_val(element, child: str) -> str | None:
    """The ``w:val`` of ``element``'s child ``w:<child>`` (``child`` may be a path)."""
    if element is None:
        return None
    found = element.find(_W + child.replace("/", "/" + _W))
    return None if found is None else found.get(f"{_W}val")


def _w_int(value: str | None, default: int | None = None) -> int | None:
    """A number of the file, or ``default`` where it is missing or no number: a damaged list
    loses its numbers, not the document."""
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


@dataclass(frozen=True)
class WordListLevel:
    """One level of a Word list definition (``w:lvl``): how its numbers are written, where
    they start, and its text, with a field for each level above it and its own ("%1.%2.")."""

    number_format: str = "decimal"
    text: str = "%1."
    start: int = 1
    legal: bool = False  # w:isLgl: every level's number in digits (1.1.3, not 1.a.iii)

    @classmethod
    def from_xml(cls, lvl) -> WordListLevel:
        return cls(
            number_format=_w_val(lvl, "numFmt") or "decimal",
            text=_w_val(lvl, "lvlText") or "",
            start=_w_int(_w_val(lvl, "start"), 0) or 0,  # Word's default start is 0
            legal=lvl.find(f"{_W}isLgl") is not None,
        )


def _levels(parent) -> dict[int, WordListLevel]:
    return {
        _w_int(lvl.get(f"{_W}ilvl"), 0) or 0: WordListLevel.from_xml(lvl)
        for lvl in parent.findall(f"{_W}lvl")
    }


@dataclass(frozen=True)
class WordList:
    """A list of the document (``w:num``): the definition it counts with, that definition's
    levels with this list's overrides, and the levels it starts afresh (Word's "Restart
    numbering" writes a new list with a ``w:startOverride``)."""

    definition: str
    levels: dict[int, WordListLevel]
    restarts: frozenset[int]


def _word_definitions(numbering) -> tuple[dict[str, dict[int, WordListLevel]], dict[str, str]]:
    """Each list definition's levels (``w:abstractNum``), and which definition each counts
    with: its own, or, where it only names a list style (``w:numStyleLink``), the one that
    defines that style (``w:styleLink``)."""
    definitions: dict[str, dict[int, WordListLevel]] = {}
    style_links: dict[str, str] = {}
    defining: dict[str, str] = {}
    for abstract in numbering.findall(f"{_W}abstractNum"):
        key = abstract.get(f"{_W}abstractNumId", "")
        definitions[key] = _levels(abstract)
        if (style := _w_val(abstract, "numStyleLink")) is not None:
            style_links[key] = style
        if (style := _w_val(abstract, "styleLink")) is not None:
            defining[style] = key
    counted_with = {key: defining.get(style_links.get(key, ""), key) for key in definitions}
    return definitions, counted_with


def _word_lists(numbering) -> dict[str, WordList]:
    definitions, counted_with = _word_definitions(numbering)
    lists: dict[str, WordList] = {}
    for num in numbering.findall(f"{_W}num"):
        definition = counted_with.get(_w_val(num, "abstractNumId") or "")
        if definition is None:
            continue
        levels, restarts = dict(definitions[definition]), set()
        for override in num.findall(f"{_W}lvlOverride"):
            level = _w_int(override.get(f"{_W}ilvl"), 0) or 0
            replaced = override.find(f"{_W}lvl")
            if replaced is not None:
                levels[level] = WordListLevel.from_xml(replaced)
            start = _w_int(_w_val(override, "startOverride"))
            if start is not None:
                levels[level] = replace(levels.get(level, WordListLevel()), start=start)
                restarts.add(level)
        lists[num.get(f"{_W}numId", "")] = WordList(definition, levels, frozenset(restarts))
    return lists


def _word_style_lists(styles) -> tuple[dict[str, tuple[str, int | None]], str]:
    """The list (``numId``, level) each paragraph style puts its paragraphs in, its own or
    the one of a style it is based on; and the default paragraph style."""
    own: dict[str, tuple[str, int | None]] = {}
    based_on: dict[str, str] = {}
    default = ""
    for style in styles.findall(f"{_W}style"):
        if style.get(f"{_W}type", "paragraph") != "paragraph":
            continue
        style_id = style.get(f"{_W}styleId", "")
        if style.get(f"{_W}default") in ("1", "true", "on"):
            default = style_id
        num_id = _w_val(style, "pPr/numPr/numId")
        if num_id is not None:
            own[style_id] = (num_id, _w_int(_w_val(style, "pPr/numPr/ilvl")))
        based_on[style_id] = _w_val(style, "basedOn") or ""
    resolved: dict[str, tuple[str, int | None]] = {}
    for style_id in based_on:
        ancestor, seen = style_id, set()
        while ancestor and ancestor not in own and ancestor not in seen:  # a loop is damage
            seen.add(ancestor)
            ancestor = based_on.get(ancestor, "")
        if ancestor in own:
            resolved[style_id] = own[ancestor]
    return resolved, default


class WordNumbering:
    """The numbers Word shows before the paragraphs of its lists, counted in document order
    as Word counts them. python-docx reads the paragraphs but not their numbers, and the
    libraries that do (docx2python) ignore where a list starts, its restarts and its text
    ("%1.%2."), so they are counted here. A paragraph is in a list through its own
    ``w:numPr`` (``numId``, ``ilvl``) or its style's ("List Number"); ``numbering.xml`` maps
    the ``numId`` to a definition whose levels say how numbers are written. Lists sharing a
    definition count on together unless one restarts; a level starts afresh when a level
    above it counts on (1. a. b. 2. a.)."""

    def __init__(self, document) -> None:
        from docx.opc.constants import RELATIONSHIP_TYPE

        try:
            numbering = document.part.part_related_by(RELATIONSHIP_TYPE.NUMBERING).element
        except KeyError:  # no lists in this file
            numbering = None
        self.lists = {} if numbering is None else _word_lists(numbering)
        self.style_lists, self.default_style = _word_style_lists(document.styles.element)
        self.counters: dict[str, dict[int, int]] = {}  # per definition: level -> number
        self.started: set[str] = set()

    def numbered(self, paragraph) -> str:
        """The paragraph's text, after its number ("3. Pack the box.") where it has one."""
        label = self.label(paragraph._p)
        text = paragraph.text
        return f"{label} {text}" if label and text.strip() else text

    def label(self, p) -> str:
        """The number (or ``BULLET``) before paragraph ``p`` (a ``w:p``); "" for none. Counts:
        call it once for each paragraph, in document order."""
        num_id, level = self._list_of(p)
        word_list = self.lists.get(num_id or "")
        if word_list is None or level not in word_list.levels:
            return ""  # not in a list, or numId 0: the style's list switched off
        counters = self._count(num_id or "", word_list, level)
        this = word_list.levels[level]
        if this.number_format == "bullet":
            return BULLET

        def field(match: re.Match[str]) -> str:
            above = int(match.group(1)) - 1
            written = word_list.levels.get(above, WordListLevel())
            number = counters.get(above, written.start)
            return list_number(number, "decimal" if this.legal else written.number_format)

        return _LEVEL_FIELD.sub(field, this.text).strip()

    def _list_of(self, p) -> tuple[str | None, int]:
        style = _w_val(p, "pPr/pStyle") or self.default_style
        style_num_id, style_level = self.style_lists.get(style, (None, None))
        num_id = _w_val(p, "pPr/numPr/numId")
        level = _w_int(_w_val(p, "pPr/numPr/ilvl"))
        if level is None:
            level = style_level if style_level is not None else 0
        return (num_id if num_id is not None else style_num_id), level

    def _count(self, num_id: str, word_list: WordList, level: int) -> dict[int, int]:
        counters = self.counters.setdefault(word_list.definition, {})
        if num_id not in self.started:  # a restart takes effect at the list's first paragraph
            self.started.add(num_id)
            for restarted in word_list.restarts:
                counters.pop(restarted, None)
        if level in counters:
            counters[level] += 1
        else:
            counters[level] = word_list.levels[level].start
        for deeper in [at for at in counters if at > level]:
            del counters[deeper]
        return counters


_BLOCK_TAGS = [
    "p",
    "div",
    "li",
    "tr",
    "br",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "pre",
    "blockquote",
    "section",
    "article",
    "table",
    "main",
    "header",
    "footer",
    "aside",
    "figcaption",
    "dt",
    "dd",
]


# A page's boilerplate, the same on every page of a site and never what a question is
# about: navigation always; the page's header, footer and sidebars (not those of an article
# or the main content, which belong to it); cookie and consent banners. Kept in a passage,
# they were retrieved and cited (a footer's address highlighted instead of the answer).
_NAVIGATION = ["nav"]
_NAVIGATION_ROLES = {"navigation", "search"}
_PAGE_PARTS = ["header", "footer", "aside"]
_PAGE_PART_ROLES = {"banner", "contentinfo", "complementary"}
_CONTENT = ["article", "main", "body", "html"]
_BANNER_NAME = re.compile(r"cookie|consent|gdpr", re.I)
_BANNER_MAX_CHARS = 2000  # longer: a page about cookies, not a banner


def _is_banner(tag) -> bool:
    names = " ".join([tag.get("id") or "", *(tag.get("class") or [])])
    return bool(_BANNER_NAME.search(names)) and len(tag.get_text()) <= _BANNER_MAX_CHARS


def _is_boilerplate(tag) -> bool:
    role = (tag.get("role") or "").lower()
    if tag.name in _NAVIGATION or role in _NAVIGATION_ROLES:
        return True
    if tag.name in _CONTENT or role == "main":
        return False
    page_part = tag.name in _PAGE_PARTS or role in _PAGE_PART_ROLES
    if page_part and tag.find_parent(_is_content) is None:
        return True
    return _is_banner(tag)


def _is_content(tag) -> bool:
    """An article or the main content (the page's own header and footer are outside it)."""
    return tag.name in ("article", "main") or (tag.get("role") or "").lower() == "main"


def strip_boilerplate(soup) -> None:
    """Remove the page's boilerplate (``_is_boilerplate``) from ``soup``, unless that would
    leave no text: a page that is all header is still read."""
    doomed = [tag for tag in soup.find_all(True) if _is_boilerplate(tag)]
    marked = {id(tag) for tag in doomed}
    outermost = [t for t in doomed if not any(id(parent) in marked for parent in t.parents)]
    removed = sum(len(tag.get_text(strip=True)) for tag in outermost)
    if removed >= len(soup.get_text(strip=True)):
        return
    for tag in outermost:
        tag.decompose()


_HTML_NUMBER_FORMATS = {
    "1": "decimal",
    "a": "lowerLetter",
    "A": "upperLetter",
    "i": "lowerRoman",
    "I": "upperRoman",
}


def _html_int(value) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def label_list_items(soup) -> None:
    """Start each item of a numbered list with its number ("3. Lock the gate", "c. Lock
    the gate" for ``type="a"``), as a browser shows it: ``start``, ``reversed`` and an item's
    ``value`` included; each item of a bulleted list with ``BULLET``."""
    for listing in soup.find_all(["ol", "ul"]):
        items = listing.find_all("li", recursive=False)
        if listing.name == "ul":
            for item in items:
                _prefix(item, BULLET)
            continue
        step = -1 if listing.has_attr("reversed") else 1
        number = _html_int(listing.get("start"))
        if number is None:
            number = len(items) if step < 0 else 1
        number_format = _HTML_NUMBER_FORMATS.get(str(listing.get("type") or "1"), "decimal")
        for item in items:
            value = _html_int(item.get("value"))
            number = number if value is None else value
            label = list_number(number, number_format, word_letters=False)
            _prefix(item, f"{label}.")
            number += step


def _prefix(item, label: str) -> None:
    """Put ``label`` before the item's first words, in the same string: an item whose
    words are in a paragraph (a Markdown list with blank lines between its items) would
    otherwise have its label on a line of its own. (Not in a comment: no text.)"""
    from bs4 import NavigableString

    first = item.find(string=lambda s: type(s) is NavigableString and s.strip())
    if first is None:
        item.insert(0, f"{label} ")
    else:
        first.replace_with(f"{label} {first.lstrip()}")


def separate_table_cells(soup) -> None:
    """A table row's cells with " | " between them, as a Word table's are read: without it
    "Sunday" and "Closed" ran together ("SundayClosed") in passages and on the page."""
    for row in soup.find_all("tr"):
        for between in [c for c in row.children if isinstance(c, str) and not c.strip()]:
            between.extract()  # the source's line breaks between cells (Markdown's)
        cells = row.find_all(["td", "th"], recursive=False)
        for cell in cells[:-1]:
            cell.append(" | ")


def _html_to_text(html: str) -> tuple[str, str]:
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "lxml")
    for tag in soup(["script", "style", "noscript", "template", "svg", "iframe", "head"]):
        if tag.name == "head":
            continue
        tag.decompose()
    title = soup.title.get_text(" ", strip=True) if soup.title else ""
    if soup.head is not None:
        soup.head.decompose()
    strip_boilerplate(soup)
    label_list_items(soup)
    separate_table_cells(soup)
    # Block elements end a line, so sentences of separate paragraphs never run together.
    for block in soup.find_all(_BLOCK_TAGS):
        block.append("\n\n")
    return soup.get_text(), title


def parse_html(html: str) -> ParsedDocument:
    text, title = _html_to_text(html)
    return ParsedDocument(text=normalize_text(text), title=title)


def parse_markdown(markdown: str) -> ParsedDocument:
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").enable("table").render(markdown)
    text, _ = _html_to_text(html)
    match = re.search(r"^# +(.+?)\s*#*\s*$", markdown, re.M)
    return ParsedDocument(text=normalize_text(text), title=match.group(1).strip() if match else "")
