"""Create the first admin account if there is none.

Credentials come from ADMIN_USERNAME / ADMIN_PASSWORD (and ADMIN_EMAIL); without a password a
random one is generated and printed once. An existing superuser is left alone.
"""

from __future__ import annotations

import os
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create the first admin account (idempotent)."

    def handle(self, *args, **options) -> None:
        users = get_user_model()
        if users.objects.filter(is_superuser=True).exists():
            self.stdout.write("An admin account exists already.")
            return
        username = os.environ.get("ADMIN_USERNAME", "admin")
        password = os.environ.get("ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        users.objects.create_superuser(
            username=username, email=os.environ.get("ADMIN_EMAIL", ""), password=password
        )
        shown = "(from ADMIN_PASSWORD)" if os.environ.get("ADMIN_PASSWORD") else password
        self.stdout.write(
            self.style.SUCCESS(f"Created admin account: {username} / {shown}  (shown once)")
        )
