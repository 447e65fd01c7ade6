"""Where a prefill's time goes on a GPU: ``torch.profiler`` over one run of each mode of the
long-context bench's prompt (random-weight model of a real shape, chunks staged in a tier and
read through the store's loader), printed as the operators' device and host times.

    python -m bench.gpu_profile [--synthetic llama3-8b] [--context 16384] [--chunks 12] \\
        [--tier device|cpu] [--modes reuse,blend] [--ratio 0.15] [--rows 25]

``KV_CODEC`` picks the stored form as everywhere; on CUDA the passes are recorded as CUDA
graphs in the warm-up run, as in the long-context bench (``ENGINE_COMPILE=off``: as the
engine runs them). After each mode's table, one line sums the host's and the device's time
(``self`` times over every operator): a run whose host time is well above its device time is
paced by launches. On a machine without CUDA it profiles the CPU (``--device cpu``), which
says little about a GPU.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.long_context import bench_graphs, synthetic_prompt
from bench.staging import StoreBench
from kvservice.blend.prefill import blend_prefill
from kvservice.model.producer import KVProducer
from kvservice.tools.synthetic import random_model, synthetic_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--tier", default="device", choices=["device", "cpu", "disk"])
    parser.add_argument("--modes", default="full,reuse,blend")
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model = random_model(
        synthetic_config(args.synthetic, layers=args.layers),
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )
    bench_graphs(model, args.context + 1024)
    head, chunk_ids, question = synthetic_prompt(model.config.vocab_size, args.context, args.chunks)
    bench = StoreBench(args.tier, device=device, dtype=model.cache_dtype)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    try:
        with torch.no_grad():
            producer = KVProducer(model, head)
            head_kv, chunks = producer.head_kv, producer.compute(chunk_ids)
            bench.stage(chunks)
            for mode in args.modes.split(","):

                def run(mode: str = mode) -> None:
                    result = blend_prefill(
                        model,
                        head,
                        bench.sources(chunks, mode),
                        question,
                        mode=mode,
                        recompute_ratio=args.ratio,
                        chunk_ids=chunk_ids,
                        head_kv=head_kv,
                    )
                    int(result.logits.argmax())

                run()  # warm-up
                with profile(activities=activities) as prof:
                    run()
                print(
                    f"\n== {mode} ({args.context} tokens, {args.chunks} chunks from the "
                    f"{args.tier} tier)"
                )
                averages = prof.key_averages()
                print(averages.table(sort_by=sort, row_limit=args.rows))
                host = sum(event.self_cpu_time_total for event in averages) / 1e3
                device = sum(event.self_device_time_total for event in averages) / 1e3
                print(f"{mode}: host {host:.1f} ms, device {device:.1f} ms (self times summed)")
    finally:
        bench.close()


if __name__ == "__main__":
    main()
