"""The Celery app for the web side's background work (queues ``ingest`` and ``kv``).

Run: ``celery -A worker worker -Q ingest,kv``. The inference worker is a separate process
with its own app on the ``inference`` queue (kvservice/server.py), so the model is loaded
once, away from Django.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("ragblend")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.imports = ("worker.tasks", "worker.chat")
