"""A test run killed with SIGTERM still tears down what it started (tests/interrupt.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CONFTEST = textwrap.dedent(
    """
    import subprocess
    from pathlib import Path

    import pytest

    from tests.interrupt import interrupt_on_sigterm

    HERE = Path(__file__).parent


    def pytest_configure(config):
        interrupt_on_sigterm()


    @pytest.fixture(scope="session")
    def service():
        child = subprocess.Popen(["sleep", "600"])  # stands for PostgreSQL and the rest
        (HERE / "child.pid").write_text(str(child.pid))
        yield child
        child.terminate()
        child.wait()
        (HERE / "stopped").write_text("yes")
    """
)

TEST = textwrap.dedent(
    """
    import time
    from pathlib import Path


    def test_runs_long(service):
        (Path(__file__).parent / "running").write_text("yes")
        time.sleep(120)
    """
)


def _wait(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_ends_a_run_as_ctrl_c_does_tearing_down_its_services(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_long.py").write_text(TEST)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:django",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_long.py"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    pid = None
    try:
        _wait(tmp_path / "running")
        pid = int((tmp_path / "child.pid").read_text())
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=60)
        assert run.returncode == 2, output.decode()[-2000:]  # pytest's "interrupted"
        assert (tmp_path / "stopped").exists() and not _alive(pid)
        assert b"KeyboardInterrupt" in output
    finally:
        run.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
