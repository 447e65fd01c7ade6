"""Create the S3 buckets the product uses (documents and KV cache) if they do not exist.

Run once per deployment after ``migrate`` (Compose's and Kubernetes' migrate jobs do); the
dev launcher creates them itself when it starts its own S3 gateway."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand

from webapp.storage import object_store


class Command(BaseCommand):
    help = "Create the documents and KV-cache buckets (idempotent)."

    def handle(self, *args, **options) -> None:
        client = object_store()
        for bucket in (settings.S3_DOCUMENTS_BUCKET, settings.S3_KV_BUCKET):
            if client.bucket_exists(bucket):
                self.stdout.write(f"Bucket {bucket!r} exists already.")
            else:
                client.make_bucket(bucket)
                self.stdout.write(f"Created bucket {bucket!r}.")
