"""The embedded services as the suite runs them: reachable only the way they should be."""

from __future__ import annotations

import http.server
import io
import socket
import ssl
import stat
import threading
from pathlib import Path

import psutil
from minio import Minio

from deploy import services


def _flag_ports(service: services.RunningService) -> dict[str, int]:
    args = [a.lstrip("-") for a in service.process.args if "port=" in a]
    return {name: int(value) for name, value in (a.split("=", 1) for a in args)}


# What an attacker on the host sent the master (issue: every stored original deleted).
MASTER_ATTACKS = (
    "/col/delete?collection=documents",
    "/col/delete?collection=kvcache",
    "/dir/assign",
    "/vol/grow?count=1",
    "/dir/status",
)


def _plain_http_answer(port: int, path: str) -> bytes:
    """The first bytes a server sends back to a plain HTTP GET (b"" when it hangs up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        try:
            return sock.recv(64)
        except OSError:
            return b""


def _tls_answer_without_certificate(port: int, path: str) -> bytes:
    """The same over TLS with no client certificate: b"" when the server refuses it."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with context.wrap_socket(raw) as sock:
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
                return sock.recv(64)
    except (ssl.SSLError, OSError):
        return b""


def test_only_the_s3_port_answers_and_it_checks_keys(s3_service) -> None:
    env = s3_service.env
    client = Minio(
        env["S3_ENDPOINT"],
        access_key=env["S3_ACCESS_KEY"],
        secret_key=env["S3_SECRET_KEY"],
        secure=False,
    )
    bucket = client.list_buckets()[0].name
    client.put_object(bucket, "probe/secret.txt", io.BytesIO(b"private"), 7)
    try:
        ports = _flag_ports(s3_service)
        assert "webdav.port" not in ports and "-webdav=false" in s3_service.process.args
        internal = [ports[f"{name}.port"] for name in ("master", "volume", "filer", "admin")]
        internal += [port + services.GRPC_OFFSET for port in internal]
        listening = [port for port in internal if not services.port_is_free(port)]
        assert ports["master.port"] in listening and ports["filer.port"] in listening
        for port in listening:
            for path in MASTER_ATTACKS:
                assert not _plain_http_answer(port, path).startswith(b"HTTP/1.1 2"), (port, path)
                assert _tls_answer_without_certificate(port, path) == b"", (port, path)
        anonymous = Minio(env["S3_ENDPOINT"], secure=False)
        try:
            anonymous.get_object(bucket, "probe/secret.txt")
            raise AssertionError("anonymous S3 read succeeded")
        except Exception as err:  # noqa: BLE001 - any refusal; the check is that it is one
            assert "AccessDenied" in str(err) or "403" in str(err), err
        assert client.get_object(bucket, "probe/secret.txt").read() == b"private"
    finally:
        client.remove_object(bucket, "probe/secret.txt")


def test_the_probes_tell_an_open_server_from_a_closed_one(tmp_path) -> None:
    """The probes above against servers that answer anyone, plain and over TLS: both see it
    (so their empty answers from weed's ports are refusals, not a broken probe)."""
    handler = http.server.SimpleHTTPRequestHandler
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    tls = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    _, cert, key = services._weed_certificates(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    tls.socket = context.wrap_socket(tls.socket, server_side=True)
    for server in (plain, tls):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert _plain_http_answer(plain.server_address[1], "/").startswith(b"HTTP/1.0 2")
        assert _tls_answer_without_certificate(tls.server_address[1], "/").startswith(b"HTTP/1.0 2")
    finally:
        for server in (plain, tls):
            server.shutdown()
            server.server_close()


def test_the_object_store_data_is_private_to_its_user(s3_service) -> None:
    data = Path(next(a for a in s3_service.process.args if a.startswith("-dir=")).split("=", 1)[1])
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for private in ("security.toml", "tls/node.key", "tls/ca.pem"):
        assert stat.S_IMODE((data / private).stat().st_mode) == 0o600, private


def test_weed_ports_never_take_another_servers_grpc_port(monkeypatch) -> None:
    """weed refuses to start when a server's port is another's port + 10000 (its gRPC
    port); such collisions are rare by chance, so free ports are scripted here."""
    s3 = 31000
    offered = iter([s3 + 10000, 22000, 32000, 12000, 23000, 24000, 25000, 26000])
    monkeypatch.setattr(services, "free_port", lambda **_: next(offered))
    ports = services.weed_ports(s3)
    assert list(ports) == [*services._WEED_PORT_FLAGS, "debug.port"]
    # 41000 is S3's gRPC port, 32000 and 12000 are 22000's +/- 10000: all passed over
    assert list(ports.values()) == [22000, 23000, 24000, 25000, 26000]
    chosen = [s3, *ports.values()]
    for port in chosen:
        assert port + services.GRPC_OFFSET not in chosen


def _listening_ports(pid: int) -> dict[int, str]:
    """Every TCP port the process listens on, with its address (psutil reads /proc)."""
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.port: c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}


def test_every_port_the_s3_gateway_listens_on_refuses_a_client_without_the_certificate(
    s3_service,
) -> None:
    """Not only the ports weed is told about: every one its process listens on (the admin
    server's HTTP port served ``/metrics`` in plain HTTP: bucket names, object counts and
    sizes). Without the certificate: the S3 port checks keys, the others refuse."""
    assert "-master.telemetry=false" in s3_service.process.args  # nor does it tell anyone else
    s3_port = int(s3_service.env["S3_ENDPOINT"].rsplit(":", 1)[1])
    listening = _listening_ports(s3_service.process.pid)
    assert s3_port in listening and len(listening) > 4, listening
    assert set(listening.values()) == {"127.0.0.1"}, listening
    for port in listening:
        for path in ("/metrics", "/health", "/", "/dir/status"):
            plain = _plain_http_answer(port, path)
            assert not plain.startswith((b"HTTP/1.1 2", b"HTTP/1.0 2")), (port, path, plain)
            if port != s3_port:
                assert _tls_answer_without_certificate(port, path) == b"", (port, path)
