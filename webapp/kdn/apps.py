from __future__ import annotations

from django.apps import AppConfig


class KdnConfig(AppConfig):
    name = "webapp.kdn"
    label = "kdn"
    verbose_name = "Knowledge delivery"
