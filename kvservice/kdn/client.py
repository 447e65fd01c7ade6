"""A client of the knowledge delivery API (``/kdn/v1``, docs/kdn.md), without Django.

    client = KdnClient("http://127.0.0.1:8000", api_key)
    client.put("A passage of text.")              # {"key", "tokens", "stored_bytes", ...}
    fetch = client.fetch(["A passage of text."])  # streams; returns once the headers are in
    k, v = fetch.sources[0].layer(0)              # LayeredKV: what blend_prefill reads
    chunks = client.fetch_chunks([...])           # or every layer decoded, as ChunkKV

:meth:`KdnClient.fetch` reads the response body (``kvservice.kdn.stream``) in a background
thread, layer by layer, decoding each chunk's layer as it arrives; a source's ``layer(i)``
waits only for layer ``i``, so the engine computes layer ``i`` while later layers arrive, as
with the store's own loader (``kvservice.store.loader``).

The inference worker with ``KV_SOURCE=kdn`` (:class:`KvSource`) reads through
:class:`KdnTier`, the API in its store's S3 place (:func:`kdn_store`), with the token each
request carries instead of a key.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import urllib3

from kvservice.chunk import ChunkKV
from kvservice.kdn.stream import StreamReader
from kvservice.protocol import environment
from kvservice.protocol.errors import ChunkCorrupt, ChunkTruncated, StoreUnavailable
from kvservice.protocol.kdn_stream import MAGIC, PREAMBLE, VERSION
from kvservice.protocol.keys import ChunkKey
from kvservice.protocol.objects import read_fully
from kvservice.store.base import Tier, TierStats
from kvservice.store.config import StoreConfig
from kvservice.store.format import Buffer, ChunkHeader
from kvservice.store.tiered import TieredStore

log = logging.getLogger(__name__)

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
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KdnConfig:
        """``KDN_URL`` (the web server, e.g. http://127.0.0.1:8000) and ``KDN_KEY`` (an API
        key), each named in the error when missing; ``KDN_TIMEOUT_S`` optional. From
        ``environ``, else the process environment (``kvservice.protocol.environment``)."""
        url, key = (environment.read(name, environ) for name in ("KDN_URL", "KDN_KEY"))
        missing = [name for name, value in (("KDN_URL", url), ("KDN_KEY", key)) if not value]
        if missing:
            raise ValueError(f"the knowledge delivery client needs {' and '.join(missing)}")
        timeout_s = environment.read("KDN_TIMEOUT_S", environ)
        return cls(url, key, 600.0 if timeout_s is None else timeout_s)


@dataclass(frozen=True)
class KvSource:
    """Where the inference worker's remote tier reads chunk KV (``KV_SOURCE``): ``s3`` (the
    store's S3 tier, with S3 credentials) or ``kdn`` (the web server's knowledge delivery
    API at ``KDN_URL``, with the token each request carries: no key, no S3 credentials).
    Read once at the worker's start; a bad value is an error that names the variable."""

    kind: str = "s3"
    kdn_url: str = ""
    timeout_s: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KvSource:
        if environment.read("KV_SOURCE", environ) == "s3":
            return cls()
        url = environment.read("KDN_URL", environ)
        if not url:
            raise ValueError(
                "KV_SOURCE=kdn needs KDN_URL: the web server whose knowledge delivery API the "
                "worker reads chunk KV through (e.g. http://127.0.0.1:8000)"
            )
        timeout_s = environment.read("KDN_TIMEOUT_S", environ)
        return cls("kdn", url, 60.0 if timeout_s is None else timeout_s)


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

    def __init__(
        self,
        response: Any,
        started: float,
        device: torch.device,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._response = response
        self._started = started
        self.device = device
        self.total_tokens = int(response.headers.get("X-KV-Tokens", 0))
        self.reader = StreamReader(response, dtype)
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
    """The calls over one pooled HTTP connection manager; with an API key 429s are waited out
    as the server's ``Retry-After`` says, a PUT still computing (202) is asked again."""

    def __init__(self, url: str, key: str = "", *, timeout_s: float = 600.0) -> None:
        """``key``: an API key; "" for a client whose calls each carry a request's token
        (``open_fetch(..., token=...)``, the inference worker's)."""
        self.url = url.rstrip("/")
        self._key = key
        self._http = urllib3.PoolManager(
            maxsize=8, timeout=urllib3.Timeout(connect=10.0, read=timeout_s), retries=False
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KdnClient:
        config = KdnConfig.from_env(environ)
        return cls(config.url, config.key, timeout_s=config.timeout_s)

    def _request(
        self, method: str, path: str, payload: Any, *, stream: bool = False, token: str = ""
    ) -> Any:
        """The call's response; a 429 is waited out, except for a request's token (the
        inference worker's): a question does not wait a minute for its KV, the worker
        recomputes the chunk instead."""
        body = json.dumps(payload).encode()
        headers = {
            "Authorization": f"Bearer {token or self._key}",
            "Content-Type": "application/json",
        }
        for _ in range(_RATE_LIMIT_TRIES):
            response = self._http.request(
                method,
                self.url + path,
                body=body,
                headers=headers,
                preload_content=not stream,
            )
            if response.status == 429 and not token:
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
        self,
        texts: Sequence[str],
        *,
        head: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> KdnFetch:
        """Start fetching ``texts``' KV; returns once every header is in (a missing text
        raises :class:`KdnNotFound` here), the layers arriving behind it, decoded into
        ``dtype`` (default as stored, float16) on ``device``."""
        started = time.perf_counter()
        response = self.open_fetch(texts, head=head)
        return KdnFetch(response, started, torch.device(device), dtype)

    def open_fetch(self, texts: Sequence[str], *, head: str | None = None, token: str = "") -> Any:
        """The fetch's HTTP response, its body not read yet (``read``/``readinto`` it, then
        ``release_conn``): the stream of ``kvservice.kdn.stream``. ``token``: a request's
        token instead of the client's key."""
        payload = {"texts": list(texts)} | ({"head": head} if head is not None else {})
        return self._request("POST", "/kdn/v1/fetch", payload, stream=True, token=token)

    def delete(self, text: str, *, head: str | None = None) -> dict:
        """Remove a text you stored (its record, and its KV unless something else uses it)."""
        payload = {"text": text} | ({"head": head} if head is not None else {})
        return json.loads(self._request("DELETE", "/kdn/v1/kv", payload).data)

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


# -- the inference worker's remote tier (KV_SOURCE=kdn) -----------------------------------------


@dataclass(frozen=True)
class KdnRead:
    """What the worker may ask the API for one chunk key: the chunk's text and the token of
    the request that needs it (``ChunkRef.text``, ``ChunkRef.kdn_token``), until
    ``expires_at`` (``time.monotonic()``)."""

    text: str
    token: str
    expires_at: float


class _OpenFetch:
    """One text's fetch, begun: a one-chunk stream is the preamble followed by the stored
    object byte for byte, so after the preamble the body *is* the object. The bytes read so
    far (a header, while the store locates the chunk) are kept, so that the layers are read
    from the same response rather than from a second request."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self.opened = time.monotonic()
        self.buffer = bytearray()
        preamble = self._read(PREAMBLE.size)
        if len(preamble) < PREAMBLE.size:
            raise ChunkTruncated("the knowledge delivery stream ended in its preamble")
        magic, version, _, count, _ = PREAMBLE.unpack(preamble)
        if magic != MAGIC or version != VERSION or count != 1:
            raise ChunkCorrupt(
                f"not a one-chunk knowledge delivery stream ({magic!r}, "
                f"version {version}, {count} chunks)"
            )

    def _read(self, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        got = read_fully(self.response, memoryview(out))
        return bytes(out[:got])

    def fill(self, end: int) -> None:
        """Read the object up to byte ``end`` (or its end) into the buffer."""
        if end > len(self.buffer):
            self.buffer += self._read(end - len(self.buffer))

    def close(self) -> None:
        self.response.close()  # a read cut short leaves its connection unusable
        self.response.release_conn()


class _ObjectReader:
    """The object from ``start``: the bytes an ``_OpenFetch`` buffered, then its body."""

    def __init__(self, fetch: _OpenFetch, start: int) -> None:
        self.fetch, self.pos = fetch, start
        self.nbytes = 0
        if start > len(fetch.buffer):  # skip to it (a fetch begun for a shorter read)
            fetch.fill(start)

    def readinto(self, out: memoryview) -> int:
        buffer = self.fetch.buffer
        if self.pos < len(buffer):
            n = min(len(out), len(buffer) - self.pos)
            out[:n] = buffer[self.pos : self.pos + n]
        else:
            n = self.fetch.response.readinto(out) or 0
        self.pos += n
        self.nbytes += n
        return n


class KdnTier(Tier):
    """The knowledge delivery API as the inference worker's remote tier (``KV_SOURCE=kdn``),
    in the S3 tier's place behind the worker's own memory and disk tiers, which keep what it
    read (the store promotes it as from S3). The API finds KV by text, so the tier reads
    only the keys a request told it about (:meth:`expect`: each chunk's text and the
    request's token); any other key is a miss, and the worker recomputes the chunk. Each
    chunk is one ``POST /kdn/v1/fetch`` of its text, begun when the store locates it (its
    header) and read on, layer by layer, by the loader's stream (``streams``).

    Read-only: the worker writes nothing through the API (a chunk it recomputed stays in its
    own tiers) and deletes nothing there (``put`` and ``delete`` touch only what it holds)."""

    name = "kdn"
    streams = True
    OPEN_FOR_S = 30.0  # a fetch begun for a header that no stream took is dropped after this

    def __init__(self, client: KdnClient) -> None:
        super().__init__()
        self.client = client
        self._lock = threading.Lock()
        self._reads: dict[ChunkKey, KdnRead] = {}
        self._open: dict[ChunkKey, _OpenFetch] = {}

    @classmethod
    def from_source(cls, source: KvSource) -> KdnTier:
        return cls(KdnClient(source.kdn_url, timeout_s=source.timeout_s))

    def expect(self, reads: Mapping[ChunkKey, KdnRead]) -> None:
        """Let the tier fetch these keys (a request's chunks); expired ones are forgotten."""
        now = time.monotonic()
        with self._lock:
            self._reads.update(reads)
            for key in [k for k, read in self._reads.items() if read.expires_at <= now]:
                del self._reads[key]
            stale = [k for k, f in self._open.items() if now - f.opened > self.OPEN_FOR_S]
            dropped = [self._open.pop(key) for key in stale]
        for fetch in dropped:
            fetch.close()

    def _read_for(self, key: ChunkKey) -> KdnRead | None:
        with self._lock:
            read = self._reads.get(key)
        return read if read is not None and read.expires_at > time.monotonic() else None

    def _begin(self, key: ChunkKey) -> _OpenFetch | None:
        """A fetch of ``key``'s text, its preamble read; None when the tier may not ask for
        it, the API does not find it (404), or refuses the request (another 4xx, logged: an
        expired token's 401, a text outside the token's 403, the user's token limit's 429,
        not waited out). A 5xx or no answer is the store being down."""
        read = self._read_for(key)
        if read is None:
            return None
        try:
            response = self.client.open_fetch([read.text], token=read.token)
            try:
                return _OpenFetch(response)
            except BaseException:
                response.close()
                response.release_conn()
                raise
        except KdnError as err:
            if err.status >= 500:
                self._count_error()
                raise StoreUnavailable(f"knowledge delivery API: {err}") from err
            if err.status != 404:
                log.warning("knowledge delivery API refused chunk %s: %s", key, err)
            return None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            self._count_error()
            raise StoreUnavailable(f"knowledge delivery API at {self.client.url}: {err}") from err

    def _take(self, key: ChunkKey) -> _OpenFetch | None:
        with self._lock:
            return self._open.pop(key, None)

    # -- Tier -------------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        """Whether the tier may ask for ``key`` (a request named its text): no request made."""
        return self._read_for(key) is not None

    def read_range(self, key: ChunkKey, start: int, length: int) -> Buffer | None:
        """Bytes of the object; the fetch begun for them is kept for the stream that reads
        on (the store reads a header with this, then the layers with ``open_stream``)."""
        self._meter.start()
        fetch, got = self._take(key), 0
        try:
            if fetch is None or start < 0:
                fetch = self._begin(key)
                if fetch is None:
                    self._count(hit=False)
                    return None
            before = len(fetch.buffer)
            fetch.fill(start + length)
            got = len(fetch.buffer) - before
            with self._lock:
                previous = self._open.pop(key, None)
                self._open[key] = fetch
            if previous is not None:
                previous.close()
            self._count(hit=True)
            return memoryview(bytes(fetch.buffer[start : start + length]))
        except (urllib3.exceptions.HTTPError, OSError) as err:
            self._count_error()
            raise StoreUnavailable(f"knowledge delivery API: {err}") from err
        finally:
            self._meter.stop(got)

    def get(self, key: ChunkKey) -> Buffer | None:
        with self.open_stream(key, 0) as reader:
            if reader is None:
                return None
            data, piece = bytearray(), bytearray(1 << 20)
            while n := reader.readinto(memoryview(piece)):
                data += piece[:n]
            return memoryview(data)

    @contextmanager
    def open_stream(self, key: ChunkKey, start: int) -> Iterator[_ObjectReader | None]:
        """The object from ``start`` to its end, from the fetch that read its header (or a
        new one)."""
        self._meter.start()
        reader: _ObjectReader | None = None
        try:
            fetch = self._take(key) or self._begin(key)
        except BaseException:
            self._meter.stop(0)
            raise
        if fetch is None:
            self._meter.stop(0)
            self._count(hit=False)
            yield None
            return
        try:
            reader = _ObjectReader(fetch, start)
            yield reader
        except (urllib3.exceptions.HTTPError, OSError) as err:
            self._count_error()
            raise StoreUnavailable(f"knowledge delivery API, reading {key}: {err}") from err
        finally:
            fetch.close()
            self._meter.stop(reader.nbytes if reader is not None else 0)

    def put(self, key: ChunkKey, data: Buffer) -> None:
        """Nothing: the worker writes nothing through the API."""

    def delete(self, key: ChunkKey) -> bool:
        """Drops a fetch begun for ``key``; the API's object stays (not the worker's)."""
        fetch = self._take(key)
        if fetch is not None:
            fetch.close()
        return False

    def stats(self) -> TierStats:
        return self._snapshot(entries=None, nbytes=None, capacity=None)

    def close(self) -> None:
        with self._lock:
            fetches, self._open = list(self._open.values()), {}
        for fetch in fetches:
            fetch.close()
        self.client.close()


def kdn_store(config: StoreConfig, source: KvSource) -> TieredStore:
    """The worker's tiers as ``config`` makes them, with the knowledge delivery API in S3's
    place (``KV_SOURCE=kdn``): S3's settings, credentials included, are not used."""
    local = TieredStore.from_config(replace(config, s3_endpoint=None))
    return TieredStore(
        [*local.tiers, KdnTier.from_source(source)], quantize=config.quantize, config=config
    )
