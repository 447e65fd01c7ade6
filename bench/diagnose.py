"""Where reuse's error lives: which tokens' true KV would recover full prefill's answer.

    python -m bench.diagnose --data ../shared/data/musique_dev.json --first 20 --examples 20

Per example, the prompt is prefilled in full once to get every token's true KV (what full
prefill computes for it in this prompt). Each *oracle* then runs ``reuse`` over chunks whose KV
is the true KV for one set of tokens (the same budget, ``--ratio`` of the chunk tokens) and
stale elsewhere, and is scored like the bench (teacher-forced KL to full over the first 16
tokens of full's answer, the log-probability gap over 32). Sets:

* ``blend_selection``: the tokens blend selects (``attention_importance``), given true KV;
* ``true_v_deviation``: the tokens whose cached V deviates most from the true V, over all
  layers (CacheBlend's HKVD criterion, with hindsight);
* ``chunk_starts`` / ``chunk_borders``: the first tokens of each chunk / tokens on both sides
  of each chunk border (EPIC);
* ``random``: a random set;
* ``all_layers_A-B``: every chunk token, true KV in layers A..B-1 only (later layers' drift).

Beside them ``reuse`` and ``blend`` themselves: blend's gap to ``blend_selection`` is what
recomputing (rather than knowing) the selected tokens' KV loses.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.fidelity import greedy_answer, teacher_forced_fidelity, teacher_forced_logits
from bench.prefill import (
    GAP_TOKENS,
    INSTRUCTION,
    QUESTION_PREFIX,
    SYSTEM_PROMPT,
    TF_TOKENS,
    example_prompt,
)
from kvservice.blend.prefill import BlendResult, BlendSettings, blend_prefill
from kvservice.blend.selection import attention_importance, select_recompute
from kvservice.chunk import ChunkKV
from kvservice.model.bundled import resolve_llm_path
from kvservice.model.producer import KVProducer
from kvservice.model.transformer import Transformer
from kvservice.protocol.models import default_cache_dir
from kvservice.protocol.prompt import PromptFormat
from kvservice.serve.engine import stop_token_ids


def with_true_kv(
    chunks: Sequence[ChunkKV],
    starts: Sequence[int],
    true_k: torch.Tensor,
    true_v: torch.Tensor,
    tokens: torch.Tensor,
    layers: range | None = None,
) -> list[ChunkKV]:
    """Copies of ``chunks`` (chunk ``j`` at prompt position ``starts[j]``) whose KV is the true
    KV ``true_k/true_v [L, H_kv, T, D]`` (pre-RoPE) at the prompt positions where ``tokens
    [T]`` is True, in ``layers`` (all by default), and their own KV elsewhere."""
    out = []
    for chunk, start in zip(chunks, starts, strict=True):
        span = slice(start, start + chunk.num_tokens)
        chosen = tokens[span]
        k, v = chunk.k.clone(), chunk.v.clone()
        for layer in layers or range(k.shape[0]):
            k[layer][:, chosen] = true_k[layer][:, span][:, chosen]
            v[layer][:, chosen] = true_v[layer][:, span][:, chosen]
        out.append(ChunkKV(chunk.token_ids, k, v, chunk.model_fingerprint, chunk.head_hash))
    return out


@torch.no_grad()
def diagnose_example(model, fmt, example, args, stop_ids) -> dict:
    prompt = example_prompt(fmt, example, args.passages)
    producer = KVProducer(model, prompt.head_ids)
    head_kv, chunks = producer.head_kv, producer.compute(prompt.chunk_ids)
    extra = GAP_TOKENS

    def prefill(sources, mode="reuse") -> BlendResult:
        return blend_prefill(
            model,
            prompt.head_ids,
            sources,
            prompt.question_ids,
            mode=mode,
            recompute_ratio=args.ratio,
            chunk_ids=prompt.chunk_ids,
            head_kv=head_kv,
            extra_capacity=extra,
        )

    full = prefill(chunks, "full")
    answer = greedy_answer(model, full, GAP_TOKENS, stop_ids)
    full_logits = teacher_forced_logits(model, full, answer)

    def score(result: BlendResult) -> dict:
        logits = teacher_forced_logits(model, result, answer)
        return teacher_forced_fidelity(logits, full_logits, answer, TF_TOKENS)

    # True KV of every token: one forward over the whole prompt.
    ids = torch.tensor([prompt.token_ids], device=model.device)
    _, kv = model(ids, torch.arange(ids.shape[1], device=model.device)[None], collect_kv=True)
    true_k = torch.stack([k[0] for k, _ in kv]).cpu()  # [L, H_kv, T, D], pre-RoPE
    true_v = torch.stack([v[0] for _, v in kv]).cpu()
    num_tokens = ids.shape[1]
    starts = [len(prompt.head_ids)]
    for chunk_ids in prompt.chunk_ids[:-1]:
        starts.append(starts[-1] + len(chunk_ids))
    candidate = torch.zeros(num_tokens, dtype=torch.bool)
    candidate[starts[1] : starts[-1] + len(prompt.chunk_ids[-1])] = True  # first chunk exact
    budget = math.ceil(args.ratio * sum(len(c) for c in prompt.chunk_ids))

    blend = prefill(chunks, "blend")
    rows = {"reuse": score(prefill(chunks)), "blend": score(blend)}
    settings = BlendSettings()  # what blend selected by, in its reuse pass
    importance = attention_importance(
        blend.question_attention,
        candidate,
        settings.attention_from_depth,
        settings.attention_to_depth,
        model.config.n_layers,
    )
    deviation = torch.zeros(num_tokens)
    for chunk, start in zip(chunks, starts, strict=True):
        span = slice(start, start + chunk.num_tokens)
        deviation[span] = (chunk.v.float() - true_v[:, :, span]).pow(2).sum(dim=(0, 1, 3))
    per_border = max(1, budget // max(1, len(chunks) - 1))
    starts_mask = torch.zeros(num_tokens, dtype=torch.bool)
    borders_mask = torch.zeros(num_tokens, dtype=torch.bool)
    for start in starts[1:]:
        starts_mask[start : start + per_border] = True
        borders_mask[start - per_border // 2 : start + per_border - per_border // 2] = True
    generator = torch.Generator().manual_seed(0)

    def top(scores: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        mask[select_recompute(scores, candidate, budget)] = True
        return mask

    oracles = {
        "blend_selection": top(importance),
        "true_v_deviation": top(deviation),
        "chunk_starts": starts_mask & candidate,
        "chunk_borders": borders_mask & candidate,
        "random": top(torch.rand(num_tokens, generator=generator)),
    }
    for name, tokens in oracles.items():
        rows[f"oracle_{name}"] = score(
            prefill(with_true_kv(chunks, starts, true_k, true_v, tokens))
        )
    n_layers = model.config.n_layers
    thirds = [0, n_layers // 3, 2 * n_layers // 3, n_layers]
    for low, high in zip(thirds, thirds[1:], strict=False):
        patched = with_true_kv(chunks, starts, true_k, true_v, candidate, range(low, high))
        rows[f"oracle_all_layers_{low}-{high}"] = score(prefill(patched))
    return {"num_tokens": num_tokens, "budget": budget, "runs": rows}


def summarize(examples: list[dict]) -> dict:
    names = list(examples[0]["runs"])
    out = {}
    for name in names:
        kl = [e["runs"][name]["tf_kl"] for e in examples]
        reuse = [e["runs"]["reuse"]["tf_kl"] for e in examples]
        out[name] = {
            "tf_kl": statistics.fmean(kl),
            "tf_kl_median": statistics.median(kl),
            "tf_logprob_gap": statistics.fmean(e["runs"][name]["tf_logprob_gap"] for e in examples),
            "tf_agreement": statistics.fmean(e["runs"][name]["tf_agreement"] for e in examples),
            "share_of_reuse_error_left": statistics.fmean(
                k / r for k, r in zip(kl, reuse, strict=True) if r > 0
            ),
        }
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m bench.diagnose", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--first", type=int, default=20)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = resolve_llm_path(args.model_path, default_cache_dir())
    model = Transformer.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = PromptFormat(tokenizer, SYSTEM_PROMPT, INSTRUCTION, QUESTION_PREFIX)
    stop_ids = stop_token_ids(tokenizer)
    data = json.loads(args.data.read_text())[args.first : args.first + args.examples]
    examples = []
    for index, example in enumerate(data):
        examples.append(diagnose_example(model, fmt, example, args, stop_ids))
        brief = "  ".join(f"{k}={v['tf_kl']:.3f}" for k, v in examples[-1]["runs"].items())
        print(f"[{index + 1}/{len(data)}] {brief}", flush=True)
    summary = summarize(examples)
    print(f"\n{'run':34} {'KL mean':>8} {'median':>8} {'gap':>7} {'agree':>6} {'left':>6}")
    for name, s in summary.items():
        print(
            f"{name:34} {s['tf_kl']:8.4f} {s['tf_kl_median']:8.4f} {s['tf_logprob_gap']:7.3f} "
            f"{s['tf_agreement']:6.3f} {s['share_of_reuse_error_left']:6.2f}"
        )
    result = {"summary": summary, "examples": examples, "ratio": args.ratio, "first": args.first}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
