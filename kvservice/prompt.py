"""The product's prompt, as token ids: ``[head][chunk 1]…[chunk n][suffix]``.

- The head (chat-template opening, system prompt, the user turn's opening) is the same for
  every question of a deployment. Chunks are precomputed *after* it, and its hash is part of
  every chunk's cache key, so changing the system prompt never serves stale KV.
- Each chunk is its stored token ids (the chunk's text tokenized on its own, without special
  tokens), exactly as at precompute time.
- The suffix carries the recent conversation, the question and the assistant turn's opening;
  it is always computed fresh.

The chat template comes from the model's own tokenizer, so any Llama/Mistral/Qwen2 checkpoint
gets its own format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvservice.chunk import token_ids_sha256

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using only the sources in the user's "
    "message. Answer briefly. If the sources do not contain the answer, say so."
)
SOURCES_INTRO = "Sources:\n\n"
_MARK = "\u2063RAGBLEND_USER_CONTENT\u2063"


@dataclass(frozen=True)
class PromptFormat:
    head_ids: tuple[int, ...]
    head_text: str
    suffix_template: str  # text after the user's content: end of turn + assistant opening

    @property
    def head_hash(self) -> str:
        return token_ids_sha256(self.head_ids)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, system_prompt: str = SYSTEM_PROMPT) -> PromptFormat:
        messages = [{"role": "user", "content": _MARK}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:  # a base model: plain text turns
            rendered = f"{system_prompt}\n\nUser: {_MARK}\nAssistant:"
        before, after = rendered.split(_MARK)
        head_text = before + SOURCES_INTRO
        head_ids = tuple(tokenizer(head_text, add_special_tokens=False)["input_ids"])
        return cls(head_ids=head_ids, head_text=head_text, suffix_template=after)

    def suffix_text(self, question: str, history: Sequence[tuple[str, str]] = ()) -> str:
        """``history`` is (role, content) pairs, oldest first."""
        lines = ["", ""]
        if history:
            lines.append("Earlier in this conversation:")
            lines += [f"{'User' if role == 'user' else 'Assistant'}: {text}" for role, text in history]
            lines.append("")
        lines.append(f"Question: {question}")
        return "\n".join(lines) + self.suffix_template

    def suffix_ids(
        self, tokenizer: Any, question: str, history: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        return list(
            tokenizer(self.suffix_text(question, history), add_special_tokens=False)["input_ids"]
        )


def chunk_token_ids(tokenizer: Any, text: str) -> list[int]:
    """A chunk's ids: its text tokenized on its own, the same at ingest and at query time."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
