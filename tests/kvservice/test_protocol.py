"""The request the web app queues and the inference worker reads."""

from __future__ import annotations

import json

from kvservice.protocol import ChunkRef, GenerateRequest, Turn


def test_a_request_round_trips_and_a_newer_versions_fields_are_left_out():
    request = GenerateRequest(
        request_id="r", question="q", chunks=[ChunkRef(1, [5, 6], "scope")],
        history=[Turn("user", "hi")], target_ratio=0.1, refresh_ratio=0.25,
    )  # fmt: skip
    data = json.loads(json.dumps(request.to_dict()))
    assert GenerateRequest.from_dict(data) == request
    newer = dict(data, speculative_tokens=4)  # a field a newer web app sends
    assert GenerateRequest.from_dict(newer) == request
    older = {k: v for k, v in data.items() if k != "refresh_ratio"}  # queued before it existed
    assert GenerateRequest.from_dict(older).refresh_ratio is None
