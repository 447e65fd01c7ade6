from __future__ import annotations

from django.apps import AppConfig


class ChatConfig(AppConfig):
    name = "webapp.chat"
    label = "chat"
