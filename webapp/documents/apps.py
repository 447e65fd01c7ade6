from __future__ import annotations

from django.apps import AppConfig


class DocumentsConfig(AppConfig):
    name = "webapp.documents"
    label = "documents"
