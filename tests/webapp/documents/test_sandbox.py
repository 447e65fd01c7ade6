"""Parsing in a limited child process: the same text as in-process, and a clear refusal when
a file needs more CPU time or memory than allowed (the worker itself is never at risk)."""

from __future__ import annotations

import pytest

from tests.webapp.documents import files
from webapp.documents import parsing
from webapp.documents.sandbox import SandboxLimits, _ran_out_of_memory, parse_isolated

DOCX = parsing.DocxLimits()


@pytest.mark.parametrize("kind", ["docx", "pdf", "html", "markdown", "text"])
def test_the_sandbox_gives_the_same_text_as_parsing_in_process(kind) -> None:
    data = getattr(files, f"{kind}_bytes")("Sandboxed parsing keeps every word of the file.")
    expected = parsing.parse(data, kind, docx_limits=DOCX)
    assert parse_isolated(data, kind, docx_limits=DOCX, limits=SandboxLimits()) == expected


def test_a_file_that_takes_too_long_is_refused() -> None:
    nested = b"<html><body>" + b"<div>" * 200_000 + b"deep" + b"</div>" * 200_000
    with pytest.raises(parsing.ParseError, match="took longer than 2 s"):
        parse_isolated(nested, "html", docx_limits=DOCX, limits=SandboxLimits(cpu_seconds=2))


def test_a_file_that_needs_too_much_memory_is_refused() -> None:
    wide = b"<html><body>" + b"<p>word</p>" * 2_000_000  # 22 MB of HTML, a big lxml tree
    limits = SandboxLimits(memory_bytes=400 * 1024**2)
    with pytest.raises(parsing.ParseError, match="more than 400 MB of memory"):
        parse_isolated(wide, "html", docx_limits=DOCX, limits=limits)


def test_a_refusal_by_the_parser_itself_comes_through() -> None:
    with pytest.raises(parsing.ParseError, match="damaged"):
        parse_isolated(b"PK\x03\x04 not a zip", "docx", docx_limits=DOCX, limits=SandboxLimits())


def test_a_docx_within_the_size_limits_that_needs_too_much_memory_is_refused_as_such() -> None:
    """150k short paragraphs (1.2 MB, 10:1) pass every size check, and python-docx needs
    ~220 MB to read them. lxml reports the failed allocation as an "unknown" syntax error;
    the user must read that the file needs too much memory, not that it is damaged."""
    data = files.wide_docx_bytes(150_000)
    limits = SandboxLimits(memory_bytes=160 * 1024**2)
    with pytest.raises(parsing.ParseError, match="more than 160 MB of memory"):
        parse_isolated(data, "docx", docx_limits=DOCX, limits=limits)


def test_a_docx_whose_directory_lies_is_refused_by_the_sandboxed_parser() -> None:
    data = files.lying_zip_docx_bytes(64 * 1024**2)  # claims 1 KB
    limits = SandboxLimits(memory_bytes=200 * 1024**2)  # less than the part inflates to
    with pytest.raises(parsing.ParseError, match="misstates the size"):
        parse_isolated(data, "docx", docx_limits=DOCX, limits=limits)


def test_a_child_that_crashed_at_its_memory_limit_is_told_apart_from_other_crashes() -> None:
    """A child at its limit may fail before it can answer (a module mapped late); its stderr
    still says why, and the user reads that the file needs too much memory."""
    at_limit = b"ImportError: .../resource.so: failed to map segment from shared object"
    assert _ran_out_of_memory(at_limit)
    assert _ran_out_of_memory(b"Traceback ...\nMemoryError")
    assert not _ran_out_of_memory(b"Traceback ...\nKeyError: 'word/document.xml'")
