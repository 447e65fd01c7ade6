"""`make dev`: the whole product on one machine, on embedded services.

Starts PostgreSQL (+pgvector), the S3 gateway and valkey with their data under DATA_DIR,
records where they are in DATA_DIR/stack.json, migrates, creates the buckets and a first
admin, then runs the web server, a Celery worker and the inference worker. Ctrl-C stops
everything it started; the data stays for the next start.

Any of DATABASE_URL, S3_ENDPOINT (+S3_ACCESS_KEY/S3_SECRET_KEY), REDIS_URL set in the
environment replaces the embedded service of that kind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deploy import services
from deploy.stack import data_dir, read_stack_env, write_stack_env

BUCKETS = ("documents", "kvcache")


def _port(previous: dict[str, str], name: str, *, offset: int | None = None) -> int:
    """The port this stack used last time if it is free again (stable URLs), else a new one."""
    last = previous.get(name)
    if last and services.port_is_free(int(last)):
        if offset is None or services.port_is_free(int(last) + offset):
            return int(last)
    return services.free_port(also_free_at_offset=offset)


def start_services(data: Path) -> tuple[list[services.RunningService], dict[str, str]]:
    previous = read_stack_env(data)
    ports = {k: v for k, v in previous.items() if k.endswith("_PORT")}
    started: list[services.RunningService] = []
    # 64 characters: as strong as Django's deploy check asks (the file name changed with it).
    key = services.dev_secret(data, "django_secret_key_64", nbytes=48)
    env: dict[str, str] = {"SECRET_KEY": key}
    try:
        if not os.environ.get("DATABASE_URL"):
            port = _port(ports, "POSTGRES_PORT")
            pg = services.start_postgres(
                data, port=port, password=services.dev_secret(data, "postgres_password")
            )
            started.append(pg)
            env |= pg.env | {"POSTGRES_PORT": str(port)}
        if not os.environ.get("S3_ENDPOINT"):
            port = _port(ports, "S3_PORT", offset=10000)
            s3 = services.start_seaweedfs(
                data,
                port=port,
                access_key=os.environ.get("S3_ACCESS_KEY", "ragblend"),
                secret_key=os.environ.get("S3_SECRET_KEY")
                or services.dev_secret(data, "s3_secret_key"),
                buckets=BUCKETS,
            )
            started.append(s3)
            env |= s3.env | {"S3_PORT": str(port)}
        if not os.environ.get("REDIS_URL"):
            port = _port(ports, "VALKEY_PORT")
            vk = services.start_valkey(
                data, port=port, password=services.dev_secret(data, "valkey_password")
            )
            started.append(vk)
            env |= vk.env | {"VALKEY_PORT": str(port)}
    except Exception:
        stop_all(started)
        raise
    return started, env


def stop_all(processes: list) -> None:
    for item in reversed(processes):
        name = getattr(item, "name", "process")
        try:
            if isinstance(item, services.RunningService):
                item.stop()
            elif item.poll() is None:
                item.send_signal(signal.SIGTERM)
                try:
                    item.wait(20)
                except subprocess.TimeoutExpired:
                    item.kill()
        except Exception as err:  # keep stopping the others
            print(f"  could not stop {name}: {err}", file=sys.stderr)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "manage.py", *args], check=True, env=env)


class Supervised:
    """A worker or the web server, started again when it exits on its own (killed, out of
    memory): the in-flight answers of a dead inference worker are ended by the reaper, and
    the new one takes the next questions. More than ``MAX_RESTARTS`` exits within
    ``RESTART_WINDOW_S`` is a crash loop: the stack stops, pointing at the log."""

    MAX_RESTARTS = 5
    RESTART_WINDOW_S = 60.0

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path | None):
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.exits: list[float] = []
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        out = open(self.log, "ab") if self.log else None  # noqa: SIM115 (the child keeps it)
        try:
            return subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None,
                start_new_session=True, preexec_fn=services.die_with_parent(),
            )  # fmt: skip
        finally:
            if out:
                out.close()

    def check(self) -> bool:
        """Restart the process if it exited; False when it keeps exiting."""
        code = self.process.poll()
        if code is None:
            return True
        now = time.monotonic()
        self.exits = [t for t in self.exits if now - t < self.RESTART_WINDOW_S] + [now]
        where = f" (log: {self.log})" if self.log else ""
        if len(self.exits) > self.MAX_RESTARTS:
            print(f"\n{self.name} exited {len(self.exits)} times in "
                  f"{self.RESTART_WINDOW_S:.0f} s{where}; stopping.", file=sys.stderr)  # fmt: skip
            return False
        print(f"{self.name} exited with {code}{where}; starting it again.", file=sys.stderr)
        self.process = self._start()
        return True


def inference_workers(
    env: dict[str, str], data: Path, logs: Path
) -> list[tuple[str, dict[str, str], Path]]:
    """(name, environment, log) of each inference worker ``INFERENCE_WORKERS`` asks for: the
    first is ``inference@host`` as always, the next ``inference2@host`` and so on, each with
    its own disk tier."""
    count = int(env.get("INFERENCE_WORKERS", "1"))
    if count < 1:
        raise SystemExit(f"INFERENCE_WORKERS must be at least 1, not {count}")
    workers = []
    for index in range(1, count + 1):
        suffix = "" if index == 1 else str(index)
        worker_env = {
            **env,
            "INFERENCE_NODE_NAME": f"inference{suffix}@%h",
            "KV_DISK_DIR": env.get("KV_DISK_DIR", str(data / "kv-disk")) + suffix,
        }
        name = "inference worker" + (f" {index}" if count > 1 else "")
        workers.append((name, worker_env, logs / f"inference{suffix}.log"))
    return workers


def main() -> int:
    data = data_dir()
    data.mkdir(parents=True, exist_ok=True)
    web_port = int(os.environ.get("PORT", "8000"))
    if not services.port_is_free(web_port):
        print(f"Port {web_port} is in use: set PORT to run another stack.", file=sys.stderr)
        return 2
    print(f"Ragblend dev stack, data in {data}")
    backing, stack_env = start_services(data)
    write_stack_env(stack_env, data)  # where the services are; no DEBUG: see below
    # DEBUG is on for the processes this launcher starts only; a process that reads
    # stack.json from another shell (or a production process pointed at this DATA_DIR)
    # does not get it from there.
    env = {**stack_env, "DEBUG": "true", **os.environ, "DATA_DIR": str(data),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    logs = data / "logs"
    children: list[Supervised] = []
    try:
        manage("migrate", "--no-input", env=env)
        manage("ensure_admin", env=env)
        bin_dir = Path(sys.executable).parent
        # The Celery worker also runs beat (-B): the periodic reaper of answers nobody will
        # finish. One beat per deployment; production runs it as its own process.
        children.append(Supervised("celery worker", [
            str(bin_dir / "celery"), "-A", "worker", "worker", "-Q", "ingest,kv",
            "--concurrency", os.environ.get("CELERY_CONCURRENCY", "2"),
            "--hostname", "ingest@%h", "--loglevel", "INFO",
            "-B", "--schedule", str(data / "celerybeat-schedule"),
        ], env, logs / "celery.log"))  # fmt: skip
        # INFERENCE_WORKERS=2: two inference workers sharing the S3 tier, each with its own
        # memory and disk tiers; questions go to the one that holds their chunks
        # (kvservice.routing).
        for name, worker_env, log in inference_workers(env, data, logs):
            children.append(Supervised(
                name, [sys.executable, "-m", "kvservice.server"], worker_env, log
            ))  # fmt: skip
        children.append(Supervised("web server", [
            str(bin_dir / "uvicorn"), "webapp.asgi:application", "--host", "127.0.0.1",
            "--port", str(web_port), "--log-level", "info",
        ], env, None))  # fmt: skip
        print(f"\n  Ragblend is running at http://127.0.0.1:{web_port}/")
        print(f"  Health: http://127.0.0.1:{web_port}/healthz")
        print(f"  Worker logs: {logs}/celery.log, {logs}/inference*.log")
        print(f"  Same stack from another shell: DATA_DIR={data} .venv/bin/python manage.py …")
        print("  Ctrl-C stops everything.\n")
        # Ctrl-C, a kill or a closed terminal all stop the stack. SIGINT is set explicitly: a
        # launcher started in the background by a non-interactive shell inherits it ignored,
        # and Python then never raises KeyboardInterrupt (seen: a CI run's stack that Ctrl-C
        # could not stop). A SIGKILL cannot be caught: then every child gets SIGTERM from the
        # kernel (``services.die_with_parent``).
        for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop_signal, _interrupt)
        while all(child.check() for child in children):
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        print("\nStopping…")
        return 0
    finally:
        stop_all([*backing, *(child.process for child in children)])


if __name__ == "__main__":
    sys.exit(main())
