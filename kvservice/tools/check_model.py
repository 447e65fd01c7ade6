"""``python -m kvservice.tools.check_model PATH``: does this engine run a checkpoint as it should?

Loads the checkpoint as the inference worker does (``kvservice.serve.runtime.NativeRuntime``: its
tokenizer, ``PromptFormat.for_tokenizer``, ``Transformer.from_pretrained``; float32 here, so
that the engine can be held to HF transformers' own float32 result), builds the product's
prompt for a fixed question over three fixed passages, and checks:

* **logits**: the engine's logits for every prompt token against HF transformers' for the
  same ids (``AutoModelForCausalLM``; it loads the weights a second time). A ``.gguf`` file is
  converted into the model cache as the worker converts it (``kvservice.model.bundled``), and the
  reference is transformers' own reading of the GGUF file, so the conversion is checked too;
  where transformers reads the file's model differently from the conversion (RoPE scaling
  its GGUF reader ignores, say), the reference is transformers loading the converted
  directory, and the report names the differences;
* **blend at ratio 1.0** equals full prefill (``kvservice.blend.prefill.blend_prefill``): every
  chunk token recomputed over the chunks' stored KV gives full's logits and cache;
* **stored chunk KV**: the first passage's KV as precomputed and stored (K before RoPE,
  ``kvservice.model.transformer.precompute_chunks``), turned to its place, is full
  prefill's KV there, and prefix caching, which reads it, gives full's logits.

It prints what a user needs to decide (supported or not, the largest logit difference, KV
bytes per token in fp16 and in the store's default codec, weight memory, the chat template
and the stop tokens) and exits 0 when supported, 1 when not (a model type the engine does
not run is named in the message), 2 when the path is no checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvservice.model.families import UnsupportedModelError

PASSAGES = (
    "The Amazon river flows through Peru, Colombia and Brazil before reaching the Atlantic "
    "Ocean. It carries more water than any other river on Earth.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa. Its summit, Uhuru "
    "Peak, stands 5,895 metres above sea level.",
    "The first public library in the United States opened in Peterborough, New Hampshire, "
    "in 1833, funded by the town's own taxes.",
)
QUESTION = "Which ocean does the Amazon river reach?"
# The engine against HF, both float32: differences of the order of float32 rounding through
# the layers, scaled by the logits' size (a 30-layer model's logits reach 20-40).
LOGIT_TOLERANCE = 1e-3  # of the largest |logit|
# Blend at 1.0 against full, and stored KV against full's: the same engine computing the same
# values in another order (grouped attention, in-place rotation).
EXACT_TOLERANCE = 1e-3
CODEC_CHUNK_TOKENS = 512  # the chunk size the per-token storage is given for


@dataclass
class Report:
    path: Path
    model_type: str
    supported: bool = False
    problems: list[str] = field(default_factory=list)
    max_logit_diff: float = float("nan")
    logit_scale: float = float("nan")
    blend_diff: float = float("nan")
    chunk_kv_diff: float = float("nan")
    prefix_diff: float = float("nan")
    prompt_tokens: int = 0
    kv_bytes_fp16: float = 0.0
    kv_bytes_codec: float = 0.0
    weight_bytes: int = 0
    checkpoint_bytes: int = 0
    chat_template: bool = False
    stop_tokens: list[tuple[int, str]] = field(default_factory=list)
    layers: str = ""
    checkpoint: Path | None = None  # the converted directory, for a GGUF file
    reference: str = "transformers loading the directory"

    def lines(self) -> list[str]:
        verdict = "supported" if self.supported else "NOT supported"
        lines = [f"{self.path}: {verdict} (model type {self.model_type!r})"]
        lines += [f"  problem: {problem}" for problem in self.problems]
        if self.checkpoint is not None:
            lines.append(f"  converted into: {self.checkpoint}")
        if not self.prompt_tokens:
            return lines
        stops = ", ".join(f"{token_id} {text!r}" for token_id, text in self.stop_tokens)
        return lines + [
            f"  layers: {self.layers}",
            f"  max logit difference to HF transformers (float32, {self.prompt_tokens} prompt "
            f"tokens): {self.max_logit_diff:.2e} (largest |logit| {self.logit_scale:.2f}, "
            f"tolerance {LOGIT_TOLERANCE * max(1.0, self.logit_scale):.2e})",
            f"  reference: {self.reference}",
            f"  blend at ratio 1.0 against full prefill: {self.blend_diff:.2e}",
            f"  stored chunk KV against full prefill's: {self.chunk_kv_diff:.2e} "
            f"(prefix caching's logits: {self.prefix_diff:.2e})",
            f"  KV per token: {self.kv_bytes_fp16:,.0f} B in fp16, "
            f"{self.kv_bytes_codec:,.0f} B in the default codec ({_codec_name()})",
            f"  weights: {self.weight_bytes / 2**30:.2f} GiB in float32 "
            f"({self.checkpoint_bytes / 2**30:.2f} GiB of safetensors on disk)",
            f"  chat template: {'found' if self.chat_template else 'none (plain text turns)'}",
            f"  stop tokens: {stops or 'none'}",
        ]


def _codec_name() -> str:
    from kvservice.protocol.codecs import DEFAULT_CODEC

    return DEFAULT_CODEC


def kv_bytes_per_token(config, codec_name: str, tokens: int = CODEC_CHUNK_TOKENS) -> float:
    """Bytes per token of a ``tokens``-token chunk object's layer blocks in ``codec_name``
    (``kvservice.store.format.encoded_size``; fp16 is 2 bytes per K and V value)."""
    from kvservice.protocol.codecs import codec_by_name
    from kvservice.store.format import encoded_size

    size = encoded_size(
        config.n_layers,
        config.n_kv_heads,
        tokens,
        config.head_dim,
        torch.float16,
        codec=codec_by_name(codec_name),
    )
    return size / tokens


def _describe_layers(config) -> str:
    windows = [config.window(i) for i in range(config.n_layers)]
    local = sum(w is not None for w in windows)
    text = f"{config.n_layers} layers, {config.n_kv_heads} KV heads of {config.head_dim}"
    if local:
        text += f", {local} with a {max(w for w in windows if w)}-token sliding window"
    return text


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameter storage (a tied weight counted once)."""
    seen: dict[int, int] = {}
    for param in model.parameters():
        seen[param.data_ptr()] = param.numel() * param.element_size()
    return sum(seen.values())


