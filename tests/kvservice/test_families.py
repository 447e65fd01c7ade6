"""The model families a user brings (issue #33): tiny random Llama 3.x, Qwen3, Gemma 3 and
Phi-3 checkpoints made with transformers, each with its family's distinguishing options on,
the bundled SmolLM2's tokenizer and a generation config of its own; ``check_model`` passes
them and refuses GPT-2 by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvservice.blend.prefill import blend_prefill
from kvservice.blend.selection import selection_layers
from kvservice.blend.settings import ATTENTION_FROM_DEPTH
from kvservice.model.kernels import candidates
from kvservice.model.transformer import KVCache, Transformer, precompute_chunks
from kvservice.protocol.prompt import PromptFormat, stop_token_ids
from kvservice.tools.check_model import check

from .conftest import perturbed

FAMILIES = ("llama3", "qwen3", "gemma3", "phi3")
WINDOW = 24  # Gemma 3's and Phi-3's sliding window here: far shorter than the prompt
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
STOP_IDS = [2, 7]  # generation_config.json's eos_token_id list (2 is SmolLM2's <|im_end|>)


def tiny_family_common(vocab_size: int) -> dict:
    """The tiny shape every family's test model shares (here and in test_gguf.py)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_family_config(kind: str, vocab_size: int):
    """``kind``'s tiny HF config, with its distinguishing options on, and its model class."""
    import transformers

    common = tiny_family_common(vocab_size)
    if kind == "llama3":
        llama3 = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 50000.0,
        }
        return transformers.LlamaConfig(
            **common, rope_parameters=llama3, tie_word_embeddings=True
        ), transformers.LlamaForCausalLM
    if kind == "qwen3":
        return transformers.Qwen3Config(
            **common, head_dim=32, tie_word_embeddings=True
        ), transformers.Qwen3ForCausalLM
    if kind == "gemma3":
        ropes = {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
        types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        return transformers.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=types,
            query_pre_attn_scalar=24,
            rope_parameters=ropes,
            final_logit_softcapping=30.0,
        ), transformers.Gemma3ForCausalLM
    if kind == "phi3":  # long-context LongRoPE with partial rotary, as Phi-4-mini
        longrope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 512,
            "factor": 2.0,
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 3.0, 4.0, 5.0],
        }
        return transformers.Phi3Config(
            **common,
            original_max_position_embeddings=512,
            partial_rotary_factor=0.5,
            rope_parameters=longrope,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        ), transformers.Phi3ForCausalLM
    raise ValueError(kind)


def tiny_family_model(kind: str, vocab_size: int = 128, **overrides):
    """A tiny random HF model of ``kind``, its norms and biases moved off their init;
    ``overrides``: config fields set on top of the family's (e.g. vLLM's CPU attention needs
    heads of 32 or more)."""
    config, model_class = tiny_family_config(kind, vocab_size)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(FAMILIES.index(kind))
    return perturbed(model_class(config))


def smollm2_vocab_size(smollm2_dir: Path) -> int:
    return json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]


