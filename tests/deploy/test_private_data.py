"""What a dev stack keeps under DATA_DIR (passages and questions in valkey's dump and append
log, answer tokens in the logs, originals in S3, the database) is its user's alone: every
file 0600, every directory 0700, however old the files."""

from __future__ import annotations

import io
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from minio import Minio

from deploy import devstack, services

_EXTERNAL_SERVICES = ("DATABASE_URL", "S3_ENDPOINT", "S3_ACCESS_KEY", "S3_SECRET_KEY", "REDIS_URL")


def loose_entries(root: Path) -> list[str]:
    """What ``find root -mindepth 1 -perm /077`` lists: entries under ``root`` that another
    user may read, write or enter (links are not followed, and their own mode means
    nothing)."""
    loose = []
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = Path(directory, name)
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode) and stat.S_IMODE(mode) & 0o077:
                loose.append(f"{stat.filemode(mode)} {path.relative_to(root)}")
    return sorted(loose)


def _weeds_volume_info(entry: str) -> bool:
    """weed writes each volume's ``.vif`` file and then sets it 0644 itself, whatever the
    umask: it stays behind DATA_DIR/s3, 0700, where no other user can enter."""
    path = Path(entry.split(" ", 1)[1])
    return entry.startswith("-rw-r--r--") and path.parent == Path("s3") and path.suffix == ".vif"


def assert_private(data: Path) -> None:
    """Nothing under ``data`` is open to another user, nor is ``data`` itself; but as root,
    where PostgreSQL runs as its own system user, ``data`` lets that user's group through
    to its directory (0710) and no one else."""
    loose = loose_entries(data)
    assert [entry for entry in loose if not _weeds_volume_info(entry)] == []
    assert not loose or stat.S_IMODE((data / "s3").stat().st_mode) == 0o700
    top = data.stat()
    if os.geteuid() == 0 and stat.S_IMODE(top.st_mode) == 0o710:
        assert top.st_gid == pwd.getpwnam(services.PG_SYSTEM_USER).pw_gid
    else:
        assert stat.S_IMODE(top.st_mode) == 0o700


def _an_older_stacks_files(data: Path) -> None:
    """Files as a stack wrote them before: 0644 in 0755 directories."""
    (data / "logs").mkdir(parents=True)
    (data / "logs" / "inference.log").write_text("answer tokens\n")
    (data / "kv-disk" / "ab").mkdir(parents=True)
    (data / "kv-disk" / "ab" / "chunk").write_bytes(b"kv")
    for path in [data, *data.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.fixture
def data() -> Iterator[Path]:
    """A DATA_DIR outside pytest's temporary root, which every pytest run (of any test
    session on the machine) sets back to 0700: as root, that locks PostgreSQL's system user
    out of a data directory under it."""
    root = Path(tempfile.mkdtemp(prefix="ragblend-private-"))
    yield root / "data"
    shutil.rmtree(root, ignore_errors=True)


def test_the_stacks_services_keep_data_dir_private(data: Path, monkeypatch) -> None:
    _an_older_stacks_files(data)
    for name in _EXTERNAL_SERVICES:  # the suite's own services: the stack starts its own
        monkeypatch.delenv(name, raising=False)
    started, env = devstack.start_services(data)
    try:
        valkey = redis.Redis.from_url(env["REDIS_URL"])
        valkey.set("question", "what does the passage say?")
        valkey.save()  # dump.rdb, beside the append-only files
        s3 = Minio(
            env["S3_ENDPOINT"],
            access_key=env["S3_ACCESS_KEY"],
            secret_key=env["S3_SECRET_KEY"],
            secure=False,
        )
        s3.put_object("documents", "original.txt", io.BytesIO(b"passage"), 7)
        written = (
            "valkey/dump.rdb",
            "valkey/appendonlydir",
            "logs/valkey.log",
            "logs/seaweedfs.log",
            "logs/postgres.log",
            "postgres/PG_VERSION",
        )
        for path in written:
            assert (data / path).exists(), path
        assert_private(data)
    finally:
        devstack.stop_all(started)
    assert_private(data)


def test_loose_entries_sees_what_find_perm_077_sees(tmp_path) -> None:
    (tmp_path / "open").mkdir(mode=0o755)
    (tmp_path / "open" / "file").write_text("x")
    (tmp_path / "open" / "file").chmod(0o640)
    (tmp_path / "closed").mkdir(mode=0o700)
    (tmp_path / "closed" / "file").write_text("x")
    (tmp_path / "closed" / "file").chmod(0o600)
    (tmp_path / "closed" / "link").symlink_to(tmp_path / "open")
    assert loose_entries(tmp_path) == ["-rw-r----- open/file", "drwxr-xr-x open"]