def _hf_logits(load: Callable[[], Any], ids: torch.Tensor, device: str) -> torch.Tensor:
    """HF transformers' float32 logits ``[T, V]`` for ``ids [T]``, of the model ``load`` gives."""
    hf_model = load().to(device).eval()
    with torch.no_grad():
        logits = hf_model(ids[None]).logits[0].float()
    del hf_model
    return logits


def _hf_directory_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _hf_gguf_model(gguf_path: Path):
    """The GGUF file as transformers itself reads it (its config, its tensor names and
    transforms; ``from_pretrained(gguf_file=...)`` would need ``accelerate``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    result = model.load_state_dict(parsed["tensors"], strict=False)
    tied = config.tie_word_embeddings
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and tied)]
    if missing:
        raise UnsupportedModelError(f"transformers' GGUF reader left weights unset: {missing}")
    model.tie_weights()
    return model


def transformers_gguf_differences(gguf_path: Path, checkpoint: Path) -> list[str]:
    """Where transformers' GGUF reader makes another model of the file than the conversion
    (``kvservice.model.gguf``): the engine config fields that differ (empty: none)."""
    from transformers import AutoConfig

    from kvservice.model.families import ModelConfig

    ours = ModelConfig.from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        theirs = ModelConfig.from_hf_config(config)
    except Exception as error:  # noqa: BLE001 (any failure of theirs means: not comparable)
        return [f"it cannot read the file ({error})"]
    return [
        f"{f.name} {getattr(theirs, f.name)!r} for {getattr(ours, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if getattr(ours, f.name) != getattr(theirs, f.name)
    ]


def _reference(report: Report, path: Path, gguf_path: Path | None) -> Callable[[], Any]:
    """What the engine's logits are held to (``Report.reference`` says which)."""
    if gguf_path is None:
        return lambda: _hf_directory_model(path)
    differences = transformers_gguf_differences(gguf_path, path)
    if differences:
        report.reference = (
            "transformers loading the converted directory (its GGUF reader differs: "
            + "; ".join(differences)
            + ")"
        )
        return lambda: _hf_directory_model(path)
    report.reference = "transformers' own reading of the GGUF file"
    return lambda: _hf_gguf_model(gguf_path)


def _chunk_kv_diff(model, full_cache, chunk, start: int) -> float:
    """Largest difference between a stored chunk's KV, turned to its place at ``start``,
    and full prefill's cache there (every layer; K rotated in the cache)."""
    from kvservice.model.transformer import apply_rope

    positions = torch.arange(start, start + chunk.num_tokens, device=model.device)
    ropes = model.ropes(positions)
    worst = 0.0
    for i in range(model.config.n_layers):
        k_pre, v = chunk.layer(i)  # [H_kv, n, D]
        k = apply_rope(k_pre.to(model.device).float(), *ropes[i])
        span = slice(start, start + chunk.num_tokens)
        worst = max(worst, (k - full_cache.k[i, 0, :, span].float()).abs().max().item())
        worst = max(worst, (v.float() - full_cache.v[i, 0, :, span].float()).abs().max().item())
    return worst


