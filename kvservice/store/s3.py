"""S3 tier (MinIO in production, the SeaweedFS gateway in dev and CI). The only module that
talks to S3: a lazily created ``minio.Minio`` client over one pooled HTTP connection
manager, short timeouts and few retries so an unreachable endpoint fails in about a second,
after which calls fail fast for ``s3_down_backoff_s``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import urllib3
from minio import Minio
from minio.error import MinioException, S3Error

from kvservice.protocol.errors import StoreUnavailable
from kvservice.protocol.keys import ChunkKey
from kvservice.store.base import ReadMeter, Tier, TierStats, buffer_nbytes
from kvservice.store.config import StoreConfig
from kvservice.store.format import Buffer

log = logging.getLogger(__name__)

_MISSING_CODES = {"NoSuchKey", "NoSuchObject", "ResourceNotFound"}
_MIN_PART = 5 << 20


class _BufferReader:
    """A file-like reader over a buffer, so uploads do not copy it into a BytesIO."""

    def __init__(self, data: Buffer) -> None:
        self._view = memoryview(data.cpu().numpy() if hasattr(data, "numpy") else data).cast("B")
        self._at = 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._at + size)
        chunk = self._view[self._at : end]
        self._at = end
        return bytes(chunk)


class _MeteredReader:
    """A response body read with ``readinto``, each read timed by the tier's meter: a stream
    stays open while its reader decodes the layers it has (and while other chunks' streams
    are read in turn), time in which the tier is not what anyone waits for."""

    def __init__(self, response: Any, meter: ReadMeter) -> None:
        self._response = response
        self._meter = meter

    def readinto(self, buffer: memoryview) -> int:
        self._meter.start()
        n = 0
        try:
            n = self._response.readinto(buffer) or 0
            return n
        finally:
            self._meter.stop(n)


class S3Tier(Tier):
    name = "s3"
    streams = True

    def __init__(self, config: StoreConfig) -> None:
        super().__init__()
        if not config.s3_endpoint:
            raise ValueError("S3Tier needs S3_ENDPOINT")
        self.config = config
        self.bucket = config.s3_bucket
        self._client: Minio | None = None
        self._client_lock = threading.Lock()
        self._down_until = 0.0
        self._bucket_checked = False

    # -- connection ---------------------------------------------------------------------------

    @property
    def client(self) -> Minio:
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    cfg = self.config
                    http = urllib3.PoolManager(
                        timeout=urllib3.Timeout(
                            connect=cfg.s3_connect_timeout_s, read=cfg.s3_read_timeout_s
                        ),
                        maxsize=max(10, cfg.load_workers * 2),
                        # A read that timed out is not retried (read=0): a frozen gateway
                        # would cost a second timeout (20 s a call where it is now 10 s).
                        retries=urllib3.Retry(
                            total=cfg.s3_retries,
                            read=0,
                            backoff_factor=0.1,
                            status_forcelist=[500, 502, 503, 504],
                        ),
                    )
                    self._client = Minio(
                        cfg.s3_endpoint,
                        access_key=cfg.s3_access_key,
                        secret_key=cfg.s3_secret_key,
                        secure=cfg.s3_secure,
                        region=cfg.s3_region,
                        http_client=http,
                    )
        return self._client

    def object_name(self, key: ChunkKey) -> str:
        return self.config.s3_prefix + key.to_string()

    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _check_up(self) -> None:
        if self.is_down():
            raise StoreUnavailable(
                f"S3 at {self.config.s3_endpoint} was unreachable; retrying after "
                f"{self._down_until - time.monotonic():.1f} s"
            )

    def _unreachable(self, err: BaseException, what: str) -> StoreUnavailable:
        self._count_error()
        self._down_until = time.monotonic() + self.config.s3_down_backoff_s
        log.error(
            "S3 unreachable at %s during %s (%s: %s); serving from local tiers and recomputing "
            "missing chunks for the next %.0f s",
            self.config.s3_endpoint,
            what,
            type(err).__name__,
            err,
            self.config.s3_down_backoff_s,
        )
        return StoreUnavailable(f"S3 at {self.config.s3_endpoint} unreachable during {what}: {err}")

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_up()
        try:
            return fn(*args, **kwargs)
        except S3Error:
            raise
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as err:  # 5xx, network
            raise self._unreachable(err, what) from err

    # -- Tier -------------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        try:
            self._call("stat", self.client.stat_object, self.bucket, self.object_name(key))
            return True
        except S3Error as err:
            if err.code in _MISSING_CODES or err.code == "NoSuchBucket":
                return False
            raise

    def get(self, key: ChunkKey) -> Buffer | None:
        return self._read(key, 0, 0, None)

    def read_range(self, key: ChunkKey, start: int, length: int) -> Buffer | None:
        return self._read(key, start, length, None)

    def read_into(self, key: ChunkKey, start: int, out: memoryview) -> int | None:
        got = self._read(key, start, len(out), out)
        return None if got is None else len(got)

    def _read(
        self, key: ChunkKey, start: int, length: int, out: memoryview | None
    ) -> memoryview | None:
        """One (ranged) GET; ``length`` 0 reads to the end. The body is read straight into
        ``out`` when given (else a new bytearray); returns the filled part."""
        self._meter.start()
        got = 0
        try:
            name = self.object_name(key)
            response = self._call("get", self.client.get_object, self.bucket, name, start, length)
        except S3Error as err:
            self._meter.stop(0)
            if err.code in _MISSING_CODES or err.code == "NoSuchBucket":
                self._count(hit=False)
                return None
            if err.code == "InvalidRange":  # start at or past the end
                self._count(hit=True)
                return memoryview(bytearray())
            raise
        except BaseException:
            self._meter.stop(0)
            raise
        try:
            size = int(response.headers.get("Content-Length", 0))
            if out is None:
                view = memoryview(bytearray(size))
            else:
                view = out[: min(size, len(out))]
            while got < len(view):
                n = response.readinto(view[got:])
                if not n:
                    break
                got += n
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise self._unreachable(err, "get body") from err
        finally:
            response.close()
            response.release_conn()
            self._meter.stop(got)
        self._count(hit=True)
        return view[:got]

    @contextmanager
    def open_stream(self, key: ChunkKey, start: int) -> Iterator[_MeteredReader | None]:
        """One GET from ``start`` to the object's end, read by the caller in pieces as the
        body arrives (a chunk's 30 layers in one signed request instead of 30). The meter
        times the request and each read, not the stream's whole life (``_MeteredReader``).
        A network fault while reading marks S3 down like any other call."""
        self._meter.start()
        try:
            name = self.object_name(key)
            response = self._call("get", self.client.get_object, self.bucket, name, start)
        except S3Error as err:
            if err.code not in _MISSING_CODES and err.code != "NoSuchBucket":
                raise
            response = None
        finally:
            self._meter.stop(0)
        self._count(hit=response is not None)
        if response is None:
            yield None
            return
        try:
            yield _MeteredReader(response, self._meter)
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise self._unreachable(err, "get body") from err
        finally:
            response.close()
            response.release_conn()

    def put(self, key: ChunkKey, data: Buffer) -> None:
        nbytes = buffer_nbytes(data)
        part_size = min(max(_MIN_PART, nbytes), 5 << 30)  # one PUT for any sane chunk
        try:
            self._put(key, data, nbytes, part_size)
        except S3Error as err:
            if err.code != "NoSuchBucket":
                raise
            self._call("make_bucket", self.client.make_bucket, self.bucket)
            self._put(key, data, nbytes, part_size)

    def _put(self, key: ChunkKey, data: Buffer, nbytes: int, part_size: int) -> None:
        self._call(
            "put",
            self.client.put_object,
            self.bucket,
            self.object_name(key),
            _BufferReader(data),
            nbytes,
            part_size=part_size,
        )

    def object_size(self, key: ChunkKey) -> int | None:
        """Bytes of the stored object (one HEAD request), or None where there is none."""
        try:
            stat = self._call("stat", self.client.stat_object, self.bucket, self.object_name(key))
        except S3Error as err:
            if err.code in _MISSING_CODES or err.code == "NoSuchBucket":
                return None
            raise
        return int(stat.size or 0)

    def delete(self, key: ChunkKey) -> bool:
        present = self.contains(key)
        if present:
            self._call("delete", self.client.remove_object, self.bucket, self.object_name(key))
        return present

    def stats(self) -> TierStats:
        return self._snapshot(entries=None, nbytes=None, capacity=None)

    def usage(self) -> tuple[int, int]:
        """(objects, bytes) under the prefix: a listing, so call it sparingly."""
        objects = self._call(
            "list",
            lambda: list(
                self.client.list_objects(self.bucket, prefix=self.config.s3_prefix, recursive=True)
            ),
        )
        return len(objects), sum(obj.size or 0 for obj in objects)
