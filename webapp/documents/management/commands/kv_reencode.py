"""Store every chunk's KV object again in one codec (``KV_CODEC``, or ``--codec``).

    python manage.py kv_reencode                 # into the configured default codec
    python manage.py kv_reencode --codec fp16 --dry-run

Objects go in key order, one at a time, each under its key's advisory lock
(``documents.services.kv_object_reencode``): safe beside running workers, and resumable
(an object already in the codec is passed over at the cost of one read, and
``--start-after KEY``, which the progress lines print, skips the listing's head). Objects in
another quantized codec are left alone (a second rounding); precompute those again. Each
chunk's ``kv_bytes`` is set to what its object now takes, so quotas and the dashboard count
the bytes actually stored.
"""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError

from webapp.documents.models import Chunk
from webapp.documents.services import kv_object_reencode


class Command(BaseCommand):
    help = "Re-encode the stored chunk KV objects into one codec (resumable, with progress)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--codec", default=None, help="default: KV_CODEC's")
        parser.add_argument("--dry-run", action="store_true", help="read and report only")
        parser.add_argument("--start-after", default="", help="resume after this key")
        parser.add_argument("--limit", type=int, default=0, help="stop after N objects")
        parser.add_argument("--every", type=int, default=1, help="a progress line every N")

    def handle(self, *args, **options) -> None:
        from kvservice.store.config import StoreConfig

        codec = options["codec"] or StoreConfig.from_env().codec
        try:
            from kvservice.store.codec import codec_by_name

            codec_by_name(codec)
        except ValueError as err:
            raise CommandError(str(err)) from err
        keys = (
            Chunk.objects.exclude(kv_key="")
            .filter(kv_key__gt=options["start_after"])
            .order_by("kv_key")
            .values_list("kv_key", flat=True)
            .distinct()
        )
        total = keys.count()
        if options["limit"]:
            keys = keys[: options["limit"]]
            total = min(total, options["limit"])
        self.stdout.write(f"{total} objects to bring to {codec}"
                          f"{' (dry run)' if options['dry_run'] else ''}")  # fmt: skip
        counts: dict[str, int] = {}
        before = after = 0
        started = time.monotonic()
        for index, key in enumerate(keys.iterator(), 1):
            outcome = kv_object_reencode(key=key, codec=codec, write=not options["dry_run"])
            kind = "missing" if outcome is None else outcome.outcome
            counts[kind] = counts.get(kind, 0) + 1
            if outcome is not None:
                before += outcome.bytes_before
                after += outcome.bytes_after
            if index % options["every"] == 0 or index == total:
                what = "" if outcome is None else (
                    f"{outcome.codec_before} {outcome.bytes_before:,} B -> "
                    f"{outcome.codec_after} {outcome.bytes_after:,} B")  # fmt: skip
                self.stdout.write(
                    f"[{index}/{total}] {kind:9} {what}  {time.monotonic() - started:.1f} s  "
                    f"(resume: --start-after {key})"
                )
        ratio = f", {before / after:.2f}x smaller" if after else ""
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "nothing"
        self.stdout.write(self.style.SUCCESS(
            f"Done: {summary}; {before:,} B -> {after:,} B{ratio}"))  # fmt: skip
