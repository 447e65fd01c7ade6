from __future__ import annotations

from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "webapp.dashboard"
    label = "dashboard"
    verbose_name = "Dashboard"
