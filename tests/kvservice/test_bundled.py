from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvservice.model.bundled import resolve_llm_path, smollm2_checkpoint
from kvservice.protocol.models import ModelPathError, default_cache_dir, minilm_path


def test_model_path_override_is_used(tiny_checkpoints, smollm2_dir, tmp_path):
    """A checkpoint directory is served as it is, once it has a tokenizer (issue #50: without
    one the worker failed in the embedding or asked for sentencepiece)."""
    directory = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["llama"], directory)
    with pytest.raises(ModelPathError, match="has no tokenizer"):
        resolve_llm_path(str(directory))
    shutil.copy(smollm2_dir / "tokenizer.json", directory / "tokenizer.json")
    assert resolve_llm_path(str(directory)) == directory


def test_missing_model_path_fails_clearly(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_llm_path(str(tmp_path / "nope"))


def test_model_path_without_config_or_weights_fails_clearly(tmp_path):
    with pytest.raises(ModelPathError, match="config.json"):
        resolve_llm_path(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelPathError, match="safetensors"):
        resolve_llm_path(str(tmp_path))
    a_file = tmp_path / "config.json"
    with pytest.raises(ModelPathError, match="not a directory"):
        resolve_llm_path(str(a_file))


def test_default_cache_dir_reads_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RAGBLEND_MODEL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("RAGBLEND_MODEL_CACHE")
    assert default_cache_dir().parts[-3:] == (".cache", "ragblend", "models")


def test_minilm_dir_loads_offline():
    from transformers import AutoConfig

    path = minilm_path()
    assert (path / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(path).model_type == "bert"


def test_bundled_dir_answers_a_prompt_like_our_engine(smollm2_dir, smollm2, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvservice.model.sampling import SamplingParams
    from kvservice.protocol.prompt import PromptFormat
    from kvservice.serve.engine import Engine, Request

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = hf_model.generate(**ids, max_new_tokens=10, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text

    engine = Engine(smollm2, smollm2_tokenizer, PromptFormat(smollm2_tokenizer, question_prefix=""))
    prompt = engine.format.build([], "What is the capital of France?")
    assert prompt.token_ids == ids["input_ids"][0].tolist()
    try:
        ours = engine.generate(Request(prompt, [], "full", sampling=SamplingParams(max_tokens=10)))
    finally:
        engine.close()
    assert ours.text.strip() and text.startswith(ours.text.strip()[:10])


@pytest.mark.slow
def test_conversion_is_atomic_and_reused(tmp_path, monkeypatch):
    """Converts the GGUF from scratch (about 30 s); a second call reuses the directory. The
    conversion (``kvservice.model.gguf``) gives the weights and config the earlier
    conversion through transformers gave: the same model fingerprint, so stored chunk KV
    keys stay valid."""
    import kvservice.model.gguf as gguf_checkpoint

    calls = []
    real = gguf_checkpoint.convert_gguf

    def failing(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")  # a half-written directory...
        raise KeyboardInterrupt  # ...then the process is killed

    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", failing)
    with pytest.raises(KeyboardInterrupt):
        smollm2_checkpoint(tmp_path)
    assert not any(tmp_path.iterdir())  # no half directory, staging or lock file left

    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", lambda g, o: (calls.append(1), real(g, o)))
    path = smollm2_checkpoint(tmp_path)
    again = smollm2_checkpoint(tmp_path)
    assert path == again and len(calls) == 1
    assert path.name.startswith("smollm2-135m-instruct-q4-1-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()
    }
    from kvservice.model.transformer import Transformer

    model = Transformer.from_pretrained(path)
    assert model.config.n_layers == 30
    assert model.fingerprint == "9ee0332e337276df2c492920980cfe04"  # as converted before #50


def test_processes_starting_at_once_convert_once(tmp_path, monkeypatch):
    """The web process, the ingest pool and the inference worker start together on a fresh
    machine: one converts, the others wait for its directory. Before, a later finisher
    deleted the directory an earlier one had made and was loading (a traceback in
    celery.log)."""
    import threading
    import time

    import kvservice.model.gguf as gguf_checkpoint
    from kvservice.model.bundled import gguf_checkpoint as checkpoint_of

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    converted = []

    def convert(gguf_path, out_dir):
        converted.append(out_dir)
        time.sleep(0.5)  # long enough for every thread to arrive meanwhile
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", convert)
    results, errors = [], []

    def start():
        try:
            path = checkpoint_of(gguf, tmp_path / "cache")
            results.append((path, sorted(p.name for p in path.iterdir())))
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and len(results) == 4 and len(converted) == 1
    assert len({path for path, _ in results}) == 1
    assert all("model.safetensors" in names for _, names in results)
