"""How close one answer's text is to another's: SQuAD's token F1. Plain Python (no Django),
so the fidelity audit and the benchmarks score answers the same way."""

from __future__ import annotations

import re
import string
from collections import Counter


def _normalize_tokens(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style token F1 (lowercased, punctuation and articles dropped)."""
    predicted, expected = _normalize_tokens(prediction), _normalize_tokens(reference)
    if not predicted and not expected:
        return 1.0
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)
