"""A client of the knowledge delivery API (``/kdn/v1``, docs/kdn.md), without Django.

    client = KdnClient("http://127.0.0.1:8000", api_key)
    client.put("A passage of text.")              # {"key", "tokens", "stored_bytes", ...}
    fetch = client.fetch(["A passage of text."])  # streams; returns once the headers are in
    k, v = fetch.sources[0].layer(0)              # LayeredKV: what blend_prefill reads
    chunks = client.fetch_chunks([...])           # or every layer decoded, as ChunkKV

:meth:`KdnClient.fetch` reads the response body (``kvservice.kdn_stream``) in a background
thread, layer by layer, decoding each chunk's layer as it arrives; a source's ``layer(i)``
waits only for layer ``i``, so the engine computes layer ``i`` while later layers arrive, as
with the store's own loader (``kvservice.store.loader``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import urllib3

from kvservice.chunk import ChunkKV
from kvservice.kdn_stream import StreamReader
from kvservice.store.format import ChunkHeader

LayerKV = tuple[torch.Tensor, torch.Tensor]
_RATE_LIMIT_TRIES = 10


class KdnError(RuntimeError):
    """The API answered with an error (``status``, ``code`` and its ``message``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class KdnNotFound(KdnError):
    """A text is not stored in the caller's KV scope (``message`` says which)."""


@dataclass(frozen=True)
class KdnConfig:
    url: str
    key: str
    timeout_s: float = 600.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KdnConfig:
        """``KDN_URL`` (the web server, e.g. http://127.0.0.1:8000) and ``KDN_KEY`` (an API
        key), each named in the error when missing; ``KDN_TIMEOUT_S`` optional."""
        missing = [name for name in ("KDN_URL", "KDN_KEY") if not env.get(name)]
        if missing:
            raise ValueError(f"KV_SOURCE=kdn needs {' and '.join(missing)}")
        return cls(env["KDN_URL"], env["KDN_KEY"], float(env.get("KDN_TIMEOUT_S") or 600))


class KdnLayeredKV:
    """One text's KV from a fetch, layer by layer (a ``LayeredKV``)."""

    tier = "kdn"

    def __init__(self, header: ChunkHeader, fetch: KdnFetch, index: int) -> None:
        self.header, self._fetch, self._index = header, fetch, index
        self.num_tokens = header.num_tokens
        self.num_layers = header.num_layers
        self.head_hash = header.head_hash  # the blender checks it against its prompt head
        self.model_fingerprint = header.model_fingerprint
        self.tokens_sha256 = header.tokens_sha256

    def layer(self, index: int) -> LayerKV:
        return self._fetch.layer(self._index, index)


class KdnFetch:
    """One ``POST /kdn/v1/fetch`` being read: ``sources`` (one per text, in order), the
    body read by a background thread; ``wait_s`` is the time consumers were blocked on it,
    ``load_s`` the time from the request to the last byte."""

    def __init__(self, response: Any, started: float, device: torch.device) -> None:
        self._response = response
        self._started = started
        self.device = device
        self.total_tokens = int(response.headers.get("X-KV-Tokens", 0))
        self.reader = StreamReader(response)
        headers = self.reader.read_headers()
        self.sources = [KdnLayeredKV(h, self, j) for j, h in enumerate(headers)]
        self._layers: list[Future[list[LayerKV]]] = [
            Future() for _ in range(self.reader.num_layers)
        ]
        self.token_ids: Future[list[list[int]]] = Future()
        self.bytes_read = int(response.headers.get("Content-Length", 0))
        self.load_s = 0.0
        self.wait_s = 0.0
        self._wait_lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, name="kdn-fetch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        futures: list[Future[Any]] = [*self._layers, self.token_ids]
        try:
            for index, future in enumerate(self._layers):
                layer = self.reader.read_layer(index)
                if self.device.type != "cpu":
                    layer = [(k.to(self.device), v.to(self.device)) for k, v in layer]
                future.set_result(layer)
            self.token_ids.set_result(self.reader.read_token_ids())
        except BaseException as err:  # whatever is not read fails, never hangs
            for future in futures:
                if not future.done():
                    future.set_exception(err)
        finally:
            self.load_s = time.perf_counter() - self._started
            self._response.release_conn()

    def layer(self, chunk: int, index: int) -> LayerKV:
        started = time.perf_counter()
        try:
            return self._layers[index].result()[chunk]
        finally:
            with self._wait_lock:
                self.wait_s += time.perf_counter() - started

    def chunks(self) -> list[ChunkKV]:
        """Every text's KV as a ``ChunkKV`` (waits for the whole body)."""
        layers = [future.result() for future in self._layers]
        token_ids = self.token_ids.result()
        out = []
        for j, source in enumerate(self.sources):
            k = torch.stack([layer[j][0] for layer in layers])  # k: [L, H_kv, T, D]
            v = torch.stack([layer[j][1] for layer in layers])  # v: [L, H_kv, T, D]
            out.append(ChunkKV(token_ids[j], k, v, source.model_fingerprint, source.head_hash))
        return out

    def close(self) -> None:
        """Stop reading (a consumer that gave up): the connection is dropped."""
        self._response.shutdown()
        self._thread.join(timeout=30)


class KdnClient:
    """The two calls over one pooled HTTP connection manager; 429s are waited out as the
    server's ``Retry-After`` says, a PUT still computing (202) is asked again."""

    def __init__(self, url: str, key: str, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self._http = urllib3.PoolManager(
            maxsize=8, timeout=urllib3.Timeout(connect=10.0, read=timeout_s), retries=False
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KdnClient:
        config = KdnConfig.from_env(env)
        return cls(config.url, config.key, timeout_s=config.timeout_s)

    def _request(self, method: str, path: str, payload: Any, *, stream: bool = False) -> Any:
        body = json.dumps(payload).encode()
        for _ in range(_RATE_LIMIT_TRIES):
            response = self._http.request(
                method, self.url + path, body=body, headers=self._auth,
                preload_content=not stream,
            )  # fmt: skip
            if response.status == 429:
                response.drain_conn()
                time.sleep(float(response.headers.get("Retry-After") or 1))
                continue
            if response.status >= 400:
                raise _error(response)
            return response
        raise KdnError(429, "rate_limited", f"{method} {path}: still rate-limited")

    def put(self, text: str, *, head: str | None = None, wait_s: float = 600.0) -> dict:
        """Store ``text``'s KV (computed by the server's KV workers unless stored already):
        ``{"key", "tokens", "stored_bytes", "codec", "computed"}``. ``head``: the prompt
        head the KV is computed after (default the deployment's)."""
        payload = {"text": text} | ({"head": head} if head is not None else {})
        deadline = time.monotonic() + wait_s
        while True:
            response = self._request("PUT", "/kdn/v1/kv", payload)
            if response.status != 202:
                return json.loads(response.data)
            if time.monotonic() > deadline:
                raise KdnError(202, "computing", f"the KV was not ready within {wait_s:.0f} s")
            time.sleep(float(response.headers.get("Retry-After") or 1))

    def fetch(
        self, texts: Sequence[str], *, head: str | None = None, device: str | torch.device = "cpu"
    ) -> KdnFetch:
        """Start fetching ``texts``' KV; returns once every header is in (a missing text
        raises :class:`KdnNotFound` here), the layers arriving behind it."""
        payload = {"texts": list(texts)} | ({"head": head} if head is not None else {})
        started = time.perf_counter()
        response = self._request("POST", "/kdn/v1/fetch", payload, stream=True)
        return KdnFetch(response, started, torch.device(device))

    def fetch_chunks(self, texts: Sequence[str], *, head: str | None = None) -> list[ChunkKV]:
        return self.fetch(texts, head=head).chunks()

    def close(self) -> None:
        self._http.clear()


def _error(response: Any) -> KdnError:
    data = response.data
    try:
        body = json.loads(data)
        code, message = body["code"], body["message"]
    except (ValueError, KeyError, TypeError):
        code, message = "error", data[:200].decode(errors="replace")
    kind = KdnNotFound if response.status == 404 else KdnError
    return kind(response.status, code, message)
