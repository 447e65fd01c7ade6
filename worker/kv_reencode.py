"""Store every chunk's KV object again in one codec (``KV_CODEC``, or ``--codec``).

    python -m worker.kv_reencode                 # into the configured default codec
    python -m worker.kv_reencode --codec fp16 --dry-run

Objects go in key order, one at a time, each under its key's advisory lock
(``documents.services.kv_object_reencode``): safe beside running workers, and resumable
(an object already in the codec is passed over at the cost of one read, and
``--start-after KEY``, which the progress lines print, skips the listing's head). Objects in
another quantized codec are left alone (a second rounding); precompute those again. Each
chunk's ``kv_bytes`` is set to what its object now takes, so quotas and the dashboard count
the bytes actually stored. A KV worker's command (it decodes and encodes with torch), run
where the workers run, with their environment.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker.kv_reencode",
        description="Re-encode the stored chunk KV objects into one codec (resumable, with "
        "progress).",
    )
    parser.add_argument("--codec", default=None, help="default: KV_CODEC's")
    parser.add_argument("--dry-run", action="store_true", help="read and report only")
    parser.add_argument("--start-after", default="", help="resume after this key")
    parser.add_argument("--limit", type=int, default=0, help="stop after N objects")
    parser.add_argument("--every", type=int, default=1, help="a progress line every N")
    return parser


def _setup_django() -> None:
    import django
    from django.apps import apps

    if not apps.ready:  # run as a command; a test has its settings already
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
        django.setup()


def main(argv: Sequence[str] | None = None, stdout: TextIO = sys.stdout) -> int:
    parser = _parser()
    options = parser.parse_args(argv)
    _setup_django()
    from kvservice.protocol.codecs import codec_by_name
    from kvservice.store.config import StoreConfig

    codec = options.codec or StoreConfig.from_env().codec
    try:
        codec_by_name(codec)
    except ValueError as err:
        parser.error(str(err))
    _reencode_all(options, codec, stdout)
    return 0


def _reencode_all(options: argparse.Namespace, codec: str, stdout: TextIO) -> None:
    from webapp.documents.models import Chunk
    from webapp.documents.services import kv_object_reencode
    from worker.kv import kv_store

    keys = (
        Chunk.objects.exclude(kv_key="")
        .filter(kv_key__gt=options.start_after)
        .order_by("kv_key")
        .values_list("kv_key", flat=True)
        .distinct()
    )
    total = keys.count()
    if options.limit:
        keys = keys[: options.limit]
        total = min(total, options.limit)
    print(
        f"{total} objects to bring to {codec}{' (dry run)' if options.dry_run else ''}", file=stdout
    )
    counts: dict[str, int] = {}
    before = after = 0
    started = time.monotonic()
    for index, key in enumerate(keys.iterator(), 1):
        outcome = kv_object_reencode(
            key=key, codec=codec, store=kv_store(), write=not options.dry_run
        )
        kind = "missing" if outcome is None else outcome.outcome
        counts[kind] = counts.get(kind, 0) + 1
        if outcome is not None:
            before += outcome.bytes_before
            after += outcome.bytes_after
        if index % options.every == 0 or index == total:
            what = (
                ""
                if outcome is None
                else (
                    f"{outcome.codec_before} {outcome.bytes_before:,} B -> "
                    f"{outcome.codec_after} {outcome.bytes_after:,} B"
                )
            )
            print(
                f"[{index}/{total}] {kind:9} {what}  {time.monotonic() - started:.1f} s  "
                f"(resume: --start-after {key})",
                file=stdout,
            )
    ratio = f", {before / after:.2f}x smaller" if after else ""
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "nothing"
    print(f"Done: {summary}; {before:,} B -> {after:,} B{ratio}", file=stdout)


if __name__ == "__main__":
    sys.exit(main())
