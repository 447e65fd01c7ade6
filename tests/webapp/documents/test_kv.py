from __future__ import annotations

from kvservice.model.producer import length_groups


def test_length_groups_keep_padding_small_and_cover_every_chunk() -> None:
    lengths = [490, 100, 480, 95, 300, 500]
    groups = length_groups(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert all(lengths[i] >= 0.8 * longest for i in group)
    assert len(groups) == 3


def test_length_groups_of_nothing() -> None:
    assert length_groups([]) == []
