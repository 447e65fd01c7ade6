"""No template comment written ``{# ... #}`` runs over more than one line: Django's short
comment ends at the line's end, so the page shows such a comment to its reader as text (the
documents page showed "{# The quota is in tokens; ... #}" above the user's space, issue #49).
A comment of several lines is ``{% comment %}...{% endcomment %}``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_DIRS = [ROOT / "templates", *sorted((ROOT / "webapp").glob("*/templates"))]
OPEN_COMMENT = re.compile(r"\{#(?:(?!#\}).)*$", re.MULTILINE)  # "{#" with no "#}" after it


def test_no_short_template_comment_runs_over_a_line() -> None:
    templates = [p for d in TEMPLATE_DIRS if d.is_dir() for p in sorted(d.rglob("*.html"))]
    assert len(templates) > 30  # the templates were found
    unclosed = {
        str(path.relative_to(ROOT)): [
            path.read_text()[: match.start()].count("\n") + 1
            for match in OPEN_COMMENT.finditer(path.read_text())
        ]
        for path in templates
    }
    assert not {name: lines for name, lines in unclosed.items() if lines}
