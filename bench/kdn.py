"""The knowledge delivery API as a bench tier (``--tier kdn``) and the stack it needs.

``--tier kdn --kdn-url URL --kdn-key KEY`` reads chunk KV from a running server through
``kvservice.kdn.client``: before timing, each passage is stored with ``PUT /kdn/v1/kv``
(computed by the server's KV worker after the bench's own prompt head, so the keys are the
bench's: same model fingerprint, head hash and tokens, checked); inside the timed prefill
the blender reads the ``POST /kdn/v1/fetch`` stream layer by layer. Without ``--kdn-url``
the bench starts a stack of its own (:class:`KdnStack`) and stops it at exit:

    python -m bench.kdn            # starts one, prints KDN_URL and KDN_KEY, Ctrl-C stops it

:class:`KdnStack` is the dev stack's services (PostgreSQL, the S3 gateway, valkey) in a
temporary directory, migrated, a user with an API key, a Celery worker on the ``kv`` queue and
the web server as ``make dev`` serves it (uvicorn, ASGI), each on a free port.
"""

from __future__ import annotations

import atexit
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from deploy import services
from deploy.devstack import manage, start_services, stop_all
from kvservice.chunk import ChunkKV, LayeredKV
from kvservice.kdn.client import KdnClient, KdnError, KdnFetch
from kvservice.protocol.keys import ChunkKey

BENCH_USER = "bench"


