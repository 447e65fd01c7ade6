"""Parsing in a child process, under a memory and a CPU-time limit.

A file within the size limits can still take a parser to gigabytes or to hours: 63 MB of XML
packed in a 3.2 MB .docx took python-docx to 4.6 GB and 600 s of CPU; an archive whose
directory lies about its sizes inflated to 3.1 GB; 200k nested ``<div>`` kept lxml busy for
600 s. Each format could be fenced in on its own, but only a process limit holds for every
parser and every trick: the child gets ``RLIMIT_AS`` (memory) and ``RLIMIT_CPU`` (time), and a
file that breaks either is refused with a message, while the worker goes on.

Run as ``python -m webapp.documents.sandbox TYPE MAX_UNCOMPRESSED MAX_RATIO`` with the file on
stdin; it writes ``{"text", "title"}`` or ``{"error"}`` as JSON on stdout.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from webapp.documents.parsing import DocxLimits, ParsedDocument, ParseError, parse


@dataclass(frozen=True)
class SandboxLimits:
    memory_bytes: int = 2 * 1024**3
    cpu_seconds: int = 120


def _limit(limits: SandboxLimits):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 5))

    return preexec


def parse_isolated(
    data: bytes, doc_type: str, *, docx_limits: DocxLimits, limits: SandboxLimits
) -> ParsedDocument:
    """``parsing.parse`` in a limited child process; raises ``ParseError`` for the user."""
    docx = [str(docx_limits.max_uncompressed_bytes), str(docx_limits.max_compression_ratio)]
    command = [sys.executable, "-m", "webapp.documents.sandbox", doc_type, *docx]
    try:
        result = subprocess.run(
            command,
            input=data,
            capture_output=True,
            preexec_fn=_limit(limits),
            timeout=limits.cpu_seconds * 2 + 30,  # wall clock: a child waiting on nothing
        )
    except subprocess.TimeoutExpired as err:
        raise ParseError(_too_slow(limits)) from err
    if result.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        raise ParseError(_too_slow(limits))
    try:
        reply = json.loads(result.stdout)
    except ValueError:
        reply = {}
    if "text" in reply:
        return ParsedDocument(text=reply["text"], title=reply.get("title", ""))
    if reply.get("error") == "memory" or _ran_out_of_memory(result.stderr):
        raise ParseError(
            f"Reading this file needs more than {limits.memory_bytes // 1024**2} MB of memory; "
            "it is refused."
        )
    if "error" in reply:
        raise ParseError(reply["error"])
    stderr = result.stderr.decode(errors="replace")[-2000:]
    raise RuntimeError(f"the parser process failed (exit {result.returncode}): {stderr}")


def _ran_out_of_memory(stderr: bytes) -> bool:
    """Whether a child that crashed did so at its memory limit: a ``MemoryError``, or a failed
    mapping (a module loaded late, at the limit: "failed to map segment from shared object")."""
    return any(
        sign in stderr
        for sign in (b"MemoryError", b"failed to map segment", b"Cannot allocate memory")
    )


def _too_slow(limits: SandboxLimits) -> str:
    return (
        f"Reading this file took longer than {limits.cpu_seconds} s; it is refused (is it "
        "unusually large or deeply nested?)."
    )


def _near_memory_limit() -> bool:
    """Whether this process came within 10 % of its address-space limit. A parser that fails
    there ran out of memory, whatever it says: lxml reports a failed allocation as an
    "unknown" syntax error, which would otherwise reach the user as a damaged file. Nothing
    here may load a module: at the limit that fails too (``resource`` is imported at start)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except MemoryError:
        return True
    except OSError:
        return False
    peak_kb = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmPeak:")), 0
    )
    return peak_kb * 1024 >= 0.9 * limit


def main() -> int:
    doc_type, max_uncompressed, max_ratio = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    limits = DocxLimits(max_uncompressed_bytes=max_uncompressed, max_compression_ratio=max_ratio)
    data = sys.stdin.buffer.read()
    try:
        parsed = parse(data, doc_type, docx_limits=limits)
        reply = {"text": parsed.text, "title": parsed.title}
    except ParseError as err:
        reply = {"error": "memory" if _near_memory_limit() else str(err)}
    except MemoryError:
        reply = {"error": "memory"}
    sys.stdout.write(json.dumps(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
