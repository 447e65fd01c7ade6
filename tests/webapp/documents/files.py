"""Documents the tests make themselves: every format the pipeline reads, and bad inputs."""

from __future__ import annotations

import io
import zipfile

SENTENCES = [
    "The lighthouse keeper of Skerryvore kept a log of every ship that passed the reef.",
    "In the winter of 1844 the log records forty-one storms and no wrecks.",
    "Engineers built the tower from granite blocks dovetailed into one another.",
    "Each block was shaped on the mainland and shipped out in calm weather.",
    "The light was first lit in 1844 and could be seen for eighteen nautical miles.",
]


def paragraph(topic: str, n: int = 5) -> str:
    return " ".join(f"{s} ({topic} {i})" for i, s in enumerate(SENTENCES * (n // 5 + 1)))[:10_000]


def text_bytes(topic: str = "text", encoding: str = "utf-8") -> bytes:
    return ("Plain notes about " + topic + ".\n\n" + paragraph(topic)).encode(encoding)


def latin1_bytes() -> bytes:
    text = (
        "Le café de la gare sert une crème brûlée très appréciée. "
        "À côté, le garçon prépare des crêpes façon Bretagne pour les élèves. "
        "Les clients âgés préfèrent le thé au citron, servi dans une théière en fonte. "
        "Où est passé l'été ? Déjà fini, hélas, mais la forêt reste belle en automne. "
    ) * 4
    return text.encode("latin-1")


LATIN1_PROBE = "crème brûlée très appréciée"


def utf16_bytes() -> bytes:
    return ("Notes en UTF-16 : naïveté, façade, Ærø and Straße. " * 10).encode("utf-16")


def markdown_bytes(topic: str = "markdown") -> bytes:
    body = paragraph(topic)
    return (
        f"# Skerryvore {topic}\n\n## History\n\n{body}\n\n- granite\n- light\n- keeper\n\n"
        "See [the record](https://example.invalid/record).\n"
    ).encode()


def html_bytes(topic: str = "html") -> bytes:
    return (
        f"<!doctype html><html><head><title>Skerryvore {topic}</title>"
        "<style>body { color: red }</style><script>var secret = 'NOT TEXT';</script></head>"
        f"<body><h1>Skerryvore</h1><p>{paragraph(topic)}</p><p>Second paragraph.</p></body></html>"
    ).encode()


def docx_bytes(topic: str = "docx") -> bytes:
    import docx

    document = docx.Document()
    document.core_properties.title = f"Skerryvore {topic}"
    document.add_heading("Skerryvore", level=1)
    document.add_paragraph(paragraph(topic))
    table = document.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text = "height"
    table.rows[0].cells[1].text = "48 metres"
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def _pdf_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def pdf_bytes(topic: str = "pdf", lines: list[str] | None = None) -> bytes:
    """A minimal valid PDF (one page, Helvetica text), written by hand."""
    if lines is None:
        words = paragraph(topic).split(" ")
        lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    content = (
        "BT /F1 10 Tf 14 TL 50 780 Td "
        + " ".join(f"({_pdf_escape(line)}) Tj T*" for line in lines)
        + " ET"
    )
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 842] "
        "/Resources << /Font << /F1 5 0 R >> >> /Contents 4 0 R >>",
        f"<< /Length {len(content)} >>\nstream\n{content}\nendstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = b"%PDF-1.4\n"
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref_at = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    out += (
        f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref_at}\n%%EOF\n"
    ).encode()
    return out


def encrypted_pdf_bytes() -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_bytes("secret"))))
    writer.encrypt(user_password="open-sesame", owner_password="owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def corrupt_pdf_bytes() -> bytes:
    return b"%PDF-1.7\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R\n" + bytes(range(256)) * 4


def zip_bomb_docx_bytes(inflated_bytes: int = 20 * 1024 * 1024) -> bytes:
    """A .docx-looking archive whose document.xml inflates ~1000:1."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("[Content_Types].xml", "<Types/>")
        archive.writestr("word/document.xml", b" " * inflated_bytes)
    return out.getvalue()


def png_bytes() -> bytes:
    return b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\x00" * 64


def lying_zip_docx_bytes(inflated_bytes: int, claimed_bytes: int = 1024) -> bytes:
    """A valid .docx whose ``word/document.xml`` really inflates to ``inflated_bytes`` (XML
    padded with a comment) while the archive's directory and local header claim
    ``claimed_bytes``: the size checks read the directory, so only reading counts truly."""
    import struct

    out = io.BytesIO(docx_bytes("lying"))
    with zipfile.ZipFile(out) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    xml = members["word/document.xml"]
    head, tail = xml.split(b"<w:body>", 1)
    padding = b" " * (inflated_bytes - len(xml) - len(b"<!---->"))
    members["word/document.xml"] = head + b"<w:body><!--" + padding + b"-->" + tail
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    data = bytearray(packed.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        info = archive.getinfo("word/document.xml")
    # The uncompressed size: at byte 22 of the local header, at byte 24 of the directory
    # entry (46 bytes before the entry's name).
    struct.pack_into("<I", data, info.header_offset + 22, claimed_bytes)
    entry = data.find(b"word/document.xml", data.find(b"PK\x01\x02")) - 46
    assert data[entry : entry + 4] == b"PK\x01\x02"
    struct.pack_into("<I", data, entry + 24, claimed_bytes)
    return bytes(data)


def wide_docx_bytes(paragraphs: int) -> bytes:
    """A .docx of ``paragraphs`` short numbered paragraphs: within the size and compression
    limits (about 20:1), yet a large tree for python-docx to build."""
    out = io.BytesIO(docx_bytes("wide"))
    with zipfile.ZipFile(out) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    xml = members["word/document.xml"]
    head, tail = xml.split(b"<w:body>", 1)
    body = b"".join(
        b"<w:p><w:r><w:t>Line %d: the keeper logged ship %x.</w:t></w:r></w:p>" % (i, i * 7919)
        for i in range(paragraphs)
    )
    members["word/document.xml"] = head + b"<w:body>" + body + tail
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return packed.getvalue()
