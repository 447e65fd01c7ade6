"""The Celery app for the web side's background work (queues ``ingest`` and ``kv``).

Run: ``celery -A worker worker -Q ingest,kv``. The inference worker is a separate process
with its own app on the ``inference`` queue (kvservice/server.py), so the model is loaded
once, away from Django.
"""

from __future__ import annotations

import logging
import os
import threading

from celery import Celery
from celery.signals import worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("ragblend")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.imports = ("worker.tasks", "worker.chat")


@worker_process_init.connect
def warm_up(**_kwargs) -> None:
    """Load the LLM and the embedder as each pool process starts, in the background (the
    process must report ready within seconds), so the first document does not wait for
    them. ``WORKER_WARM_UP=0`` turns it off."""
    if os.environ.get("WORKER_WARM_UP", "1") == "0":
        return
    threading.Thread(target=_load_models, name="warm-up", daemon=True).start()


def _load_models() -> None:
    try:
        from webapp.documents.embeddings import embedder
        from webapp.documents.kv import kv_precomputer

        kv_precomputer()
        embedder()
    except Exception:  # the first task loads (and reports) it again
        logging.getLogger(__name__).exception("warm-up failed")
