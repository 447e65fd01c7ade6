"""Session-wide real services for the test suite: each starts once, on free ports, with its
data in a temporary directory, and stops at the end of the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy import services

TEST_S3_BUCKETS = ("documents", "kvcache")


@pytest.fixture(scope="session")
def services_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def s3_service(services_dir: Path) -> Iterator[services.RunningService]:
    """A real S3 endpoint (the SeaweedFS gateway); ``.env`` has S3_ENDPOINT/ACCESS/SECRET."""
    service = services.start_seaweedfs(
        services_dir,
        port=services.free_port(also_free_at_offset=10000),
        access_key="test-access",
        secret_key="test-secret-key",
        buckets=TEST_S3_BUCKETS,
    )
    yield service
    service.stop()