def _engine_checks(report: Report, model, prompt) -> None:
    """Blend at 1.0 and prefix caching against full; the first chunk's stored KV."""
    from kvservice.blend.prefill import blend_prefill
    from kvservice.model.transformer import precompute_chunks

    head, chunk_ids, question = prompt.head_ids, prompt.chunk_ids, prompt.question_ids
    chunks = precompute_chunks(model, head, chunk_ids)
    full = blend_prefill(model, head, chunks, question, mode="full", chunk_ids=chunk_ids)
    blend = blend_prefill(model, head, chunks, question, mode="blend", recompute_ratio=1.0)
    prefix = blend_prefill(model, head, chunks, question, mode="prefix")
    n = full.num_tokens
    cache_diff = max(
        (blend.cache.k[..., :n, :] - full.cache.k[..., :n, :]).abs().max().item(),
        (blend.cache.v[..., :n, :] - full.cache.v[..., :n, :]).abs().max().item(),
    )
    report.blend_diff = max((blend.logits - full.logits).abs().max().item(), cache_diff)
    report.prefix_diff = (prefix.logits - full.logits).abs().max().item()
    report.chunk_kv_diff = _chunk_kv_diff(model, full.cache, chunks[0], len(head))


def _measure(report: Report, path: Path, device: str, gguf_path: Path | None = None) -> None:
    """Everything but the verdict: load as the worker does, compare, size."""
    from transformers import AutoTokenizer

    from kvservice.model.transformer import Transformer
    from kvservice.protocol.prompt import PromptFormat, stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path, device=device, precision="float32")
    prompt = PromptFormat.for_tokenizer(tokenizer).build(PASSAGES, QUESTION)
    ids = torch.tensor(prompt.token_ids, device=device)
    positions = torch.arange(ids.numel(), device=device)
    ours, _ = model(ids[None], positions[None], all_logits=True)
    reference = _hf_logits(_reference(report, path, gguf_path), ids, device)
    report.prompt_tokens = ids.numel()
    report.max_logit_diff = (ours[0] - reference).abs().max().item()
    report.logit_scale = reference.abs().max().item()
    _engine_checks(report, model, prompt)
    report.layers = _describe_layers(model.config)
    report.kv_bytes_fp16 = kv_bytes_per_token(model.config, "fp16")
    report.kv_bytes_codec = kv_bytes_per_token(model.config, _codec_name())
    report.weight_bytes = _weight_bytes(model)
    report.checkpoint_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    report.chat_template = bool(getattr(tokenizer, "chat_template", None))
    report.stop_tokens = [
        (token_id, tokenizer.convert_ids_to_tokens(token_id))
        for token_id in sorted(stop_token_ids(tokenizer, path))
    ]


def _verdict(report: Report) -> None:
    tolerance = LOGIT_TOLERANCE * max(1.0, report.logit_scale)
    if not report.max_logit_diff <= tolerance:
        report.problems.append(
            f"logits differ from HF transformers' by {report.max_logit_diff:.2e}"
        )
    if not report.blend_diff <= EXACT_TOLERANCE:
        report.problems.append(f"blend at 1.0 differs from full prefill by {report.blend_diff:.2e}")
    if not max(report.chunk_kv_diff, report.prefix_diff) <= EXACT_TOLERANCE:
        report.problems.append("stored chunk KV does not reproduce full prefill's")
    if not report.stop_tokens:
        report.problems.append("no stop token: answers would only end at the length limit")
    report.supported = not report.problems


def check(path: str | Path, device: str | None = None) -> Report:
    """The report for the checkpoint directory or GGUF file ``path`` (``ModelPathError`` when
    it is neither). An unsupported model type or layout is a report with ``supported`` False,
    not an error."""
    from kvservice.model.bundled import gguf_checkpoint
    from kvservice.model.families import ModelConfig
    from kvservice.protocol.models import check_checkpoint_dir, check_gguf_file, check_tokenizer

    given = Path(path).expanduser()
    gguf_path = check_gguf_file(given) if given.suffix.lower() == ".gguf" else None
    if gguf_path is not None:
        try:
            directory = check_checkpoint_dir(gguf_checkpoint(gguf_path))
        except UnsupportedModelError as error:
            report = Report(given, _gguf_architecture(gguf_path))
            report.problems.append(str(error))
            return report
    else:  # the tokenizer after the model type: an unsupported model is named as such
        directory = check_checkpoint_dir(given, tokenizer=False)
    hf_config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    report = Report(given, str(hf_config.get("model_type")))
    report.checkpoint = directory if gguf_path is not None else None
    try:
        ModelConfig.from_hf_config(hf_config)
    except UnsupportedModelError as error:
        report.problems.append(str(error))
        return report
    check_tokenizer(directory)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _measure(report, directory, device, gguf_path)
    _verdict(report)
    return report


def _gguf_architecture(gguf_path: Path) -> str:
    from kvservice.model.gguf import read_gguf

    return read_gguf(gguf_path).architecture


def main(argv: list[str] | None = None) -> int:
    from kvservice.protocol.models import ModelPathError

    parser = argparse.ArgumentParser(
        prog="python -m kvservice.tools.check_model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "path", help="an HF checkpoint directory (config.json, *.safetensors) or a .gguf file"
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda where there is one)")
    args = parser.parse_args(argv)
    try:
        report = check(args.path, args.device)
    except ModelPathError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    return 0 if report.supported else 1


if __name__ == "__main__":
    sys.exit(main())
