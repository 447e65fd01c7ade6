"""The S3 endpoint a benchmark writes chunk KV to: the one ``S3_ENDPOINT`` names, or a
SeaweedFS gateway started for the run, as the dev stack and the tests start it
(``deploy/services.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from deploy import services

BUCKET = "kvcache"  # StoreConfig's default KV bucket


def start_gateway(root: Path) -> services.RunningService:
    """A SeaweedFS S3 gateway with the KV bucket, its data and secret under ``root``. Its
    ``env`` holds the ``S3_*`` variables that reach it; ``stop()`` ends it."""
    return services.start_seaweedfs(
        root,
        port=services.free_port(also_free_at_offset=10000),
        access_key="bench",
        secret_key=services.dev_secret(root, "s3"),
        buckets=(BUCKET,),
    )


def gateway_unless_configured(env: Mapping[str, str], root: Path) -> services.RunningService | None:
    """None where ``env`` names an S3 endpoint (``S3_ENDPOINT``), else :func:`start_gateway`."""
    return None if env.get("S3_ENDPOINT") else start_gateway(root)
