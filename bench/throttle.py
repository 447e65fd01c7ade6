"""A throttling TCP proxy (bench only): S3 as slow as it is beside a GPU, on this machine.

    proxy = ThrottlingProxy("127.0.0.1:8333", mbps=40.0)
    proxy.start()   # proxy.endpoint ("127.0.0.1:PORT") is what the S3 client is given
    proxy.mbps = 12.5   # the link's rate can change between requests (``--s3-mbps auto``)
    proxy.stop()

Every connection is forwarded to the upstream as it is (the S3 signature covers the Host
header the client sent, which the upstream checks as it receives it). Bytes from the
upstream to the client (the objects read) share one link of ``mbps`` megabytes (10^6 bytes)
a second: each piece takes the next slot of the link's timeline and is sent when its slot
ends, so concurrent reads divide the rate between them as on a real link. A sender woken
late (a busy machine) may catch up on at most ``BURST_S`` of the link's time, so the rate
holds on average without an idle link saving up a burst. Bytes to the upstream (the
requests, the staging uploads) pass unthrottled: the bench times reads only.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

log = logging.getLogger(__name__)

PIECE = 16 << 10  # bytes sent per slot: 1.3 ms at 12.5 MB/s, small beside a layer's read
BURST_S = 0.05  # the most link time a late sender catches up on


class Link:
    """One link's timeline: :meth:`reserve` waits until ``nbytes`` would have crossed it."""

    def __init__(self, mbps: float) -> None:
        self.mbps = mbps
        self._free_at = 0.0  # when the link finishes what was reserved so far
        self._lock = threading.Lock()

    @property
    def mbps(self) -> float:
        return self._mbps

    @mbps.setter
    def mbps(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"the link's rate must be above 0 MB/s, got {value}")
        self._mbps = float(value)

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            # behind by at most BURST_S: a late sender, who catches up; more: an idle link
            start = self._free_at if self._free_at >= now - BURST_S else now
            self._free_at = start + nbytes / (self._mbps * 1e6)
            until = self._free_at
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class ThrottlingProxy:
    """A TCP proxy on 127.0.0.1 (a free port) to ``upstream`` (``host:port``), replies
    throttled to ``mbps``; threads only, started by :meth:`start`, ended by :meth:`stop`."""

    def __init__(self, upstream: str, *, mbps: float) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(port))
        self.link = Link(mbps)
        self._server: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()

    @property
    def mbps(self) -> float:
        return self.link.mbps

    @mbps.setter
    def mbps(self, value: float) -> None:
        self.link.mbps = value

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        host, port = self._server.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> ThrottlingProxy:
        server = socket.create_server(("127.0.0.1", 0))
        self._server = server
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            sock.close()

    def __enter__(self) -> ThrottlingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._server is not None
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:  # closed by stop()
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError as err:
                log.warning("throttling proxy: upstream %s unreachable: %s", self.upstream, err)
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets |= {client, upstream}
            for source, sink, link in ((client, upstream, None), (upstream, client, self.link)):
                threading.Thread(
                    target=self._pipe, args=(source, sink, link), name="throttle-pipe", daemon=True
                ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, link: Link | None) -> None:
        try:
            while True:
                data = source.recv(PIECE)
                if not data:
                    break
                if link is not None:
                    link.reserve(len(data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            with self._lock:
                self._sockets -= {source, sink}
