"""The embedded services as the suite runs them: reachable only the way they should be."""

from __future__ import annotations

import io
import stat
import urllib.error
import urllib.request
from pathlib import Path

from minio import Minio

from deploy import services


def _flag_ports(service: services.RunningService) -> dict[str, int]:
    args = [a.lstrip("-") for a in service.process.args if "port=" in a]
    return {name: int(value) for name, value in (a.split("=", 1) for a in args)}


def _status(url: str, method: str = "GET") -> int:
    request = urllib.request.Request(url, method=method, data=b"x" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_only_the_s3_port_serves_objects_and_it_checks_keys(s3_service) -> None:
    env = s3_service.env
    client = Minio(env["S3_ENDPOINT"], access_key=env["S3_ACCESS_KEY"],
                   secret_key=env["S3_SECRET_KEY"], secure=False)  # fmt: skip
    bucket = client.list_buckets()[0].name
    client.put_object(bucket, "probe/secret.txt", io.BytesIO(b"private"), 7)
    try:
        ports = _flag_ports(s3_service)
        assert "webdav.port" not in ports and "-webdav=false" in s3_service.process.args
        path = f"/buckets/{bucket}/probe/secret.txt"
        for method in ("GET", "PUT", "DELETE"):  # the filer's own HTTP API wants a JWT
            assert _status(f"http://127.0.0.1:{ports['filer.port']}{path}", method) == 401
        assert _status(f"http://127.0.0.1:{ports['volume.port']}/1,01637037d6") == 401
        anonymous = Minio(env["S3_ENDPOINT"], secure=False)
        try:
            anonymous.get_object(bucket, "probe/secret.txt")
            raise AssertionError("anonymous S3 read succeeded")
        except Exception as err:  # noqa: BLE001 - any refusal; the check is that it is one
            assert "AccessDenied" in str(err) or "403" in str(err), err
        assert client.get_object(bucket, "probe/secret.txt").read() == b"private"
    finally:
        client.remove_object(bucket, "probe/secret.txt")


def test_the_object_store_data_is_private_to_its_user(s3_service) -> None:
    data = Path(next(a for a in s3_service.process.args if a.startswith("-dir=")).split("=", 1)[1])
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "security.toml").stat().st_mode) == 0o600


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
