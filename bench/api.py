"""TTFT as the user sees it, against a running stack, through the public REST API.

Uploads the Musique passages of a few examples as documents, waits for them to be ready
(KV included), then asks each example's question in every mode given and measures the time
from sending the question to the first streamed token (retrieval, queueing, KV loading,
blending included). Needs a staff API key (modes other than blend are staff-only)::

    DATA_DIR=.ragblend .venv/bin/python manage.py create_api_key admin   # prints a key
    .venv/bin/python -m bench.api --url http://127.0.0.1:8000 --api-key KEY \\
        --data ../shared/data/musique_dev.json --examples 4 --modes blend,full

Each mode is asked twice per question (first a warm-up, uncounted) so that both modes see
the same warm model and caches. Prints a table and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.data import shared_data


class Api:
    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url.rstrip("/"), key

    def _request(self, method: str, path: str, body: bytes | None = None, headers=None):
        request = urllib.request.Request(
            self.url + path,
            data=body,
            method=method,
            headers={"Authorization": f"Bearer {self.key}", **(headers or {})},
        )
        for _ in range(10):
            try:
                return urllib.request.urlopen(request, timeout=600)
            except urllib.error.HTTPError as err:
                if err.code != 429:  # over the key's rate limit: wait as the server says
                    raise
                time.sleep(float(err.headers.get("Retry-After") or 5))
        raise RuntimeError(f"{method} {path}: still rate-limited after 10 tries")

    def json(self, method: str, path: str, payload: Any = None) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        with self._request(method, path, body, {"Content-Type": "application/json"}) as response:
            data = response.read()
        return json.loads(data) if data else None  # 204 (delete) has no body

    def upload(self, name: str, text: str) -> dict:
        boundary = uuid.uuid4().hex
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            f"Content-Type: text/plain\r\n\r\n{text}\r\n--{boundary}--\r\n"
        ).encode()
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        with self._request("POST", "/api/v1/documents", body, headers) as response:
            return json.load(response)

    def ask_streaming(self, question: str, mode: str) -> dict[str, Any]:
        """Seconds to the first token event, and the done event's payload."""
        body = json.dumps({"question": question, "mode": mode, "stream": True}).encode()
        started = time.perf_counter()
        first = None
        event = None
        with self._request(
            "POST", "/api/v1/query", body, {"Content-Type": "application/json"}
        ) as response:
            for raw in response:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "token" and first is None:
                    first = time.perf_counter() - started
                elif line.startswith("data: ") and event in ("done", "error"):
                    payload = json.loads(line[6:])
                    if event == "error":
                        raise RuntimeError(f"answer failed: {payload}")
                    return {
                        "ttft_s": first,
                        "total_s": time.perf_counter() - started,
                        "done": payload,
                    }
        raise RuntimeError("the stream ended without a done event")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--data", type=Path, default=shared_data())
    parser.add_argument("--examples", type=int, default=3)
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--modes", default="blend,full")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    api = Api(args.url, args.api_key)
    examples = json.loads(args.data.read_text())[: args.examples]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    documents = []
    for e, example in enumerate(examples):
        for p, ctx in enumerate(example["ctxs"][: args.passages]):
            documents.append(api.upload(f"musique-{e}-{p}.txt", f"{ctx['title']}\n\n{ctx['text']}"))
    print(f"uploaded {len(documents)} passages; waiting for ready (KV included)…", flush=True)
    deadline = time.monotonic() + 900
    while True:
        listing = api.json("GET", "/api/v1/documents?limit=100")  # one request: rate limits
        wanted = {d["id"] for d in documents}
        states = [item["status"] for item in listing["items"] if item["id"] in wanted]
        if len(states) == len(wanted) and all(s in ("ready", "failed") for s in states):
            break
        if time.monotonic() > deadline:
            print("documents did not become ready in 15 minutes", file=sys.stderr)
            return 1
        time.sleep(3)

    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for example in examples:
        for mode in modes:
            api.ask_streaming(example["question"], mode)  # warm-up
            results[mode].append(api.ask_streaming(example["question"], mode))
    summary = {}
    print(f"\n{'mode':8} {'TTFT median (s)':>16} {'server TTFT (s)':>16} {'ratio to full':>14}")
    full = statistics.median(r["ttft_s"] for r in results["full"]) if "full" in results else None
    for mode, rows in results.items():
        user = statistics.median(r["ttft_s"] for r in rows)
        server = statistics.median(r["done"].get("metrics", {}).get("ttft_s") or 0 for r in rows)
        ratio = full / user if full else None
        summary[mode] = {
            "ttft_median_s": user,
            "server_ttft_median_s": server,
            "speedup_vs_full": ratio,
            "n": len(rows),
        }
        print(f"{mode:8} {user:16.3f} {server:16.3f} {'' if ratio is None else f'{ratio:13.2f}x'}")
    if args.json:
        args.json.write_text(json.dumps({"modes": summary, "examples": len(examples)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
