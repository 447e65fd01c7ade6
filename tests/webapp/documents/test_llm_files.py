"""The web side chunks with the inference worker's own tokenizer files, found through the
torch-free lookup (``kvservice.protocol.models``), never by importing the converter: token ids
are the chunk keys' input, so both sides must tokenize alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvservice.config import WorkerConfig
from kvservice.model.bundled import resolve_llm_path
from kvservice.protocol.models import converted_llm_dir, is_converted, llm_checkpoint_dir
from tests.conftest import ROOT
from tests.kvservice.test_gguf import TEXT, write_family_gguf
from webapp.documents.chunking import llm_tokenizer

# Accents, digits, a list item, an emoji: bytes a tokenizer may split in more than one way.
SAMPLE = "Die Brücke (1897) war 12,5 m lang.\n3. Étape: “café” — naïve 🚲 fin."

# What the web process runs: the chunker's tokenizer, then which converter modules it holds.
WEB_SIDE = """
import json, sys
from webapp.documents.chunking import llm_tokenizer
tokenizer = llm_tokenizer(sys.argv[1])
print(json.dumps({
    "ids": tokenizer(sys.argv[2], add_special_tokens=False)["input_ids"],
    "converter_loaded": sorted(m for m in sys.modules if m.startswith("kvservice.model")),
}))
"""


def _worker_tokenizer(model_path: str | None, cache_dir: Path):
    """The tokenizer as the inference worker loads its own (``NativeRuntime._load``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_llm_path(model_path, cache_dir))


def test_the_web_chunks_the_bundled_models_text_into_the_workers_token_ids() -> None:
    cache = WorkerConfig.from_env({"REDIS_URL": "redis://127.0.0.1:1"}).model_cache_dir
    assert converted_llm_dir(None) == llm_checkpoint_dir(None) == resolve_llm_path(None, cache)
    web, worker = llm_tokenizer(""), _worker_tokenizer(None, cache)
    web_ids = web(SAMPLE, add_special_tokens=False)["input_ids"]
    assert web_ids == worker(SAMPLE, add_special_tokens=False)["input_ids"]
    assert len(web_ids) > 20


def test_a_model_nobody_converted_yet_is_converted_beside_the_web_process(tmp_path) -> None:
    """A ``MODEL_PATH=FILE.gguf`` in an empty model cache: the web side has a child process
    convert it, into the directory the worker then loads, and holds none of the converter."""
    gguf = tmp_path / "tiny-qwen2.Q8_0.gguf"
    write_family_gguf("qwen2", gguf)
    cache = tmp_path / "cache"
    env = {**os.environ, "RAGBLEND_MODEL_CACHE": str(cache)}
    argv = [sys.executable, "-c", WEB_SIDE, str(gguf), TEXT]
    ran = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    web_side = json.loads(ran.stdout.strip().splitlines()[-1])
    assert web_side["converter_loaded"] == []
    directory = llm_checkpoint_dir(str(gguf), cache)
    assert is_converted(directory)  # by the child: the worker finds it there
    assert resolve_llm_path(str(gguf), cache) == directory
    worker_ids = _worker_tokenizer(str(gguf), cache)(TEXT, add_special_tokens=False)["input_ids"]
    assert web_side["ids"] == worker_ids and len(worker_ids) > 1
