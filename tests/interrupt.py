"""A test run stopped by SIGTERM (a CI job's timeout, ``kill``) ends as Ctrl-C ends it:
pytest tears the fixtures down and ``pytest_unconfigure`` stops the services it started, so
no PostgreSQL, S3 gateway, valkey or worker outlives the run. (Python's default for SIGTERM
is to die at once, teardown and all.)"""

from __future__ import annotations

import signal
import threading


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread (where pytest runs)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread

    def interrupt(signum: int, _frame) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