class KdnStack:
    """A throwaway Ragblend stack serving /kdn/v1 (see the module doc); ``stop`` ends all."""

    def __init__(self, extra_env: dict[str, str] | None = None) -> None:
        self._extra_env = extra_env or {}
        self._tmp = tempfile.TemporaryDirectory(prefix="kdn-stack-")
        data = Path(self._tmp.name)
        self._processes: list[Any] = []
        try:
            self._start(data)
        except BaseException:
            self.stop()
            raise

    def _start(self, data: Path) -> None:
        backing, env = start_services(data)
        self._processes += backing
        self.env = {
            **os.environ,
            **env,
            "DATA_DIR": str(data),
            "DEBUG": "false",
            "HTTPS": "false",
            "PYTHONUNBUFFERED": "1",
            **self._extra_env,
        }
        manage("migrate", "--no-input", "-v", "0", env=self.env)
        script = (
            "from django.contrib.auth import get_user_model\n"
            f"get_user_model().objects.create_user(username={BENCH_USER!r})\n"
        )
        manage("shell", "-c", script, env=self.env)
        self.key = subprocess.run(
            [sys.executable, "manage.py", "create_api_key", BENCH_USER],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        self.logs = logs = data / "logs"
        logs.mkdir(exist_ok=True)
        bin_dir = Path(sys.executable).parent
        self._spawn(
            [
                str(bin_dir / "celery"),
                "-A",
                "worker",
                "worker",
                "-Q",
                "kv",
                "--concurrency",
                "1",
                "--hostname",
                "kdn-bench@%h",
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
            ],
            logs / "celery.log",
        )
        port = services.free_port()
        self._spawn(
            [
                str(bin_dir / "uvicorn"),
                "webapp.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            logs / "web.log",
        )
        self.url = f"http://127.0.0.1:{port}"
        self._wait_live(logs)

    def _spawn(self, argv: list[str], log: Path) -> None:
        with open(log, "ab") as out:
            self._processes.append(
                subprocess.Popen(
                    argv,
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=services.die_with_parent(),
                )
            )

    def _wait_live(self, logs: Path, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self._processes if hasattr(p, "poll")):
                raise RuntimeError(f"a process of the KDN stack exited; logs in {logs}")
            try:
                with urllib.request.urlopen(self.url + "/livez", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the web server did not answer within {timeout_s:.0f} s ({logs})")

    def stop(self) -> None:
        stop_all(self._processes)
        self._processes = []
        self._tmp.cleanup()


class KdnBench:
    """The ``StoreBench`` interface (``bench.staging``) over the knowledge delivery API."""

    tier = "kdn"
    proxy = None
    s3_mbps = None

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        precision: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Without ``url``, a stack of its own whose KV worker computes at ``precision``
        (the bench's ``--precision``, so that both compute the same KV); the fetched layers
        are decoded into ``dtype`` (the model's cache dtype, as the store's loader does)."""
        self.dtype = dtype
        env = {"ENGINE_PRECISION": precision} if precision else {}
        self.stack = KdnStack(env) if url is None else None
        if self.stack is not None:
            url, key = self.stack.url, self.stack.key
        if not key:
            raise ValueError("--tier kdn needs --kdn-key with --kdn-url")
        self.client = KdnClient(url, key)
        self._texts: dict[int, str] = {}
        self._head: str | None = None
        self._stored_bytes = 0
        self._chunk_tokens = 0
        self._fetches: dict[str, list[KdnFetch]] = {}

    def stage(self, chunks: Sequence[ChunkKV], *, texts: Sequence[str], head: str) -> None:
        """PUT every passage (not timed); its key must be the bench's own chunk's."""
        self._texts, self._head, self._fetches = {}, head, {}
        self._stored_bytes, self._chunk_tokens = 0, 0
        for chunk, text in zip(chunks, texts, strict=True):
            try:
                stored = self.client.put(text, head=head)
            except KdnError as err:
                if self.stack is not None:  # its logs go with it: show where it failed
                    for log in ("web.log", "celery.log"):
                        print(f"--- {log}\n" + (self.stack.logs / log).read_text()[-3000:])
                raise RuntimeError(f"PUT of a passage failed: {err}") from err
            key = ChunkKey.from_string(stored["key"])
            if key.unscoped() != ChunkKey.of(chunk):
                raise RuntimeError(
                    f"the server stored {key}, the bench computed "
                    f"{ChunkKey.of(chunk)}: another model or tokenizer"
                )
            self._texts[id(chunk)] = text
            self._stored_bytes += stored["stored_bytes"]
            self._chunk_tokens += stored["tokens"]

    def sources(
        self, chunks: Sequence[ChunkKV], mode: str, *, key: str | None = None, ratio: float = 0.0
    ) -> list[LayeredKV | None]:
        """As ``StoreBench.sources`` (no per-chunk load choice: every chunk is read)."""
        if mode == "full":
            return list(chunks)
        read = [mode != "prefix" or i == 0 for i in range(len(chunks))]
        wanted = [self._texts[id(c)] for c, load in zip(chunks, read, strict=True) if load]
        fetch = self.client.fetch(wanted, head=self._head, dtype=self.dtype)
        self._fetches.setdefault(key or mode, []).append(fetch)
        loaded = iter(fetch.sources)
        return [next(loaded) if load else None for load in read]

    def report(self, mode: str, **_: Any) -> dict[str, Any]:
        per_token = self._stored_bytes / max(1, self._chunk_tokens)
        common = {"tier": self.tier, "s3_mbps": None, "kv_bytes_per_token": per_token}
        fetches = self._fetches.get(mode, [])
        for fetch in fetches:
            fetch.token_ids.exception()  # the body read to its end
        if not fetches:
            return common | {"load_s": 0.0, "hidden_load_fraction": None, "ratio_chosen": None}
        load_s = statistics.median(f.load_s for f in fetches)
        wait_s = statistics.median(f.wait_s for f in fetches)
        return common | {
            "pipelined": True,
            "load_s": load_s,
            "load_wait_s": wait_s,
            "hidden_load_fraction": max(0.0, 1.0 - wait_s / load_s) if load_s else 1.0,
            "load_bytes": fetches[-1].bytes_read,
            "ratio_chosen": None,
        }

    def close(self) -> None:
        self.client.close()
        if self.stack is not None:
            self.stack.stop()
            self.stack = None


_BENCHES: dict[tuple[str | None, str | None], KdnBench] = {}


def kdn_bench(
    url: str | None,
    key: str | None,
    precision: str | None = None,
    dtype: torch.dtype | None = None,
) -> KdnBench:
    """One KdnBench per server in the process, closed (its stack stopped) at exit."""
    if (url, key) not in _BENCHES:
        _BENCHES[(url, key)] = KdnBench(url, key, precision=precision, dtype=dtype)
        atexit.register(_BENCHES[(url, key)].close)
    return _BENCHES[(url, key)]


def fetch_seconds(
    loader, client: KdnClient, texts: list[str], keys: list[str], *, api_first: bool
) -> tuple[float, float]:
    """(S3 read directly by the store's loader, the same objects through the API): seconds
    from the request to every layer of every chunk decoded, once each, in either order."""

    def from_s3() -> None:
        batch = loader.open([ChunkKey.from_string(k) for k in keys])
        for source in batch:
            for index in range(source.num_layers):
                source.layer(index)

    def from_api() -> None:
        client.fetch(texts).chunks()

    order = [("api", from_api), ("s3", from_s3)]
    seconds = {}
    for name, read in order if api_first else reversed(order):
        started = time.perf_counter()
        read()
        seconds[name] = time.perf_counter() - started
    return seconds["s3"], seconds["api"]


def s3_loader(stack: KdnStack):
    """The store's loader over the stack's S3 tier alone (as a worker with S3 credentials
    reads it), not promoting what it reads into faster tiers."""
    from kvservice.store import KVLoader, StoreConfig, TieredStore
    from kvservice.store.s3 import S3Tier

    config = StoreConfig.from_env(stack.env)
    return KVLoader(TieredStore([S3Tier(config)], config=config), promote=False)


def main(argv: Sequence[str] | None = None) -> None:
    """Without ``--data``: start a stack, print KDN_URL and KDN_KEY, wait for Ctrl-C. With
    it: the fetch alone, S3 read directly against the API, on the passages of each example
    stored once (PUT), ``--repeats`` times each, interleaved; medians printed."""
    import argparse
    import json

    from bench.data import passage_texts

    parser = argparse.ArgumentParser(prog="python -m bench.kdn", description=main.__doc__)
    parser.add_argument("--data", type=Path, default=None, help="Musique JSON")
    parser.add_argument("--first", type=int, default=20)
    parser.add_argument("--examples", type=int, default=5)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    stack = KdnStack()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if args.data is None:
            print(f"KDN_URL={stack.url}\nKDN_KEY={stack.key}\nCtrl-C stops it.", flush=True)
            while True:
                time.sleep(3600)
        client, loader = KdnClient(stack.url, stack.key), s3_loader(stack)
        examples = json.loads(args.data.read_text())[args.first : args.first + args.examples]
        ratios = []
        for number, example in enumerate(examples, start=args.first):
            texts = passage_texts(example, args.passages)
            keys = [client.put(text)["key"] for text in texts]
            times = [
                fetch_seconds(loader, client, texts, keys, api_first=r % 2 == 1)
                for r in range(args.repeats)
            ]
            s3_s = statistics.median(t[0] for t in times)
            kdn_s = statistics.median(t[1] for t in times)
            ratios.append(kdn_s / s3_s)
            print(
                f"example {number}: S3 {s3_s * 1e3:.0f} ms, API {kdn_s * 1e3:.0f} ms "
                f"({kdn_s / s3_s:.2f}x)",
                flush=True,
            )
        print(f"API over S3, median of examples: {statistics.median(ratios):.2f}x")
        loader.close()
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
