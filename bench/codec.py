"""Which codec stores chunk KV: bytes per token against fidelity, on the same prompts.

    python -m bench.codec --data ../shared/data/musique_dev.json --first 0 --examples 20 \\
        --codecs fp16,fp8,kivi4,kivi3,kivi2 --json codecs.json

Per example the passages' KV is precomputed once (as ``python -m kvservice.bench`` does),
``full`` prefills once, and then for each codec every chunk is encoded and decoded
(``kvservice.store.format``, as the store does) and ``reuse`` and ``blend`` prefill over
the decoded KV; fidelity is teacher-forced against ``full`` exactly as the prefill bench
measures it (``tf_kl``, ``tf_agreement``). No timing of the prefills: only fidelity and
bytes, so ``--threads 1`` on a busy machine changes nothing but the wall time.

Per codec the summary gives the object bytes per token (header and token ids included),
the compression ratio to ``fp16``, each mode's ``tf_kl`` (mean, median, p90), its mean
difference to ``fp16``'s on the same prompts and how many examples got worse (by more than
1e-4), and ``entropy_bytes_per_token``: what an order-0 entropy coder (per layer and
section, e.g. CacheGen's arithmetic coder) would reach at best on the codes, as a bound.

A codec is a name in ``kvservice.protocol.codecs.CODECS`` or a kivi spec such as
``kivi:k=4@0.25/2:v=2:kg=64:vg=32`` (K 4 bits below a quarter of the depth then 2 bits;
V 2 bits; groups of 64 tokens for K, 32 channels for V; ``clip=0|1`` each group's range
searched for the least error or not, ``rot=1`` V turned by a Hadamard matrix).

Chunk KV is computed as the product computes it: after the shipped retrieval preamble when
``KV_PREAMBLE`` is on (``--kv-preamble on|off`` overrides), else after the prompt head alone
(every figure in ``docs/codec.md`` but the two runs marked ``--kv-preamble on``).

``--speed`` also times decoding (one layer at a time, as the loader does) and prints GB/s
of decoded float16 KV per thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.fidelity import (
    greedy_answer,
    teacher_forced_fidelity,
    teacher_forced_logits,
    without_stop,
)
from bench.prefill import (
    GAP_TOKENS,
    INSTRUCTION,
    QUESTION_PREFIX,
    SYSTEM_PROMPT,
    TF_TOKENS,
    example_prompt,
)
from bench.stats import quantile
from kvservice.blend.prefill import blend_prefill
from kvservice.chunk import ChunkKV
from kvservice.model.bundled import resolve_llm_path
from kvservice.model.producer import KVProducer
from kvservice.model.transformer import Transformer
from kvservice.protocol.codecs import KIVI, Codec, codec_by_name, kivi
from kvservice.protocol.models import default_cache_dir
from kvservice.protocol.prompt import PromptFormat, preamble_from_env, preamble_passages
from kvservice.serve.engine import stop_token_ids
from kvservice.store import codec as codecs
from kvservice.store.format import (
    decode_chunk,
    decode_header,
    decode_layers,
    encode_chunk,
    layer_run,
)

WORSE = 1e-4  # a tf_kl difference to fp16's smaller than this counts as a tie
MODES = ("reuse", "blend")


def parse_codec(text: str) -> Codec:
    """A codec name, or ``kivi:k=BITS[@UPTO/BITS..]:v=..:kg=N:vg=N[:clip=0|1][:rot=0|1]``."""
    if not text.startswith("kivi:"):
        return codec_by_name(text)
    fields = dict(part.split("=", 1) for part in text.removeprefix("kivi:").split(":"))

    def schedule(spec: str) -> tuple[tuple[float, int], ...]:
        steps, parts = [], spec.split("/")
        for part in parts[:-1]:
            bits, upto = part.split("@")
            steps.append((float(upto), int(bits)))
        return (*steps, (1.0, int(parts[-1])))

    return kivi(
        text,
        schedule(fields["k"]),
        schedule(fields["v"]),
        k_group=int(fields.get("kg", 64)),
        v_group=int(fields.get("vg", 64)),
        clip=fields.get("clip", "1") == "1",
        v_rotate=fields.get("rot", "0") == "1",
    )


def entropy_bytes(data: bytearray) -> int:
    """Bytes of an object if each kivi layer's codes were entropy coded (order 0, per layer
    and per K/V) and everything else kept as is: a bound on what entropy coding would save."""
    header = decode_header(data)
    if header.codec_kind != KIVI:
        return len(data)
    raw = torch.frombuffer(data, dtype=torch.uint8)
    saved = 0.0
    count = header.num_kv_heads * header.num_tokens * header.head_dim
    for index in range(header.num_layers):
        start = header.layer_offset(index)
        layout = header.layout(index)
        for section, bits in ((0, header.layer_bits[index][0]), (3, header.layer_bits[index][1])):
            at, size = layout.sections[section]
            codes = codecs.unpack_bits(raw[start + at : start + at + size], bits, count)
            freq = torch.bincount(codes.long(), minlength=1 << bits).double() / count
            entropy = -(freq[freq > 0] * freq[freq > 0].log2()).sum().item()
            saved += size - entropy * count / 8
    return len(data) - int(saved)


def decode_speed(
    objects: Sequence[bytearray], device: str, repeats: int = 3, layers_per_call: int = 1
) -> float:
    """GB/s of decoded float16 KV (2 bytes a value), best of ``repeats``: layer by layer, or
    in runs of up to ``layers_per_call`` layers (``decode_layers``, as the loader does on
    CUDA)."""
    runs = []
    for data in objects:
        header = decode_header(data)
        raw = torch.frombuffer(data, dtype=torch.uint8).to(device)
        first = 0
        while first < header.num_layers:
            count = layer_run(header, first, layers_per_call)
            runs.append((header, first, count, raw[header.layer_offset(first) :]))
            first += count
    values = sum(2 * n * h.num_kv_heads * h.num_tokens * h.head_dim for h, _, n, _ in runs)
    best = math.inf
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        for header, first, count, block in runs:
            decode_layers(header, first, count, block)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return values * 2 / best / 1e9


@torch.no_grad()
def run_example(model, tokenizer, fmt, example, args, stop_ids, codec_list) -> dict:
    prompt = example_prompt(fmt, example, args.passages)
    producer = KVProducer(model, fmt.storage_ids)  # --kv-preamble
    head_kv, chunks = producer.heads.get(prompt.head_ids), producer.compute(prompt.chunk_ids)
    extra = max(args.max_new_tokens, GAP_TOKENS)

    def prefill(sources: Sequence[ChunkKV], mode: str):
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
    answer_ids = greedy_answer(model, full, max(args.max_new_tokens, GAP_TOKENS), stop_ids)
    full_answer = without_stop(answer_ids, stop_ids)[: args.max_new_tokens]
    forced = answer_ids[:GAP_TOKENS]
    tf_positions = min(len(full_answer) + 1, TF_TOKENS)
    full_logits = teacher_forced_logits(model, full, forced)
    chunk_tokens = sum(chunk.num_tokens for chunk in chunks)
    row: dict = {"num_tokens": full.num_tokens, "chunk_tokens": chunk_tokens, "codecs": {}}
    for codec in codec_list:
        objects = [encode_chunk(c, codec=codec, narrow_to=torch.float16) for c in chunks]
        decoded = [decode_chunk(data) for data in objects]
        entry: dict = {
            "bytes": sum(len(data) for data in objects),
            "entropy_bytes": sum(entropy_bytes(data) for data in objects),
        }
        if args.speed:
            entry["decode_gbps"] = decode_speed(objects, args.device)
        for mode in MODES:
            result = prefill(decoded, mode)
            entry[mode] = teacher_forced_fidelity(
                teacher_forced_logits(model, result, forced), full_logits, forced, tf_positions
            )
        row["codecs"][codec.name] = entry
    return row


def summarize(rows: list[dict], names: Sequence[str]) -> dict:
    tokens = sum(row["chunk_tokens"] for row in rows)
    summary: dict = {}
    base = "fp16" if "fp16" in names else None
    fp16_bytes = sum(row["codecs"][base]["bytes"] for row in rows) / tokens if base else None
    for name in names:
        entries = [row["codecs"][name] for row in rows]
        per_token = sum(e["bytes"] for e in entries) / tokens
        out: dict = {
            "bytes_per_token": per_token,
            "entropy_bytes_per_token": sum(e["entropy_bytes"] for e in entries) / tokens,
            "compression": fp16_bytes / per_token if fp16_bytes else None,
        }
        if "decode_gbps" in entries[0]:
            out["decode_gbps"] = statistics.median(e["decode_gbps"] for e in entries)
        for mode in MODES:
            kl = [e[mode]["tf_kl"] for e in entries]
            stats = {
                "tf_kl_mean": statistics.fmean(kl),
                "tf_kl_median": statistics.median(kl),
                "tf_kl_p90": quantile(kl, 0.9),
                "tf_agreement": statistics.fmean(e[mode]["tf_agreement"] for e in entries),
            }
            if base:
                ref = [row["codecs"][base][mode]["tf_kl"] for row in rows]
                stats["tf_kl_minus_fp16"] = statistics.fmean(kl) - statistics.fmean(ref)
                stats["worse_than_fp16"] = sum(k > r + WORSE for k, r in zip(kl, ref, strict=True))
            out[mode] = stats
        summary[name] = out
    return summary


def print_table(summary: dict, examples: int) -> None:
    print(f"\n{examples} examples; tf_kl mean/median/p90, mean - fp16's, examples worse")
    print(
        f"{'codec':34} {'B/token':>8} {'ratio':>6} {'entropy':>8}  "
        + "  ".join(f"{mode:^42}" for mode in MODES)
    )
    for name, s in summary.items():
        ratio = f"{s['compression']:6.2f}" if s["compression"] else "     -"
        cols = []
        for mode in MODES:
            m = s[mode]
            delta = (
                f"{m['tf_kl_minus_fp16']:+.4f} {m['worse_than_fp16']:2d}w"
                if ("tf_kl_minus_fp16" in m)
                else ""
            )
            cols.append(
                f"{m['tf_kl_mean']:.4f}/{m['tf_kl_median']:.4f}/{m['tf_kl_p90']:.4f} {delta:>13}"
            )
        speed = f"  {s['decode_gbps']:.2f} GB/s" if "decode_gbps" in s else ""
        print(
            f"{name:34} {s['bytes_per_token']:8.0f} {ratio} "
            f"{s['entropy_bytes_per_token']:8.0f}  " + "  ".join(cols) + speed
        )


def example_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every codec bench shares: which examples, which model, where to write,
    and how chunk KV is computed (``--kv-preamble``; resolved by :func:`parse_examples`)."""
    parser.add_argument("--data", type=Path, required=True, help="Musique JSON")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--kv-preamble",
        choices=("on", "off"),
        default=None,
        help="chunk KV computed after the shipped retrieval preamble (default: KV_PREAMBLE's)",
    )


