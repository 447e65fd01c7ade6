"""`make dev`'s launcher, for real: boots every service, is healthy, lets `manage.py` reach the
same stack through DATA_DIR, stops everything on Ctrl-C, and keeps the data for a restart."""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest

from deploy import services
from tests.conftest import ROOT, wait_for
from tests.deploy.test_private_data import assert_private

pytestmark = pytest.mark.slow

# The suite's own services are in this process's environment; the stack must start its own.
_SUITE_VARIABLES = (
    "DATABASE_URL",
    "S3_ENDPOINT",
    "S3_ACCESS_KEY",
    "S3_SECRET_KEY",
    "REDIS_URL",
    "SECRET_KEY",
    "DATA_DIR",
    "DJANGO_SETTINGS_MODULE",
    "DEBUG",
)


def _stack_env(data_dir: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SUITE_VARIABLES}
    return env | {
        "DATA_DIR": str(data_dir),
        "PORT": str(port),
        "PYTHONUNBUFFERED": "1",
        "ADMIN_USERNAME": "root",
        "ADMIN_PASSWORD": "stack-test-password",
    }


def _healthz(port: int) -> tuple[int, dict] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)
    except OSError:
        return None


def _as_background_job() -> None:
    """What a non-interactive shell does to a job it starts with ``&``: SIGINT ignored, which
    the launcher inherits. Ctrl-C (SIGINT) must stop the stack all the same."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(data_dir: Path, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.devstack"],
        cwd=ROOT,
        env=_stack_env(data_dir, port),
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        preexec_fn=_as_background_job,
    )


def _descendants(process: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a process may end between the two questions)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _inference_workers(process: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for child in _descendants(process):
        try:
            title = " ".join(child.cmdline())  # Celery renames its process: "[celeryd: inference@…"
            if "kvservice.worker" in title or "inference@" in title:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _stop(process: subprocess.Popen, log: Path) -> list[psutil.Process]:
    """Ctrl-C the launcher; return the processes it had started, for checking they are gone."""
    started = _descendants(process)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(90)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(
            f"launcher did not stop on Ctrl-C:\n{log.read_text()[-3000:]}"
        ) from None
    return started


def _login_status(port: int, username: str, password: str, forwarded_for: str) -> int:
    """One login POST in a fresh session (CSRF token from the form) claiming to come from
    ``forwarded_for``; the status (200 the form again, 302 signed in, 429 locked)."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    url = f"http://127.0.0.1:{port}/accounts/login/"
    with opener.open(url, timeout=30) as response:
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', response.read().decode())
    form = urllib.parse.urlencode(
        {"username": username, "password": password, "csrfmiddlewaretoken": token[1]}
    ).encode()
    request = urllib.request.Request(url, data=form, headers={"X-Forwarded-For": forwarded_for})
    opener.add_handler(_NoRedirect())
    try:
        with opener.open(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _service_process(process: subprocess.Popen, binary: str) -> psutil.Process:
    (found,) = [p for p in _descendants(process) if p.name() == binary]
    return found


def _killed_service_comes_back(process, log: Path, port: int, name: str, binary: str) -> None:
    """kill -9 an embedded service: the launcher starts it again and the stack is healthy."""
    victim = _service_process(process, binary)
    victim.send_signal(signal.SIGKILL)
    wait_for(
        lambda: f"{name} is running again" in log.read_text(),
        timeout=120,
        what=f"{name} started again",
    )
    assert f"{name} exited with -9" in log.read_text()
    assert not _alive(victim)
    wait_for(lambda: (_healthz(port) or (0,))[0] == 200, timeout=120, what="healthy again")


def test_dev_stack_boots_healthy_and_stops_cleanly(tmp_path: Path) -> None:
    data_dir, port, log = tmp_path / "data", services.free_port(), tmp_path / "stack.log"
    process = _start(data_dir, port, log)
    try:

        def healthy():
            if process.poll() is not None:
                raise AssertionError(f"launcher exited:\n{log.read_text()[-4000:]}")
            result = _healthz(port)
            return result if result and result[0] == 200 else None

        status, body = wait_for(healthy, timeout=420, interval=2, what="/healthz 200")
        assert body["status"] == "ok"
        assert all(c["status"] == "up" for c in body["components"].values()), body
        assert "Created admin account: root" in log.read_text()

        # The stack's services bind to loopback only.
        stack = json.loads((data_dir / "stack.json").read_text())
        assert "DEBUG" not in stack  # only the launcher's own children run with DEBUG
        assert "127.0.0.1" in stack["DATABASE_URL"] and stack["S3_ENDPOINT"].startswith(
            "127.0.0.1:"
        )
        listening = set()
        for child in _descendants(process):
            try:
                connections = child.net_connections(kind="tcp")
            except psutil.NoSuchProcess:  # a short-lived helper process already gone
                continue
            listening |= {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}
        assert listening and listening <= {"127.0.0.1"}, listening

        # A client cannot pick its address: wrong passwords "from" ten addresses all count
        # against 127.0.0.1, and the right one is then locked out (uvicorn trusted the header).
        wrong = [_login_status(port, "root", "wrong-password", f"10.9.0.{n}") for n in range(12)]
        assert wrong[:4] == [200] * 4 and set(wrong[5:]) == {429}, wrong
        assert _login_status(port, "root", "stack-test-password", "10.9.0.99") == 429

        # manage.py with the same DATA_DIR (and nothing else) talks to this running stack.
        env = {k: v for k, v in _stack_env(data_dir, port).items() if k != "PORT"}
        out = subprocess.run(
            [
                sys.executable,
                "manage.py",
                "shell",
                "-c",
                "from django.contrib.auth.models import User; "
                "print(list(User.objects.values_list('username', flat=True)))",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "['root']" in out.stdout

        # Beat runs in the Celery worker: the reaper of answers nobody will finish runs.
        celery_log = data_dir / "logs" / "celery.log"
        wait_for(
            lambda: (
                "reap_stale_answers" in celery_log.read_text()
                and "succeeded" in celery_log.read_text()
            ),
            timeout=60,
            what="the reaper task",
        )

        # All the stack wrote (logs, valkey's files, beat's schedule) is its user's alone.
        assert_private(data_dir)
    finally:
        started = _stop(process, log) if process.poll() is None else []
    time.sleep(1)
    alive = [p for p in started if _alive(p)]
    assert not alive, f"still running after Ctrl-C: {[p.cmdline()[:3] for p in alive]}"

    # Restart on the same DATA_DIR: the data (the admin account) is still there.
    process = _start(data_dir, port, log)
    try:

        def healthy_again():
            if process.poll() is not None:
                raise AssertionError(f"launcher exited on restart:\n{log.read_text()[-4000:]}")
            return (_healthz(port) or (0,))[0] == 200

        wait_for(healthy_again, timeout=300, interval=2, what="/healthz after restart")
        assert "An admin account exists already." in log.read_text()

        # A killed inference worker is started again; the rest of the stack stays up.
        (killed,) = _inference_workers(process)
        killed.send_signal(signal.SIGKILL)
        wait_for(
            lambda: [p for p in _inference_workers(process) if p.pid != killed.pid],
            timeout=60,
            what="a new inference worker",
        )
        assert "inference worker exited with -9" in log.read_text()
        assert process.poll() is None

        # So are a killed broker and S3 gateway, on their ports: the stack is healthy again.
        _killed_service_comes_back(process, log, port, "valkey", "valkey-server")
        _killed_service_comes_back(process, log, port, "seaweedfs", "weed")

        # The launcher killed outright (no handler can run): its children die with it.
        started = _descendants(process)
        process.send_signal(signal.SIGKILL)
        process.wait(10)

        def all_gone():
            return not [p for p in started if _alive(p)]

        wait_for(all_gone, timeout=60, what="the stack's processes to die with the launcher")
    finally:
        if process.poll() is None:
            _stop(process, log)
        for leftover in _descendants(process):  # only if the checks above failed
            leftover.kill()


def test_inference_workers_asks_for_named_workers_with_their_own_disk_tiers(tmp_path) -> None:
    from deploy.devstack import inference_workers

    one = inference_workers({}, tmp_path, tmp_path / "logs")
    assert [(name, env["INFERENCE_NODE_NAME"]) for name, env, _ in one] == [
        ("inference worker", "inference@%h")
    ]
    two = inference_workers({"INFERENCE_WORKERS": "2"}, tmp_path, tmp_path / "logs")
    assert [env["INFERENCE_NODE_NAME"] for _, env, _ in two] == ["inference@%h", "inference2@%h"]
    assert len({env["KV_DISK_DIR"] for _, env, _ in two}) == 2
    assert len({log for _, _, log in two}) == 2
    with pytest.raises(SystemExit, match="at least 1"):
        inference_workers({"INFERENCE_WORKERS": "0"}, tmp_path, tmp_path / "logs")
