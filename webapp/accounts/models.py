"""API keys (each user's keys for programs, ``Authorization: Bearer <key>``) and invites
(links staff give someone to create their account).

Of both secrets only the sha256 is stored (``secret_sha256``); the plaintext is shown once,
when it is created. A key's first characters (``prefix``) are kept in the clear so a user can
tell their keys apart and the lookup needs no scan."""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.db import models
from django.utils import timezone


def secret_sha256(plaintext: str) -> str:
    """What is stored of an API key or an invite token."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


class ApiKey(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys"
    )
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, db_index=True)
    key_sha256 = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class Invite(models.Model):
    """A link staff give someone to create their own account and be signed in: used once,
    until ``expires_at``. With ``username`` (or ``email``) given, the account gets it: the
    person then picks only a password."""

    class State(models.TextChoices):
        PENDING = "pending"
        USED = "used"
        EXPIRED = "expired"

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="invites_sent"
    )
    token_sha256 = models.CharField(max_length=64, unique=True)
    username = models.CharField(max_length=150, blank=True)
    email = models.EmailField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    used_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"invite for {self.username or self.email or 'anyone'} ({self.state})"

    @property
    def state(self) -> str:
        if self.used_at is not None:
            return self.State.USED
        if self.expires_at <= timezone.now():
            return self.State.EXPIRED
        return self.State.PENDING
