"""Create an API key for a user and print it once: ``manage.py create_api_key alice``."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from webapp.accounts.services import ApiKeyError, api_key_create


class Command(BaseCommand):
    help = "Create an API key for USERNAME and print it (shown once; only its hash is kept)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="command line", help="what the key is for")

    def handle(self, *args, username: str, name: str, **options) -> None:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"No user named {username!r}.")
        try:
            api_key, plaintext = api_key_create(user=user, name=name)
        except ApiKeyError as err:
            raise CommandError(str(err)) from err
        self.stderr.write(
            f"Created key {api_key.prefix}… “{api_key.name}” for {username}; "
            "it is shown once, store it now:"
        )
        self.stdout.write(plaintext)
