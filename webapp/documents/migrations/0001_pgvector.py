from __future__ import annotations

from django.db import migrations
from pgvector.django import VectorExtension


class Migration(migrations.Migration):
    """pgvector first: the Chunk embedding column needs it."""

    initial = True
    dependencies: list = []
    operations = [VectorExtension()]
