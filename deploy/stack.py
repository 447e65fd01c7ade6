"""Where a running dev stack's services are: ``DATA_DIR/stack.json``.

``make dev`` writes it once the services are up; ``python manage.py …`` (and the workers)
started with the same ``DATA_DIR`` read it, so they talk to that stack without copying URLs
around. Variables set in the environment always win over the file (that is how production
points everything at external services).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvservice.paths import data_dir  # DATA_DIR is decided there, for the KV store too

STACK_FILE = "stack.json"


def read_stack_env(directory: Path | None = None) -> dict[str, str]:
    path = (directory or data_dir()) / STACK_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def write_stack_env(env: dict[str, str], directory: Path | None = None) -> Path:
    path = (directory or data_dir()) / STACK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(env, indent=2, sort_keys=True))
    tmp.chmod(0o600)  # it holds the dev services' passwords
    tmp.replace(path)
    return path


def apply_stack_env(directory: Path | None = None) -> None:
    """Fill unset variables from the running stack's file (environment wins)."""
    for name, value in read_stack_env(directory).items():
        os.environ.setdefault(name, value)
