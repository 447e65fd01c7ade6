"""The KV of recent prompts' context, kept for the next question that starts the same way.

A follow-up question usually retrieves the passages of the question before it, often in the
same order, and the prompt up to the question part (``[head][1] passage [2] passage ...``) is
then token for token the previous turn's. Its KV was computed (blended) a moment ago: the
inference worker keeps it here, and the follow-up reads it as it stands, at the very same
positions, instead of loading and blending its chunks again. Only the question part (and
any passage after the shared ones) is computed, so a follow-up costs about what ``reuse``
costs, at the fidelity of the previous turn's blend (measured in ``docs/conversation.md``).

Entries are found by the longest shared run of segments: every segment boundary of a stored
prompt has its own key (a hash chained over the segments' token ids and KV scopes, so one
user's cached context never serves another scope), all pointing at the one stored tensor.
Memory is bounded by ``PREFIX_CACHE_BYTES`` (least recently used first out; 0 turns it off).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvservice.model.transformer import KVCache

DEFAULT_CAPACITY_BYTES = 1 << 30  # PREFIX_CACHE_BYTES (kvservice.config)


def boundaries(
    head_ids: Sequence[int], segments: Sequence[Sequence[int]], scopes: Sequence[str]
) -> tuple[list[str], list[int]]:
    """One key per segment boundary, and the prompt's length there: ``keys[j]`` names the
    prompt ``head + segments[:j + 1]``, ``lengths[j]`` its token count. ``scopes[j]`` is
    segment j's KV scope ("" for the parts everyone shares)."""
    digest = hashlib.sha256(torch.tensor(list(head_ids), dtype=torch.int64).numpy().tobytes())
    keys, lengths, length = [], [], len(head_ids)
    for ids, scope in zip(segments, scopes, strict=True):
        digest.update(scope.encode() + b"\0")
        digest.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes() + b"\1")
        keys.append(digest.copy().hexdigest())
        length += len(ids)
        lengths.append(length)
    return keys, lengths


@dataclass(frozen=True)
class PrefixKV:
    """KV of a prompt's first ``num_tokens`` slots, K rotated at those very positions:
    ``k, v [L, H_kv, T, D]`` (``T >= num_tokens``: a shorter prefix is a view of a longer one).
    ``.layer(i)`` is what ``blend_prefill`` reads, in the model's dtype."""

    k: torch.Tensor
    v: torch.Tensor
    num_tokens: int
    dtype: torch.dtype = torch.float32

    head_hash = None  # not a chunk: never "exact" by the chunk rule
    rotated = True  # K is already at its positions

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_tokens
        return self.k[index, :, :n].to(self.dtype), self.v[index, :, :n].to(self.dtype)

    def truncated(self, num_tokens: int) -> PrefixKV:
        return PrefixKV(self.k, self.v, num_tokens, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @classmethod
    def from_cache(cls, cache: KVCache, num_tokens: int, store_dtype: torch.dtype) -> PrefixKV:
        """A copy of slots ``[0, num_tokens)`` of a batch-1 cache (after a prefill)."""
        k = cache.k[:, 0, :, :num_tokens].to(store_dtype, copy=True)
        v = cache.v[:, 0, :, :num_tokens].to(store_dtype, copy=True)
        return cls(k, v, num_tokens, cache.k.dtype)


class PrefixCache:
    """Thread-safe LRU of ``PrefixKV`` by bytes, looked up by the longest stored boundary."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[PrefixKV, list[str]]] = OrderedDict()
        self._index: dict[str, tuple[str, int]] = {}  # boundary key -> (entry, tokens)
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0

    def match(self, keys: Sequence[str], lengths: Sequence[int]) -> tuple[PrefixKV, int] | None:
        """The stored KV of the longest run of segments ``keys`` shares with a stored prompt,
        and how many segments that is; ``lengths[j]`` is the prompt's token count up to the
        end of segment j (a check against hash collisions of different lengths)."""
        with self._lock:
            for j in range(len(keys) - 1, -1, -1):
                found = self._index.get(keys[j])
                if found is None or found[1] != lengths[j]:
                    continue
                entry, tokens = found
                self._entries.move_to_end(entry)
                self.hits += 1
                return self._entries[entry][0].truncated(tokens), j + 1
            self.misses += 1
            return None

    def put(self, keys: Sequence[str], lengths: Sequence[int], kv: PrefixKV) -> bool:
        """Keep ``kv`` (the prompt of all ``keys``' segments); False when it does not fit."""
        if not keys or kv.nbytes > self.capacity_bytes:
            return False
        with self._lock:
            if keys[-1] in self._entries:
                self._entries.move_to_end(keys[-1])
                return True
            while self._entries and self.used_bytes + kv.nbytes > self.capacity_bytes:
                self._evict_oldest()
            self._entries[keys[-1]] = (kv, list(keys))
            self.used_bytes += kv.nbytes
            for key, tokens in zip(keys, lengths, strict=True):
                self._index[key] = (keys[-1], tokens)
            return True

    def _evict_oldest(self) -> None:
        name, (kv, keys) = self._entries.popitem(last=False)
        self.used_bytes -= kv.nbytes
        for key in keys:
            if self._index.get(key, (None,))[0] == name:
                del self._index[key]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes,
                "hits": self.hits,
                "misses": self.misses,
            }
