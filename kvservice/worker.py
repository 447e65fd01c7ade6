"""The inference worker's entry point: ``python -m kvservice.worker`` (``make dev`` starts it;
``INFERENCE_WORKERS=2 make dev`` starts two).

This is where the process is put together, above both engines: it reads the configuration
(``kvservice.config.WorkerConfig``), picks the runtime ``ENGINE`` names (the native engine's,
``kvservice.serve.runtime``, or vLLM's, ``kvservice.vllm.runtime``), loads the model, checks
the chunk keys against the stored chunks', and hands the rest to ``kvservice.serve.server``,
which serves the Celery queues. A bad setting or a model that cannot load ends the process
with status 2 and one line saying why.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from kvservice.config import WorkerConfig, check_stored_keys
from kvservice.serve import server

log = logging.getLogger("kvservice.worker")


def make_runtime(engine: str) -> Any:
    """The runtime for ``ENGINE`` (not loaded)."""
    if engine == "vllm":  # every mode through vLLM; the specifics live in kvservice.vllm
        from kvservice.vllm.runtime import VllmRuntime

        return VllmRuntime()
    from kvservice.serve.runtime import NativeRuntime

    return NativeRuntime()


def main() -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = WorkerConfig.from_env()
    except ValueError as err:
        print(f"inference worker: {err}", file=sys.stderr)
        return 2
    runtime = make_runtime(config.engine)
    server.configure(config, runtime)
    try:
        runtime.load(config)
    except Exception as err:
        print(f"inference worker: cannot load the model: {err}", file=sys.stderr)
        return 2
    log.info("model %s loaded", runtime.model_name)
    return server.serve(key_check=check_stored_keys(runtime, config))


if __name__ == "__main__":
    sys.exit(main())