def save_family_checkpoint(model, directory: Path, smollm2_dir: Path) -> Path:
    """``model`` (a ``tiny_family_model`` of ``smollm2_vocab_size``, so that the product's
    prompt tokenizes into it) saved as a checkpoint directory with SmolLM2's tokenizer and a
    generation config listing two end-of-sequence ids."""
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, directory / name)
    generation = json.loads((directory / "generation_config.json").read_text())
    generation["eos_token_id"] = STOP_IDS
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Each family as a checkpoint directory (``save_family_checkpoint``)."""
    root, vocab_size = tmp_path_factory.mktemp("families"), smollm2_vocab_size(smollm2_dir)
    return {
        kind: save_family_checkpoint(tiny_family_model(kind, vocab_size), root / kind, smollm2_dir)
        for kind in FAMILIES
    }


@pytest.mark.parametrize("kind", FAMILIES)
def test_check_model_supports_each_family_at_float32_tolerance(kind, family_dirs):
    report = check(family_dirs[kind], device="cpu")
    assert report.supported, report.lines()
    assert report.max_logit_diff < 1e-4  # float32 rounding; an engine mistake is >> 1e-2
    assert report.blend_diff < 1e-4 and report.chunk_kv_diff < 1e-4 and report.prefix_diff < 1e-4
    assert report.prompt_tokens > 4 * WINDOW  # the sliding windows are in play
    assert report.chat_template
    assert [token_id for token_id, _ in report.stop_tokens] == STOP_IDS
    assert report.kv_bytes_fp16 > 2 * report.kv_bytes_codec > 0  # 16-dim heads: wide ranges


# Each linear kernel packs the families' products (Phi-3's fused weights included); bfloat16
# products and attention round activations to 8 bits of mantissa (measured here: 4e-3 to 7e-3
# on logits of size ~1).
KERNEL_TOLERANCE = {"torch": 1e-4, "onednn": 1e-4, "onednn-bf16": 3e-2}


@pytest.mark.parametrize("kernel", KERNEL_TOLERANCE)
@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_equal_hf_on_a_long_sequence(kind, kernel, tmp_path):
    """Past llama3's original context (64) and the windows (24), within LongRoPE's (512)."""
    if kernel not in candidates(torch.device("cpu"), "auto"):
        pytest.skip(f"no {kernel} kernel on this CPU")
    hf_model = tiny_family_model(kind)
    hf_model.save_pretrained(tmp_path)
    precision = "auto" if kernel == "onednn-bf16" else "float32"
    ours = Transformer.from_pretrained(tmp_path, precision=precision, kernel=kernel)
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(0))
    logits, _ = ours(ids, torch.arange(300)[None].expand(2, -1), all_logits=True)
    with torch.no_grad():
        expected = hf_model(ids).logits.float()
    tolerance = KERNEL_TOLERANCE[kernel]
    torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)


def test_sliding_windows_and_local_rope_are_read(family_dirs):
    gemma = Transformer.from_pretrained(family_dirs["gemma3"]).config
    phi = Transformer.from_pretrained(family_dirs["phi3"]).config
    assert [gemma.window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]
    assert [gemma.local_rope(i) for i in range(4)] == [True, True, False, True]
    assert gemma.embed_scale == 8.0 and gemma.final_logit_softcap == 30.0
    assert phi.rotary_dim == 8 and phi.max_positions == 512 and phi.window(3) == WINDOW


def test_gemma3_decode_step_by_step_equals_one_pass(family_dirs):
    """Decode through the cache past the window: each local layer drops the keys that leave
    its window, the global layer keeps them."""
    model = Transformer.from_pretrained(family_dirs["gemma3"])
    ids = torch.randint(0, 1000, (1, 80), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(80)[None]
    full, _ = model(ids, positions, all_logits=True)
    cache = KVCache(model.config, 1, 80, torch.device("cpu"))
    model(ids[:, :30], positions[:, :30], cache)
    steps = [model(ids[:, t : t + 1], positions[:, t : t + 1], cache)[0] for t in range(30, 80)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 30:], atol=1e-5, rtol=1e-5)


def test_gemma3_blend_question_never_reads_past_a_local_window(family_dirs, smollm2_tokenizer):
    """In blend's selection pass the question's attention in a sliding layer is 0 on every
    key more than a window before its first token (global layers do read them), and the
    blend's answer logits are finite."""
    model = Transformer.from_pretrained(family_dirs["gemma3"])
    prompt = PromptFormat.for_tokenizer(smollm2_tokenizer).build(
        [
            "The Amazon river flows into the Atlantic Ocean. " * 4,
            "Mount Kilimanjaro is the highest mountain in Africa. " * 4,
        ],
        "Where does the Amazon flow?",
    )
    chunks = precompute_chunks(model, prompt.head_ids, prompt.chunk_ids)
    result = blend_prefill(
        model, prompt.head_ids, chunks, prompt.question_ids, recompute_ratio=0.15
    )
    first_question = len(prompt.token_ids) - len(prompt.question_ids)
    beyond = first_question - WINDOW + 1  # keys before this are out of every local window
    attention = result.question_attention  # [L, T], zeros below the layers selection reads
    assert attention is not None and beyond > 0
    first, _ = selection_layers(model.config.n_layers, ATTENTION_FROM_DEPTH, 1.0)
    for layer in range(first, model.config.n_layers):
        far = attention[layer, :beyond].sum().item()
        assert (far == 0.0) if model.config.window(layer) else (far > 0.0)
    assert torch.isfinite(result.logits).all()


def test_stop_tokens_come_from_the_generation_config(family_dirs, smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family_dirs["qwen3"])
    assert stop_token_ids(tokenizer) == set(STOP_IDS)
    bundled = AutoTokenizer.from_pretrained(smollm2_dir)
    # the bundled GGUF's end of sequence, and its <|endoftext|>, where llama.cpp stops too
    ends = {bundled.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert stop_token_ids(bundled) == ends


def test_check_model_command_passes_gemma3_and_refuses_gpt2_by_name(family_dirs, tmp_path):
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)
    )
    gpt2.save_pretrained(tmp_path / "gpt2")
    command = [sys.executable, "-m", "kvservice.tools.check_model"]
    refused = subprocess.run(
        [*command, str(tmp_path / "gpt2")], capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 1, refused.stderr
    assert "NOT supported" in refused.stdout and "'gpt2'" in refused.stdout
    passed = subprocess.run(
        [*command, str(family_dirs["gemma3"]), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert ": supported (model type 'gemma3_text')" in passed.stdout
    assert "sliding window" in passed.stdout and "stop tokens: 2 '<|im_end|>'" in passed.stdout
    missing = subprocess.run(
        [*command, str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=300
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_multimodal_gemma3_runs_its_language_model(tmp_path):
    """A Gemma 3 4B-style checkpoint (``gemma3``: a vision tower beside the language model):
    the vision weights are not loaded and the text logits are HF's. (HF's multimodal class
    applies no final soft-capping; real Gemma 3 configs have none.)"""
    import transformers

    text, _ = tiny_family_config("gemma3", 128)
    text.final_logit_softcapping = None
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=120,
        boi_token_index=121,
        eoi_token_index=122,
    )
    torch.manual_seed(5)
    hf_model = perturbed(transformers.Gemma3ForConditionalGeneration(config))
    hf_model.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    assert ours.config.model_type == "gemma3_text" and ours.config.window(2) is None
    ids = torch.randint(0, 120, (1, 100), generator=torch.Generator().manual_seed(0))
    logits, _ = ours(ids, torch.arange(100)[None], all_logits=True)
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits.float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_sparse_multimodal_gemma3_config_gets_gemma3s_defaults():
    """Gemma 3 4B's ``text_config`` names six fields; the rest are Gemma3TextConfig's."""
    from kvservice.model.families import ModelConfig

    text = {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    }
    config = ModelConfig.from_hf_config({"model_type": "gemma3", "text_config": text})
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (8, 4, 256)
    assert (config.rope_type, config.rope_factor, config.local_rope_theta) == ("linear", 8.0, 1e4)
    assert [config.window(i) for i in range(6)] == [1024] * 5 + [None]
    assert config.tie_embeddings and config.attention_scale == 256**-0.5