def parse_examples(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.kv_preamble is None:
        args.kv_preamble = "on" if preamble_from_env(os.environ) else "off"
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    example_arguments(parser)
    parser.add_argument("--ratio", type=float, default=0.15, help="blend recompute ratio")
    parser.add_argument("--codecs", default="fp16,fp8,kivi4,kivi3,kivi2")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--speed", action="store_true", help="also time decoding")
    return parse_examples(parser, argv)


def setup(args: argparse.Namespace, device: str = "cpu") -> tuple:
    """The model, tokenizer, prompt format and examples a codec bench runs on (its
    ``--data/--first/--examples/--model-path/--kv-preamble``)."""
    from transformers import AutoTokenizer

    model_dir = resolve_llm_path(args.model_path, default_cache_dir())
    model = Transformer.from_pretrained(model_dir, device=device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    preamble = preamble_passages() if args.kv_preamble == "on" else ()
    fmt = PromptFormat(tokenizer, SYSTEM_PROMPT, INSTRUCTION, QUESTION_PREFIX, preamble=preamble)
    examples = json.loads(args.data.read_text())[args.first : args.first + args.examples]
    return model, tokenizer, fmt, examples


def write_json(args: argparse.Namespace, summary: dict, rows: list[dict]) -> None:
    """``--json``: the summary so far, every example's row and the arguments."""
    if args.json:
        arguments = vars(args) | {"data": str(args.data), "json": str(args.json)}
        args.json.write_text(
            json.dumps({"summary": summary, "examples": rows, "args": arguments}, indent=2)
        )


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    codec_list = [parse_codec(text) for text in args.codecs.split(",") if text]
    model, tokenizer, fmt, examples = setup(args, args.device)
    stop_ids = stop_token_ids(tokenizer)
    names = [codec.name for codec in codec_list]
    rows: list[dict] = []
    for index, example in enumerate(examples):
        rows.append(run_example(model, tokenizer, fmt, example, args, stop_ids, codec_list))
        brief = "  ".join(
            f"{name}={e['blend']['tf_kl']:.4f}/{e['reuse']['tf_kl']:.4f}"
            for name, e in rows[-1]["codecs"].items()
        )
        print(f"[{index + 1}/{len(examples)}] blend/reuse tf_kl  {brief}", flush=True)
        write_json(args, summarize(rows, names), rows)
    summary = summarize(rows, names)
    print_table(summary, len(rows))
    return summary


if __name__ == "__main__":
    main()
