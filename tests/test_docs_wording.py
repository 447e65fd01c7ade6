"""The documentation speaks of dates, not of the team's numbered working sessions ("stop 45"):
a reader outside the team cannot place those (issue #49)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
INTERNAL_STEP = re.compile(r"\bstop \d+\b", re.IGNORECASE)


def test_the_docs_date_their_measurements_instead_of_numbering_sessions() -> None:
    read = [path for path in sorted(DOCS.rglob("*")) if path.suffix in {".md", ".json", ".txt"}]
    assert len(read) > 20  # the docs were found
    numbered = {
        str(path.relative_to(ROOT)): INTERNAL_STEP.findall(path.read_text(errors="replace"))
        for path in [ROOT / "README.md", *read]
    }
    assert not {name: found for name, found in numbered.items() if found}
