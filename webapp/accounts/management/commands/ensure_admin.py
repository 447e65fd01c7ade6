"""Create the first admin account if there is none.

Credentials come from ADMIN_USERNAME / ADMIN_PASSWORD (and ADMIN_EMAIL); without a password a
random one is generated and printed once. An existing superuser is left alone.
"""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from kvservice.protocol import environment


class Command(BaseCommand):
    help = "Create the first admin account (idempotent)."

    def handle(self, *args, **options) -> None:
        users = get_user_model()
        if users.objects.filter(is_superuser=True).exists():
            self.stdout.write("An admin account exists already.")
            return
        username = environment.read("ADMIN_USERNAME")
        given = environment.read("ADMIN_PASSWORD")
        password = given or secrets.token_urlsafe(12)
        users.objects.create_superuser(
            username=username, email=environment.read("ADMIN_EMAIL"), password=password
        )
        shown = "(from ADMIN_PASSWORD)" if given else password
        self.stdout.write(
            self.style.SUCCESS(f"Created admin account: {username} / {shown}  (shown once)")
        )
