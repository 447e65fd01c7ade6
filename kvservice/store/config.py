"""Store settings, read once from the environment into a dataclass.

| variable | default | meaning |
|---|---|---|
| ``S3_ENDPOINT`` | unset (no S3 tier) | ``host:port`` of the S3/MinIO endpoint |
| ``S3_ACCESS_KEY`` / ``S3_SECRET_KEY`` | empty | credentials |
| ``S3_SECURE`` | ``false`` | use HTTPS |
| ``KV_S3_BUCKET`` | ``kvcache`` | bucket of chunk objects |
| ``KV_S3_PREFIX`` | ``kv/`` | key prefix inside the bucket |
| ``KV_S3_CONNECT_TIMEOUT_S`` / ``KV_S3_READ_TIMEOUT_S`` | ``1`` / ``10`` | per-request timeouts |
| ``KV_S3_RETRIES`` | ``1`` | retries on connection errors and 5xx |
| ``KV_S3_DOWN_BACKOFF_S`` | ``5`` | after S3 is found unreachable, fail fast for this long |
| ``KV_DEVICE_CAPACITY_BYTES`` | ``0`` (off) | device-memory tier (needs CUDA) |
| ``KV_CPU_CAPACITY_BYTES`` | ``2 GiB`` | CPU-memory tier |
| ``KV_CPU_PINNED`` | ``auto`` | hold that tier in page-locked memory (``auto``: where CUDA is) |
| ``KV_DISK_CAPACITY_BYTES`` | ``20 GiB`` | local-disk tier (``0`` turns it off) |
| ``KV_DISK_DIR`` | ``DATA_DIR/kv-disk`` | local-disk tier directory (``kvservice.paths``) |
| ``KV_CODEC`` | the default | how new objects store K/V: ``fp16``, ``int8``, ``fp8``, ``kivi4``.. |
| ``KV_QUANTIZE`` | ``false`` | the switch before ``KV_CODEC``: ``true`` means ``KV_CODEC=int8`` |
| ``KV_STORE_DTYPE`` | ``float16`` | float32 KV stored (fp16) or decoded as this 16-bit type |
| ``KV_LOAD_WORKERS`` | ``16`` | background fetch threads of the pipelined loader |
| ``KV_STREAM_THREADS`` | ``2`` | threads reading the chunks that S3 streams, a layer each in turn |
| ``KV_PREFETCH_DEPTH`` | ``2`` | layers fetched ahead of the one in use, per chunk |
| ``KV_LOAD_NICE`` | ``0`` | how far the fetch threads lower their CPU priority (Linux, 0-19) |

``KV_CODEC`` names a codec of ``kvservice.store.codec.CODECS`` (``fp16`` is unquantized, in
``KV_STORE_DTYPE``); objects already stored keep theirs until re-encoded
(``manage.py kv_reencode``). ``KV_QUANTIZE=true`` means ``int8`` where ``KV_CODEC`` is unset.

Sizes accept plain bytes or a ``KiB/MiB/GiB`` suffix. A bad value fails at start with the
variable's name in the message.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvservice.paths import DEFAULT_DATA_DIR, data_dir, kv_disk_dir
from kvservice.store.codec import DEFAULT_CODEC, Codec, codec_by_name

_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 2GiB or plain bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_auto_bool(text: str) -> bool | None:
    return None if text.strip().lower() == "auto" else _parse_bool(text)


@dataclass(frozen=True)
class StoreConfig:
    s3_endpoint: str | None = None
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_secure: bool = False
    s3_region: str | None = None
    s3_bucket: str = "kvcache"
    s3_prefix: str = "kv/"
    s3_connect_timeout_s: float = 1.0
    s3_read_timeout_s: float = 10.0
    s3_retries: int = 1
    s3_down_backoff_s: float = 5.0
    device_capacity_bytes: int = 0
    cpu_capacity_bytes: int = 2 << 30
    cpu_pinned: bool | None = None  # None: where CUDA is available
    disk_capacity_bytes: int = 20 << 30
    # from_env: under the environment's DATA_DIR; built directly: under the default one
    disk_dir: str = str(kv_disk_dir(Path(DEFAULT_DATA_DIR)))
    quantize: bool = False
    codec: str = DEFAULT_CODEC
    store_dtype: str = "float16"
    load_workers: int = 16
    stream_threads: int = 2
    prefetch_depth: int = 2
    load_nice: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreConfig:
        env = os.environ if environ is None else environ
        fields: dict[str, object] = {}
        spec = [  # (variable, field, parser)
            ("S3_ENDPOINT", "s3_endpoint", lambda s: s.strip() or None),
            ("S3_ACCESS_KEY", "s3_access_key", str),
            ("S3_SECRET_KEY", "s3_secret_key", str),
            ("S3_SECURE", "s3_secure", _parse_bool),
            ("S3_REGION", "s3_region", lambda s: s.strip() or None),
            ("KV_S3_BUCKET", "s3_bucket", str),
            ("KV_S3_PREFIX", "s3_prefix", str),
            ("KV_S3_CONNECT_TIMEOUT_S", "s3_connect_timeout_s", float),
            ("KV_S3_READ_TIMEOUT_S", "s3_read_timeout_s", float),
            ("KV_S3_RETRIES", "s3_retries", int),
            ("KV_S3_DOWN_BACKOFF_S", "s3_down_backoff_s", float),
            ("KV_DEVICE_CAPACITY_BYTES", "device_capacity_bytes", parse_size),
            ("KV_CPU_CAPACITY_BYTES", "cpu_capacity_bytes", parse_size),
            ("KV_CPU_PINNED", "cpu_pinned", _parse_auto_bool),
            ("KV_DISK_CAPACITY_BYTES", "disk_capacity_bytes", parse_size),
            ("KV_DISK_DIR", "disk_dir", str),
            ("KV_QUANTIZE", "quantize", _parse_bool),
            ("KV_CODEC", "codec", lambda s: s.strip().lower()),
            ("KV_STORE_DTYPE", "store_dtype", str),
            ("KV_LOAD_WORKERS", "load_workers", int),
            ("KV_STREAM_THREADS", "stream_threads", int),
            ("KV_PREFETCH_DEPTH", "prefetch_depth", int),
            ("KV_LOAD_NICE", "load_nice", int),
        ]
        for variable, name, parse in spec:
            if variable in env:
                try:
                    fields[name] = parse(env[variable])
                except ValueError as err:
                    raise ValueError(f"{variable}: {err}") from err
        fields.setdefault("disk_dir", str(kv_disk_dir(data_dir(env))))
        if fields.get("quantize") and "codec" not in fields:
            fields["codec"] = "int8"
        config = cls(**fields)  # type: ignore[arg-type]
        config.validate()
        return config

    @property
    def pin_cpu_tier(self) -> bool:
        """Whether the CPU-memory tier is page-locked: ``KV_CPU_PINNED``, else where CUDA is."""
        if self.cpu_pinned is not None:
            return self.cpu_pinned
        import torch

        return torch.cuda.is_available()

    @property
    def narrow_to(self):
        """The 16-bit type float32 KV is stored as, or None to store it as is."""
        import torch

        return None if self.store_dtype == "float32" else getattr(torch, self.store_dtype)

    @property
    def kv_codec(self) -> Codec:
        """The codec new objects are written with."""
        return codec_by_name(self.codec)

    def validate(self) -> None:
        try:
            codec_by_name(self.codec)
        except ValueError as err:
            raise ValueError(f"KV_CODEC: {err}") from err
        for name in ("device_capacity_bytes", "cpu_capacity_bytes", "disk_capacity_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.store_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"KV_STORE_DTYPE must be float32, float16 or bfloat16, "
                             f"not {self.store_dtype!r}")  # fmt: skip
        if self.load_workers < 1:
            raise ValueError("KV_LOAD_WORKERS must be >= 1")
        if self.stream_threads < 1:
            raise ValueError("KV_STREAM_THREADS must be >= 1")
        if self.prefetch_depth < 0:
            raise ValueError("KV_PREFETCH_DEPTH must be >= 0")
        if not 0 <= self.load_nice <= 19:
            raise ValueError("KV_LOAD_NICE must be between 0 and 19")
        if self.s3_retries < 0 or self.s3_connect_timeout_s <= 0 or self.s3_read_timeout_s <= 0:
            raise ValueError("S3 timeouts must be > 0 and retries >= 0")
