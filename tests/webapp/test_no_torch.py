"""The web process talks to the engine only through ``kvservice.protocol``: started as the web
server starts it (``webapp.asgi``) and with every URL's view imported, it has loaded no torch
and no part of kvservice beyond the protocol (the question embedder, the one module that
loads torch, not yet loaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: this test process has loaded torch for other tests.
PROBE = """
import importlib, json, sys
import webapp.asgi
from django.urls import URLResolver, get_resolver
from webapp.documents.embeddings import embedder_loaded

def views(patterns):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from views(pattern.url_patterns)
        else:
            yield pattern.callback

callbacks = list(views(get_resolver().url_patterns))
for callback in callbacks:
    importlib.import_module(callback.__module__)
print(json.dumps({
    "views": len(callbacks),
    "embedder_loaded": embedder_loaded(),
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "kvservice": sorted(m for m in sys.modules if m.startswith("kvservice.")),
}))
"""
# Modules of kvservice the web process may load besides the protocol: the data directory
# (deploy.stack decides DATA_DIR with it).
ALLOWED = {"kvservice.paths"}


def _probe() -> dict:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "webapp.settings", "WEB_WARM_UP": "false"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_web_process_imports_no_torch_and_only_the_protocol_of_kvservice() -> None:
    seen = _probe()
    assert seen["views"] > 50  # the walk reached the apps' and the APIs' views
    assert not seen["embedder_loaded"]
    assert seen["torch"] == []
    engine = [
        m for m in seen["kvservice"] if not m.startswith("kvservice.protocol") and m not in ALLOWED
    ]
    assert engine == []
