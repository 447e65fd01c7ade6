from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="pw-alice-123")


@pytest.fixture
def other_user(django_user_model):
    return django_user_model.objects.create_user(username="bob", password="pw-bob-123")


@pytest.fixture
def alice_client(client, user):
    client.force_login(user)
    return client


def upload(name: str, data: bytes) -> SimpleUploadedFile:
    return SimpleUploadedFile(name, data, content_type="application/octet-stream")
