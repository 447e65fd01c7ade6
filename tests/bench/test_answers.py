"""The answer bench's loop detector (the rest of it runs the model: tests/e2e/test_handbook.py)."""

from __future__ import annotations

from bench.answers import loops


def test_a_sentence_said_three_times_loops_and_twice_does_not():
    sentence = "The policy allows ten days of leave per year. "
    assert loops(sentence * 3)
    assert not loops(sentence * 2 + "Ask your manager first.")
