"""Chunk keys: content addresses, optionally in a scope (one user's objects)."""

from __future__ import annotations

import pytest

from kvservice.protocol.keys import ChunkKey


def test_a_scoped_key_is_another_object_of_the_same_content() -> None:
    shared = ChunkKey.for_tokens("model/v1", "head", [1, 2, 3])
    alices = ChunkKey.for_tokens("model/v1", "head", [1, 2, 3], scope="u7")
    assert shared != alices and alices.unscoped() == shared
    assert shared.to_string().count("/") == 2 and alices.to_string().count("/") == 3
    assert alices.to_string().endswith(f"/u7/{shared.tokens_sha256}")
    for key in (shared, alices):
        assert ChunkKey.from_string(key.to_string()) == key


@pytest.mark.parametrize("scope", ["U7", "u/7", "../x", "-u7", "u" * 65])
def test_a_scope_that_could_escape_its_path_is_refused(scope) -> None:
    with pytest.raises(ValueError, match="scope"):
        ChunkKey.for_tokens("m", "h", [1], scope=scope)
