"""The web app sends tasks by name (webapp.dispatch): each name must be a task the Celery
worker runs, on the queue the worker serves."""

from __future__ import annotations

import os
import subprocess
import sys

from kvservice.protocol import RECORD_QUEUE, RECORD_TASK
from tests.conftest import CELERY_QUEUES
from webapp import dispatch
from worker.celery import app


def test_every_task_the_web_app_sends_is_one_the_celery_worker_runs() -> None:
    app.loader.import_default_modules()
    sent = (dispatch.INGEST_TASK, dispatch.PRECOMPUTE_TASK, dispatch.KDN_PRECOMPUTE_TASK)
    for name in (*sent, RECORD_TASK):
        assert name in app.tasks, name


def test_each_task_goes_to_a_queue_the_celery_worker_serves() -> None:
    router = dispatch.celery_app.amqp.router  # the web app's own, from the same settings
    for name in (dispatch.INGEST_TASK, dispatch.PRECOMPUTE_TASK, dispatch.KDN_PRECOMPUTE_TASK):
        queue = router.route({}, name)["queue"].name
        assert queue in CELERY_QUEUES, (name, queue)
    assert RECORD_QUEUE in CELERY_QUEUES  # the answers' reports, on a queue of their own
    assert RECORD_QUEUE not in ("ingest", "kv")


def test_the_web_process_imports_no_worker_code() -> None:
    """Loading every URL's views (and so every service) leaves ``worker`` unimported, and
    with it what worker/celery.py sets for the Celery worker's pool (OMP_WAIT_POLICY)."""
    script = (
        "import os, sys, django; django.setup(); import webapp.urls, webapp.asgi; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'worker')); "
        "print(os.environ.get('OMP_WAIT_POLICY'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.split("\n")[:2] == ["[]", "None"], done.stdout
