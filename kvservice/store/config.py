"""Store settings, read once from the environment into a dataclass (``StoreConfig.from_env``).

The variables (``S3_*``, ``KV_S3_*``, the tiers' ``KV_*_CAPACITY_BYTES``, ``KV_CODEC``..)
are declared, with their types, defaults and docs, in ``kvservice.protocol.environment``
(docs/configuration.md lists them); ``from_env`` maps each onto its field below.

``KV_CODEC`` names a codec of ``kvservice.protocol.codecs.CODECS`` (``fp16`` is unquantized, in
``KV_STORE_DTYPE``); objects already stored keep theirs until re-encoded
(``python -m worker.kv_reencode``). ``KV_QUANTIZE=true`` means ``int8`` where ``KV_CODEC`` is unset.
A bad value fails at start with the variable's name in the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvservice.paths import DEFAULT_DATA_DIR, data_dir, kv_disk_dir
from kvservice.protocol import environment
from kvservice.protocol.codecs import DEFAULT_CODEC, Codec, codec_by_name, configured_codec

# Each field that the environment sets, and its variable.
_VARIABLES = {
    "s3_endpoint": "S3_ENDPOINT",
    "s3_access_key": "S3_ACCESS_KEY",
    "s3_secret_key": "S3_SECRET_KEY",
    "s3_secure": "S3_SECURE",
    "s3_region": "S3_REGION",
    "s3_bucket": "KV_S3_BUCKET",
    "s3_prefix": "KV_S3_PREFIX",
    "s3_connect_timeout_s": "KV_S3_CONNECT_TIMEOUT_S",
    "s3_read_timeout_s": "KV_S3_READ_TIMEOUT_S",
    "s3_retries": "KV_S3_RETRIES",
    "s3_down_backoff_s": "KV_S3_DOWN_BACKOFF_S",
    "device_capacity_bytes": "KV_DEVICE_CAPACITY_BYTES",
    "cpu_capacity_bytes": "KV_CPU_CAPACITY_BYTES",
    "cpu_pinned": "KV_CPU_PINNED",
    "disk_capacity_bytes": "KV_DISK_CAPACITY_BYTES",
    "disk_dir": "KV_DISK_DIR",
    "quantize": "KV_QUANTIZE",
    "codec": "KV_CODEC",
    "store_dtype": "KV_STORE_DTYPE",
    "load_workers": "KV_LOAD_WORKERS",
    "stream_threads": "KV_STREAM_THREADS",
    "prefetch_depth": "KV_PREFETCH_DEPTH",
    "load_nice": "KV_LOAD_NICE",
}


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
        """The store's variables in ``environ`` (default: the process environment)."""
        fields = {name: environment.read(each, environ) for name, each in _VARIABLES.items()}
        fields["s3_endpoint"] = fields["s3_endpoint"] or None
        if fields["disk_dir"] is None:
            fields["disk_dir"] = str(kv_disk_dir(data_dir(environ)))
        # the rule the dashboard names the configured codec by, so the two never differ
        fields["codec"] = configured_codec(fields["codec"], fields["quantize"])
        config = cls(**fields)
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
            raise ValueError(
                f"KV_STORE_DTYPE must be float32, float16 or bfloat16, not {self.store_dtype!r}"
            )
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
