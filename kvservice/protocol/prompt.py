"""The prompt, as token ids: ``[head][chunk 1]…[chunk n][question part]``.

- The head (chat-template opening, system prompt, the user turn's opening and instruction) is
  the same for every question of a deployment. Chunks are precomputed *after* it, and its
  hash is part of every chunk's cache key, so changing the system prompt never serves stale KV.
- Chunks may instead be precomputed after the head and a fixed retrieval preamble
  (``storage_ids``, ``KV_PREAMBLE=on``): their stored KV then looks like a passage in the middle
  of a retrieved context, which is where the prompt puts it (docs/blend.md).
- Each chunk is its text tokenized on its own, without special tokens, exactly the same way
  at precompute and at query time (so the cached tokens are exactly the prompt's tokens).
- The question part carries the recent conversation, the question, the end of the user turn
  and the assistant turn's opening; it is always computed fresh.

The chat template comes from the model's own tokenizer, so every checkpoint gets its own
format, and the tokens that end an answer from its tokenizer and ``generation_config.json``
(``stop_token_ids``). One class serves the product (``PromptFormat.for_tokenizer``) and the
benchmark (the paper's Musique prompt, built with other texts).

Both sides build it: ingest tokenizes chunks and computes their KV after ``storage_ids``, the
inference worker looks them up by the same keys, so it lives in the protocol (no torch).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvservice.protocol import environment
from kvservice.protocol.keys import token_ids_sha256

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using only the numbered sources in the "
    "user's message, and cite the source you used with its number in brackets, like [1]. "
    "Answer briefly, in one or two sentences. If the sources do not contain the answer, say "
    "that you could not find it in the documents."
)
SOURCES_INTRO = "Sources:\n\n"
# Words the prompt puts at the start of its parts: an answer that writes one has started a
# turn of its own ("Question: ... Answer: ..."), so it ends there (``SamplingParams.stop``).
TURN_MARKERS = ("Question:", "User:", "Assistant:", "Earlier in this conversation", "Sources:")
_MARK = "\u2063RAGBLEND_USER_CONTENT\u2063"


@dataclass
class Prompt:
    head_ids: list[int]
    chunk_ids: list[list[int]]
    question_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        ids = list(self.head_ids)
        for chunk in self.chunk_ids:
            ids += chunk
        return ids + list(self.question_ids)


class PromptFormat:
    """Builds the parts of the prompt with the model's chat template: the user turn is
    ``instruction + chunks + question_prefix + question``."""

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str | None = None,
        instruction: str = "",
        question_prefix: str = "Question: ",
        chunk_separator: str = "\n\n",
        preamble: Sequence[str] = (),
        numbered: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.instruction = instruction
        self.question_prefix = question_prefix
        self.chunk_separator = chunk_separator
        messages = [{"role": "user", "content": _MARK}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        if getattr(tokenizer, "chat_template", None):
            rendered = _render(tokenizer, messages)
        else:  # a base model: plain text turns, after its BOS where it reads one
            rendered = f"{_bos_text(tokenizer)}{system_prompt or ''}\n\nUser: {_MARK}\nAssistant:"
        before, after = rendered.split(_MARK)
        self.head_text = before + instruction
        self.tail_text = after
        self.head_ids = self._encode(self.head_text)
        self.head_hash = token_ids_sha256(self.head_ids)
        # What chunk KV is computed after (and keyed by): the head, then ``preamble``'s
        # passages laid out as the prompt lays out chunks (numbered: "[1]" ... and the next
        # number, where the stored chunk goes). Without a preamble, the head itself.
        self.storage_ids = list(self.head_ids)
        if preamble:
            passages = [self.chunk_ids(text) for text in preamble]
            if numbered:
                passages = [*self.numbered(passages), self.passage_marker(len(passages) + 1)]
            self.storage_ids += [i for ids in passages for i in ids]
        self.storage_hash = token_ids_sha256(self.storage_ids)

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, system_prompt: str = SYSTEM_PROMPT, preamble: bool | None = None
    ) -> PromptFormat:
        """The product's prompt. Chunks are stored as their bare text's ids (documents keep
        exactly those), so the blank line goes before the question instead. ``preamble``:
        chunk KV computed after the shipped retrieval preamble (``storage_ids``); None reads
        ``KV_PREAMBLE`` (every process that computes or looks up chunk KV must agree)."""
        if preamble is None:
            preamble = preamble_from_env()
        return cls(
            tokenizer,
            system_prompt,
            instruction=SOURCES_INTRO,
            question_prefix="\n\nQuestion: ",
            chunk_separator="",
            preamble=preamble_passages() if preamble else (),
            numbered=True,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chunk_ids(self, text: str) -> list[int]:
        """A chunk's token ids: tokenized on its own, the same way at precompute and query."""
        return self._encode(text + self.chunk_separator)

    def question_ids(self, question: str, history: Sequence[tuple[str, str]] = ()) -> list[int]:
        """``history`` is (role, content) pairs, oldest first, put before the question."""
        earlier = ""
        if history:
            turns = [
                f"{'User' if role == 'user' else 'Assistant'}: {text}" for role, text in history
            ]
            earlier = "\n\nEarlier in this conversation:\n" + "\n".join(turns)
        return self._encode(earlier + self.question_prefix + question + self.tail_text)

    def passage_marker(self, number: int) -> list[int]:
        """``[n]`` and a new line before passage n (and a blank line before it, from the
        second on): the model cites passages by these numbers. A marker is a segment of its
        own, so chunks keep their cached KV whatever their rank; it tokenizes as it would
        inside the whole text (``[n]\\n`` rather than ``[n] ``, whose space BPE would merge
        into the chunk's first word)."""
        return self._encode(("" if number == 1 else "\n\n") + f"[{number}]\n")

    def numbered(self, chunk_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """The prompt's segments between head and question: ``[1] chunk 1 [2] chunk 2 ...``."""
        segments: list[list[int]] = []
        for number, ids in enumerate(chunk_ids, start=1):
            segments += [self.passage_marker(number), list(ids)]
        return segments

    def build(self, chunk_texts: Sequence[str], question: str) -> Prompt:
        return Prompt(
            list(self.head_ids),
            [self.chunk_ids(t) for t in chunk_texts],
            self.question_ids(question),
        )


PREAMBLE_FILE = Path(__file__).parents[1] / "kv_preamble.json"  # kvservice/kv_preamble.json


def preamble_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``KV_PREAMBLE`` (in ``env``, else the process environment; its default and why in
    ``kvservice.protocol.environment``): ``on`` computes chunk KV after the shipped retrieval
    preamble (``PromptFormat.storage_ids``), ``off`` after the prompt head alone. It is part of
    every chunk key: changing it makes the stored chunks misses, computed again at use."""
    return environment.read("KV_PREAMBLE", env) == "on"


@functools.cache
def preamble_passages() -> tuple[str, ...]:
    """The shipped preamble's passages (``kv_preamble.json``: two encyclopedia paragraphs
    that no evaluation prompt contains)."""
    return tuple(p["text"] for p in json.loads(PREAMBLE_FILE.read_text())["passages"])


def _bos_text(tokenizer: Any) -> str:
    """The BOS token's text where the tokenizer starts every text with it (the model was
    trained so: Gemma's base models read a prompt without it badly), else nothing. A chat
    template writes its own."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return ""
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token if ids and ids[0] == bos_id else ""


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The chat template applied, up to the assistant's turn. A template that refuses a
    system turn gets the system prompt at the start of the user's instead."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # jinja raises its own errors (raise_exception in the template)
        if messages[0]["role"] != "system":
            raise
        system, user = messages
        merged = [{"role": "user", "content": system["content"] + "\n\n" + user["content"]}]
        return tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)


def stop_token_ids(tokenizer: Any, checkpoint: str | Path | None = None) -> set[int]:
    """The token ids that end an answer, as the checkpoint says: its tokenizer's end of
    sequence and every ``eos_token_id`` of its ``generation_config.json`` (an id or a list:
    Llama 3's ``<|eot_id|>``, Gemma 3's ``<end_of_turn>``, Phi-3's ``<|end|>``).
    ``checkpoint``: the directory; by default the one the tokenizer was loaded from."""
    ids = {tokenizer.eos_token_id} - {None}
    directory = Path(checkpoint if checkpoint is not None else tokenizer.name_or_path)
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return ids


def chunk_token_ids(tokenizer: Any, text: str) -> list[int]:
    """The product's chunk ids (``PromptFormat.for_tokenizer``: the bare text, no separator),
    for ingest code that has a tokenizer but no prompt format at hand."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
