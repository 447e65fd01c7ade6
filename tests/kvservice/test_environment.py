"""One registry of environment variables (kvservice.protocol.environment): each read with its
type and default, a bad value refused naming it, the docs generated from it, and no other
production module reading the environment."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvservice.protocol import environment
from kvservice.protocol.environment import VARIABLES, ConfigurationError, read

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("webapp", "kvservice", "worker", "deploy")


def test_values_are_typed_and_unset_or_blank_means_the_default() -> None:
    assert read("CHUNK_TOKENS", {}) == 512
    assert read("CHUNK_TOKENS", {"CHUNK_TOKENS": " 256 "}) == 256
    assert read("CHUNK_TOKENS", {"CHUNK_TOKENS": "  "}) == 512
    assert read("S3_SECURE", {"S3_SECURE": "Yes"}) is True
    assert read("WEB_WARM_UP", {"WEB_WARM_UP": "0"}) is False
    assert read("KV_CPU_PINNED", {"KV_CPU_PINNED": "auto"}) is None
    assert read("ENGINE_BUFFER_BYTES", {"ENGINE_BUFFER_BYTES": "3GiB"}) == 3 << 30
    assert read("ALLOWED_HOSTS", {"ALLOWED_HOSTS": "a.example, b.example"}) == [
        "a.example",
        "b.example",
    ]
    assert read("KV_SOURCE", {"KV_SOURCE": " KDN "}) == "kdn"
    assert read("ENGINE_STEP_BUDGET", {"ENGINE_STEP_BUDGET": "off"}) == math.inf
    assert read("BLEND_REFRESH_RATIO", {}) == 0.25  # progressive blend on by default
    assert read("BLEND_REFRESH_RATIO", {"BLEND_REFRESH_RATIO": "off"}) is None
    assert read("KV_S3_PREFIX", {"KV_S3_PREFIX": ""}) == ""  # blank kept: the bucket's root
    assert read("RAGBLEND_MODEL_CACHE", {"RAGBLEND_MODEL_CACHE": "~/m"}) == Path.home() / "m"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("CHUNK_TOKENS", "many", "CHUNK_TOKENS must be a whole number, not 'many'"),
        ("CHUNK_TOKENS", "0", "CHUNK_TOKENS must be at least 1, not '0'"),
        ("INVITE_VALID_DAYS", "91", "INVITE_VALID_DAYS must be 1 to 90, not '91'"),
        ("KDN_TOKEN_TTL_S", "0", "KDN_TOKEN_TTL_S must be above 0, not '0'"),
        ("DEBUG", "maybe", "DEBUG must be true or false, not 'maybe'"),
        ("KV_SOURCE", "gcs", "KV_SOURCE must be 's3' or 'kdn', not 'gcs'"),
        ("ENGINE_KERNEL", "x", "ENGINE_KERNEL must be one of 'torch', 'onednn', 'onednn-bf16'"),
        ("PREFIX_CACHE_BYTES", "lots", "PREFIX_CACHE_BYTES is not a size: 'lots'"),
        ("LOGIN_RATE_LIMIT", "20", "LOGIN_RATE_LIMIT must be a count per period"),
        ("BLEND_REFRESH_RATIO", "1.5", "BLEND_REFRESH_RATIO must be off, or a ratio above 0"),
        ("ENGINE_STEP_BUDGET", "soon", "ENGINE_STEP_BUDGET must be auto, off, or seconds"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        read(name, {name: value})
    assert str(refused.value).startswith(message)
    assert isinstance(refused.value, ValueError)  # what the workers' start catches


def test_an_undeclared_name_is_a_programming_error() -> None:
    with pytest.raises(KeyError, match="NOT_A_SETTING is not declared"):
        read("NOT_A_SETTING", {})


def test_the_process_environment_is_read_when_no_mapping_is_given(monkeypatch) -> None:
    monkeypatch.setenv("KV_PREAMBLE", "on")
    assert read("KV_PREAMBLE") == "on"
    monkeypatch.delenv("KV_PREAMBLE")
    assert read("KV_PREAMBLE") == "off"


def test_every_variable_has_a_doc_a_section_and_a_default_that_parses() -> None:
    for variable in VARIABLES.values():
        assert variable.name.isupper() and variable.doc and variable.section, variable
        assert variable.default_text, variable
        if isinstance(variable.default, (int, float, str)) and not isinstance(
            variable.default, bool
        ):  # the default, written out, reads back as itself
            assert variable.read({variable.name: str(variable.default)}) == variable.default


def test_the_registry_agrees_with_the_engine_constants() -> None:
    """Defaults the torch side also keeps (the registry imports no torch), checked equal."""
    from kvservice.model.kernels import DEFAULT_PRECISION, KERNELS, PRECISIONS
    from kvservice.protocol.codecs import DEFAULT_CODEC
    from kvservice.serve.prefix import DEFAULT_CAPACITY_BYTES
    from kvservice.store.buffers import DEFAULT_LIMIT_BYTES
    from kvservice.store.config import StoreConfig

    assert read("ENGINE_PRECISION", {}) == DEFAULT_PRECISION
    for precision in PRECISIONS:
        assert read("ENGINE_PRECISION", {"ENGINE_PRECISION": precision}) == precision
    for kernel in KERNELS:
        assert read("ENGINE_KERNEL", {"ENGINE_KERNEL": kernel}) == kernel
    assert read("ENGINE_BUFFER_BYTES", {}) == DEFAULT_LIMIT_BYTES
    assert read("PREFIX_CACHE_BYTES", {}) == DEFAULT_CAPACITY_BYTES
    assert VARIABLES["KV_CODEC"].default_text == f"`{DEFAULT_CODEC}`"
    built, from_env = StoreConfig(), StoreConfig.from_env({})
    for field in fields(StoreConfig):
        if field.name != "disk_dir":  # under the default DATA_DIR, resolved from_env
            assert getattr(built, field.name) == getattr(from_env, field.name), field.name


def test_the_worker_config_defaults_are_the_registry_defaults() -> None:
    from kvservice.config import WorkerConfig
    from kvservice.protocol.heartbeat import HEARTBEAT_KEY
    from kvservice.protocol.requests import INFERENCE_QUEUE

    config = WorkerConfig.from_env({"REDIS_URL": "redis://127.0.0.1:1/0"})
    assert (config.queue, config.heartbeat_key) == (INFERENCE_QUEUE, HEARTBEAT_KEY)
    for field in ("precision", "kernel", "buffer_bytes", "prefix_cache_bytes", "kv_source"):
        assert getattr(config, field) == next(
            f.default for f in fields(WorkerConfig) if f.name == field
        ), field


def test_docs_configuration_md_is_the_generated_table() -> None:
    """Regenerate with `python -m kvservice.protocol.environment --markdown >
    docs/configuration.md`."""
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == environment.markdown()
    assert all(f"`{name}`" in committed for name in VARIABLES)


def _production_files() -> list[Path]:
    return sorted(p for top in PRODUCTION for p in (ROOT / top).rglob("*.py"))


# The only other mentions of the process environment in production code, each a write, not
# a read of a setting: Django's convention for its settings module, OpenMP's wait policy set
# for torch, the dev stack's file filling unset variables, and the environments built for
# child processes.
ALLOWED = {
    'os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")',
    'os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")',
    "os.environ.setdefault(name, value)",
    "{**os.environ,",
    "**os.environ,",
}


def test_production_code_reads_the_environment_only_through_the_registry() -> None:
    registry = ROOT / "kvservice" / "protocol" / "environment.py"
    found = []
    for path in _production_files():
        if path == registry:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bos\.(environ|getenv)\b|\bgetenv\(|\benviron\.Env\(\)", line):
                if not any(allowed in line for allowed in ALLOWED):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "read these through kvservice.protocol.environment:\n" + "\n".join(found)


def test_every_variable_production_code_reads_is_declared_and_every_declared_one_is_read() -> None:
    read_names: set[str] = set()
    mentioned = ""
    for path in _production_files():
        text = path.read_text()
        if path.name != "environment.py":
            mentioned += text
        read_names |= set(re.findall(r"""\bread\(\s*["']([A-Z][A-Z0-9_]+)["']""", text))
    assert read_names - set(VARIABLES) == set()
    unread = [name for name in VARIABLES if f'"{name}"' not in mentioned]
    assert unread == [], f"declared but read nowhere: {unread}"
