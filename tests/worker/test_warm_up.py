"""A pool process loads its models in the background as it starts; a task that arrives
meanwhile waits for that, rather than import the same libraries at the same time (the race
failed two of ten first uploads on a fresh stack with "cannot import name 'AutoTokenizer'")."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import os, time
import django
django.setup()
from worker import celery, tasks
from webapp.documents.embeddings import _load_embedder
from worker.kv import _build_producer
celery.warm_up()
print("loading", not celery._warm_up_done.is_set(), flush=True)
started = time.monotonic()
assert celery.wait_for_warm_up(600)
print("waited", round(time.monotonic() - started, 1))
print("loaded", _build_producer.cache_info().currsize, _load_embedder.cache_info().currsize)
"""


def test_a_task_waits_for_its_process_warm_up() -> None:
    env = {**os.environ, "WORKER_WARM_UP": "1", "WORKER_NICE": "0"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert lines["loading"] == "True"  # the warm-up was still running when the task came
    assert lines["loaded"] == "1 1"  # and the task went on only once both models were in
