"""`make dev`: the whole product on one machine, on embedded services.

Starts PostgreSQL (+pgvector), the S3 gateway and valkey with their data under DATA_DIR,
records where they are in DATA_DIR/stack.json, migrates, creates the buckets and a first
admin, then runs the web server, a Celery worker and the inference worker. A service or
worker that dies is started again on the same port and data; one that keeps dying stops the
stack with its name and the end of its log. Ctrl-C stops everything it started; the data
stays for the next start, its user's alone (files 0600, directories 0700). A ``MODEL_PATH``
the inference worker would refuse stops it before anything starts, saying why.

Any of DATABASE_URL, S3_ENDPOINT (+S3_ACCESS_KEY/S3_SECRET_KEY), REDIS_URL set in the
environment replaces the embedded service of that kind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from deploy import services
from deploy.stack import data_dir, read_stack_env, write_stack_env
from kvservice.model.families import ModelConfig, UnsupportedModelError
from kvservice.paths import kv_disk_dir
from kvservice.protocol import environment
from kvservice.protocol.models import ModelPathError, check_model_path, is_gguf

BUCKETS = ("documents", "kvcache")


def _port(previous: dict[str, str], name: str, *, offset: int | None = None) -> int:
    """The port this stack used last time if it is free again (stable URLs), else a new one."""
    last = previous.get(name)
    if last and services.port_is_free(int(last)):
        if offset is None or services.port_is_free(int(last) + offset):
            return int(last)
    return services.free_port(also_free_at_offset=offset)


PORT_VARIABLES = {"postgres": "POSTGRES_PORT", "seaweedfs": "S3_PORT", "valkey": "VALKEY_PORT"}


def service_starters(data: Path) -> list[tuple[int, Callable[[], services.RunningService]]]:
    """``(port, start)`` for each embedded service this stack runs: ``start()`` starts it, and
    starts it again after a crash, on the same port and data (so every URL stays right). A
    service whose URL the environment sets (DATABASE_URL, S3_ENDPOINT, REDIS_URL) is external:
    not started here."""
    ports = {k: v for k, v in read_stack_env(data).items() if k.endswith("_PORT")}
    starters: list[tuple[int, Callable[[], services.RunningService]]] = []
    if not environment.read("DATABASE_URL"):
        port = _port(ports, "POSTGRES_PORT")
        password = services.dev_secret(data, "postgres_password")
        starters.append(
            (port, partial(services.start_postgres, data, port=port, password=password))
        )
    if not environment.read("S3_ENDPOINT"):
        port = _port(ports, "S3_PORT", offset=10000)
        secret = environment.read("S3_SECRET_KEY") or services.dev_secret(data, "s3_secret_key")
        starters.append(
            (
                port,
                partial(
                    services.start_seaweedfs,
                    data,
                    port=port,
                    buckets=BUCKETS,
                    secret_key=secret,
                    access_key=environment.read("S3_ACCESS_KEY") or "ragblend",
                ),
            )
        )
    if not environment.read("REDIS_URL"):
        port = _port(ports, "VALKEY_PORT")
        password = services.dev_secret(data, "valkey_password")
        starters.append((port, partial(services.start_valkey, data, port=port, password=password)))
    return starters


def stack_env(data: Path, started: list[tuple[int, services.RunningService]]) -> dict[str, str]:
    """What a client of the stack needs: each service's URL and keys, its port (to take the
    same one next time) and the Django secret key."""
    # 64 characters: as strong as Django's deploy check asks (the file name changed with it).
    env = {"SECRET_KEY": services.dev_secret(data, "django_secret_key_64", nbytes=48)}
    for port, service in started:
        env |= service.env | {PORT_VARIABLES[service.name]: str(port)}
    return env


def start_services(data: Path) -> tuple[list[services.RunningService], dict[str, str]]:
    """Start the embedded services once (no supervision): for benches and tests."""
    services.keep_private(data)
    started: list[tuple[int, services.RunningService]] = []
    try:
        for port, start in service_starters(data):
            started.append((port, start()))
    except Exception:
        stop_all([service for _, service in started])
        raise
    return [service for _, service in started], stack_env(data, started)


def stop_all(processes: list) -> None:
    for item in reversed(processes):
        name = getattr(item, "name", "process")
        try:
            if isinstance(item, services.RunningService | Supervised):
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


def run_child(
    name: str, argv: list[str], env: dict[str, str], log: Path | None
) -> services.RunningService:
    """A worker or the web server as a child process, its output appended to ``log``."""
    out = services.open_private_log(log) if log else None  # the child keeps it
    try:
        process = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            preexec_fn=services.die_with_parent(),
        )
    finally:
        if out:
            out.close()
    return services.RunningService(name, process, log or Path(os.devnull))


class Supervised:
    """A service, a worker or the web server, started again when it exits on its own (killed,
    out of memory): a dead valkey or S3 gateway comes back on its port and data, the in-flight
    answers of a dead inference worker are ended by the reaper and the new one takes the next
    questions. More than ``MAX_RESTARTS`` exits within ``RESTART_WINDOW_S``, or a restart
    that fails, is a crash loop: the stack stops, saying which part and where its log is."""

    MAX_RESTARTS = 5
    RESTART_WINDOW_S = 60.0

    def __init__(self, start: Callable[[], services.RunningService], name: str = ""):
        self.start = start
        self.exits: list[float] = []
        self.service = start()
        self.name = name or self.service.name

    @property
    def process(self) -> subprocess.Popen:
        return self.service.process

    def stop(self) -> None:
        self.service.stop()

    def check(self) -> bool:
        """Restart the process if it exited; False when it keeps exiting or cannot start."""
        code = self.process.poll()  # also reaps it: no zombie is left behind
        if code is None:
            return True
        now = time.monotonic()
        self.exits = [t for t in self.exits if now - t < self.RESTART_WINDOW_S] + [now]
        log = self.service.log_path
        where = "" if str(log) == os.devnull else f" (log: {log})"
        if len(self.exits) > self.MAX_RESTARTS:
            print(
                f"\n{self.name} exited {len(self.exits)} times in "
                f"{self.RESTART_WINDOW_S:.0f} s{where}; stopping.",
                file=sys.stderr,
            )
            if where:  # the reason is there: show it here, not only in a file
                print(f"The end of its log:\n{services.log_tail(log, 15)}", file=sys.stderr)
            return False
        print(f"{self.name} exited with {code}{where}; starting it again.", file=sys.stderr)
        try:
            self.service = self.start()
        except services.ServiceStartError as err:
            print(f"\n{self.name} could not be started again; stopping.\n{err}", file=sys.stderr)
            return False
        print(f"{self.name} is running again.", file=sys.stderr)
        return True


def inference_workers(
    env: dict[str, str], data: Path, logs: Path
) -> list[tuple[str, dict[str, str], Path]]:
    """(name, environment, log) of each inference worker ``INFERENCE_WORKERS`` asks for: the
    first is ``inference@host`` as always, the next ``inference2@host`` and so on, each with
    its own disk tier."""
    try:
        count = environment.read("INFERENCE_WORKERS", env)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    workers = []
    for index in range(1, count + 1):
        suffix = "" if index == 1 else str(index)
        worker_env = {
            **env,
            "INFERENCE_NODE_NAME": f"inference{suffix}@%h",
            "KV_DISK_DIR": (environment.read("KV_DISK_DIR", env) or str(kv_disk_dir(data)))
            + suffix,
        }
        name = "inference worker" + (f" {index}" if count > 1 else "")
        workers.append((name, worker_env, logs / f"inference{suffix}.log"))
    return workers


def web_server_argv(port: int) -> list[str]:
    """uvicorn as the stack runs it. ``--no-proxy-headers``: the client's address is the
    connection's own; only the app reads ``X-Forwarded-For``, and only from the proxies
    ``TRUSTED_PROXY_COUNT`` names (uvicorn would take it from any local client, and a
    rotated header would defeat the login lockout)."""
    uvicorn = str(Path(sys.executable).parent / "uvicorn")
    return [
        uvicorn,
        "webapp.asgi:application",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-proxy-headers",
        "--log-level",
        "info",
    ]


def start_app(children: list[Supervised], env: dict[str, str], data: Path, port: int) -> None:
    """The Celery worker (with beat), the inference workers and the web server, each added
    to ``children`` as it starts (so a failure stops those already running)."""
    logs = data / "logs"
    celery = str(Path(sys.executable).parent / "celery")
    # The Celery worker also runs beat (-B): the periodic reaper of answers nobody will
    # finish. One beat per deployment; production runs it as its own process.
    argv = [
        celery,
        "-A",
        "worker",
        "worker",
        "-Q",
        "answers,ingest,kv",
        "--concurrency",
        str(environment.read("CELERY_CONCURRENCY")),
        "--hostname",
        "ingest@%h",
        "--loglevel",
        "INFO",
        "-B",
        "--schedule",
        str(data / "celerybeat-schedule"),
    ]
    children.append(Supervised(partial(run_child, "celery worker", argv, env, logs / "celery.log")))
    # INFERENCE_WORKERS=2: two inference workers sharing the S3 tier, each with its own
    # memory and disk tiers; questions go to the one that holds their chunks
    # (kvservice.protocol.routing).
    for name, worker_env, log in inference_workers(env, data, logs):
        argv = [sys.executable, "-m", "kvservice.worker"]
        children.append(Supervised(partial(run_child, name, argv, worker_env, log)))
    children.append(Supervised(partial(run_child, "web server", web_server_argv(port), env, None)))


MODEL_PATH_HELP = (
    "Set MODEL_PATH to a model directory (config.json, *.safetensors, the tokenizer) or a "
    ".gguf file, or unset it for the bundled model; `python -m kvservice.tools.check_model PATH` "
    "checks one."
)


def model_path_problem(model_path: str | None) -> str | None:
    """Why the inference worker would refuse ``MODEL_PATH`` (None: it would not), in the
    worker's own words: ``check_model_path``, then, for a checkpoint dir, its config as the
    loader reads it (a GGUF's architecture is checked as it is converted). The worker finds
    out only once the stack is up, then exits until the stack gives up a minute later; the
    launcher asks before it starts anything."""
    if not model_path:
        return None  # the bundled model
    path = Path(model_path).expanduser()
    try:
        check_model_path(path)
    except ModelPathError as error:
        return str(error)
    if is_gguf(path):
        return None
    try:
        ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    except UnsupportedModelError as error:
        return f"model path {path}: {error}"
    except ValueError as error:  # config.json is not JSON
        return f"model path {path}: config.json cannot be read ({error})"
    return None


def main() -> int:
    os.umask(services.PRIVATE_UMASK)  # what the launcher and its children write: 0600, 0700
    problem = model_path_problem(environment.read("MODEL_PATH"))
    if problem:
        print(f"MODEL_PATH: {problem}.\n{MODEL_PATH_HELP}", file=sys.stderr)
        return 2
    data = data_dir()
    services.keep_private(data)  # what an older launcher left readable
    web_port = environment.read("PORT")
    if not services.port_is_free(web_port):
        print(f"Port {web_port} is in use: set PORT to run another stack.", file=sys.stderr)
        return 2
    print(f"Ragblend dev stack, data in {data}")
    supervised: list[Supervised] = []  # services first, then the app: stopped in reverse
    try:
        starters = service_starters(data)
        for _, start in starters:
            supervised.append(Supervised(start))
        started = [
            (port, each.service) for (port, _), each in zip(starters, supervised, strict=True)
        ]
        env = stack_env(data, started)
        write_stack_env(env, data)  # where the services are; no DEBUG: see below
        # DEBUG is on for the processes this launcher starts only; a process that reads
        # stack.json from another shell (or a production process pointed at this DATA_DIR)
        # does not get it from there.
        env = {**env, "DEBUG": "true", **os.environ, "DATA_DIR": str(data), "PYTHONUNBUFFERED": "1"}
        manage("migrate", "--no-input", env=env)
        manage("ensure_admin", env=env)
        start_app(supervised, env, data, web_port)
        _print_welcome(web_port, data)
        # Ctrl-C, a kill or a closed terminal all stop the stack. SIGINT is set explicitly: a
        # launcher started in the background by a non-interactive shell inherits it ignored,
        # and Python then never raises KeyboardInterrupt (seen: a CI run's stack that Ctrl-C
        # could not stop). A SIGKILL cannot be caught: then every child gets SIGTERM from the
        # kernel (``services.die_with_parent``).
        for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop_signal, _interrupt)
        while all(each.check() for each in supervised):
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        print("\nStopping…")
        return 0
    finally:
        stop_all(supervised)


def _print_welcome(web_port: int, data: Path) -> None:
    logs = data / "logs"
    print(f"\n  Ragblend is running at http://127.0.0.1:{web_port}/")
    print(f"  Health: http://127.0.0.1:{web_port}/healthz")
    print(f"  Worker logs: {logs}/celery.log, {logs}/inference*.log")
    print(f"  Same stack from another shell: DATA_DIR={data} .venv/bin/python manage.py …")
    print("  Ctrl-C stops everything.\n")


if __name__ == "__main__":
    sys.exit(main())
