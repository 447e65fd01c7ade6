"""How tokens are chosen and turned into text, the same for every engine: vLLM's sampling
parameters and penalties, incremental detokenization and stop strings."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's end-of-turn tokens
    # vLLM's SamplingParams, same names and meaning (``apply_penalties``); 1.0 / 0.0: off.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # The answer ends before the first of these strings, which is not part of it.
    stop: tuple[str, ...] = ()

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    *,
    repetition_penalty: float,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
) -> torch.Tensor:
    """vLLM's penalties (``vllm.model_executor.layers.utils.apply_penalties``), so that both
    engines decode alike: a token seen in the prompt or the output has its logit divided by
    ``repetition_penalty`` (multiplied when negative); then OpenAI's frequency and presence
    penalties are subtracted for tokens of the output. ``logits`` ``[B, V]``,
    ``prompt_mask`` ``[B, V]`` bool, ``output_counts`` ``[B, V]``; returns new logits."""
    seen = prompt_mask | (output_counts > 0)
    penalties = torch.where(seen, repetition_penalty, 1.0)
    logits = torch.where(logits > 0, logits / penalties, logits * penalties)
    logits = logits - frequency_penalty * output_counts
    return logits - presence_penalty * (output_counts > 0).to(logits.dtype)


class TokenHistory:
    """What the penalties of one sequence read: the prompt's tokens and how often each
    token has been generated so far (built at the first step, when the vocabulary is known)."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self._prompt_mask: torch.Tensor | None = None  # [1, V]
        self._output_counts: torch.Tensor | None = None  # [1, V]
        self._pending: list[int] = []

    def observe(self, token_id: int) -> None:
        self._pending.append(token_id)

    def apply(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        if self._prompt_mask is None:
            vocab = logits.shape[-1]
            self._prompt_mask = torch.zeros(1, vocab, dtype=torch.bool, device=logits.device)
            ids = [i for i in self.prompt_ids if 0 <= i < vocab]
            self._prompt_mask[0, ids] = True
            self._output_counts = torch.zeros(1, vocab, dtype=torch.float32, device=logits.device)
        assert self._output_counts is not None
        for token in self._pending:
            self._output_counts[0, token] += 1
        self._pending.clear()
        return apply_penalties(
            logits.float(),
            self._prompt_mask,
            self._output_counts,
            repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
        )


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: TokenHistory | None = None,
) -> torch.Tensor:
    """Next token ids ``[B]`` from logits ``[B, V]``: the penalties (with a ``history``),
    then argmax, or temperature + top-p."""
    if history is not None and params.penalized:
        logits = history.apply(logits, params)
    if params.temperature <= 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class Detokenizer:
    """Incremental text deltas; holds back an unfinished multi-byte character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.emitted = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta


class StopStrings:
    """Stop strings over streamed text, as vLLM applies ``SamplingParams.stop``: text is
    handed on once it cannot be the start of a stop string; at the first stop string the
    answer ends, the string itself not included."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """The text that can be shown now (``stopped`` is set once a stop string is seen)."""
        if not self.stops or self.stopped:
            return "" if self.stopped else delta
        text = self.pending + delta
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.stopped, self.pending = True, ""
            return text[: min(found)]
        held = max((_overlap(text, stop) for stop in self.stops), default=0)
        self.pending = text[len(text) - held :]
        return text[: len(text) - held]

    def flush(self) -> str:
        """What was held back, at the end of an answer that did not stop on a string."""
        rest, self.pending = self.pending, ""
        return rest


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``stop``."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0


def new_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


REPEAT_WORDS = 6  # a run of this many words said a second time ends the answer
REPEAT_LINES = 3  # a line said this many times ends the answer before it
_ANSWER_WORD = re.compile(r"\w+", re.UNICODE)
_LINE = re.compile(r"[^\n]*\n")
_SENTENCE_END = re.compile(r"[.!?](?=[\s\"'”’)\]]|$)")


def starts_word(before: str, delta: str) -> bool:
    """Whether ``delta``, written after text ending in ``before`` ('' at the start), begins a
    word: the moment ``AnswerText``, which shows text a whole word at a time, shows more."""
    return re.search(r"\W\w", (before[-1:] or " ") + delta) is not None


class AnswerText:
    """What of an answer's streamed text is shown, and when, the same for every engine.

    - Repetition is suppressed: the answer ends before a run of ``REPEAT_WORDS`` words it has
      already said, or a sentence (three words or more) it has already said, or a line it
      has said twice (``REPEAT_LINES``: a short line, "Yes" or "12:30", is below the other
      two). Greedy answers of the bundled SmolLM2 repeated a sentence up to the token cap even
      with the frequency penalty (issue #36: "... the Gannet and the Sk [3]" after the same
      sentence twice). It ends at the start of the repeat's line where only a list marker
      ("- ", "2. ") comes before it there, not after a dangling "-".
    - An answer cut at the token cap ends at a sentence end within its last words, or else at
      the last whole word followed by "…", never inside a word.

    The last ``REPEAT_WORDS`` words are held back while the answer is written, so what was
    shown is never taken back: a reader of the stream sees the final text."""

    def __init__(self, repeat_words: int = REPEAT_WORDS) -> None:
        self.repeat_words = repeat_words
        self.text = ""  # the answer so far, as it will stand
        self.shown = 0  # characters of ``text`` handed on
        self.repeated = False  # ended before a repeat: nothing more is taken

    def push(self, delta: str) -> str:
        """The text that can be shown now."""
        if self.repeated:
            return ""
        self.text += delta
        repeat_at = self._repeat_start()
        if repeat_at is not None:
            self.repeated = True
            self.text = self.text[: max(repeat_at, self.shown)].rstrip()
            return self._hand_on(len(self.text))
        words = list(_ANSWER_WORD.finditer(self.text))
        # Held: the last words and the space before them (an answer may end before them).
        held_from = words[-self.repeat_words - 1].end() if len(words) > self.repeat_words else 0
        return self._hand_on(max(held_from, self.shown))

    def finish(self, *, cut: bool) -> str:
        """What was held back, at the end of the answer; ``cut``: it stopped at the token cap."""
        if cut and not self.repeated:
            self.text = _cut_cleanly(self.text, self.shown)
        return self._hand_on(len(self.text))

    def _hand_on(self, end: int) -> str:
        piece, self.shown = self.text[self.shown : end], max(end, self.shown)
        return piece

    def _repeat_start(self) -> int | None:
        """Where a repeat begins in ``text``, once it is complete; None while there is none."""
        words = list(_ANSWER_WORD.finditer(self.text))
        if words and words[-1].end() == len(self.text):
            words.pop()  # the word being written
        lowered = [word.group().lower() for word in words]
        size = self.repeat_words
        if len(lowered) > size:
            last, first = lowered[-size:], len(lowered) - size
            earlier = next((at for at in range(first) if lowered[at : at + size] == last), None)
            if earlier is not None:
                # back to where the repeat begins: the run found may start mid-sentence
                while earlier > 0 and lowered[earlier - 1] == lowered[first - 1]:
                    earlier, first = earlier - 1, first - 1
                return _with_its_marker(self.text, words[first].start())
        sentences = _sentence_words(self.text, words)
        if len(sentences) > 1 and len(sentences[-1][1]) >= 3:
            start, said = sentences[-1]
            if any(said == earlier for _, earlier in sentences[:-1]):
                return _with_its_marker(self.text, start)
        lines = [
            (line.start(), _ANSWER_WORD.findall(line.group().lower()))
            for line in _LINE.finditer(self.text)
        ]
        lines = [(start, said) for start, said in lines if said]
        if lines:
            start, said = lines[-1]
            if sum(said == earlier for _, earlier in lines[:-1]) >= REPEAT_LINES - 1:
                return start
        return None


def _with_its_marker(text: str, at: int) -> int:
    """``at``, or the start of its line where no word comes before it there (a list marker)."""
    line_start = text.rfind("\n", 0, at) + 1
    return at if _ANSWER_WORD.search(text, line_start, at) else line_start


def _sentence_words(text: str, words: list[re.Match]) -> list[tuple[int, list[str]]]:
    """The finished sentences of ``text``: (where each begins, its words in lower case)."""
    sentences: list[tuple[int, list[str]]] = []
    start = 0
    for end in _SENTENCE_END.finditer(text):
        inside = [w for w in words if start <= w.start() < end.start()]
        if inside:
            sentences.append((inside[0].start(), [w.group().lower() for w in inside]))
        start = end.end()
    return sentences


def _cut_cleanly(text: str, shown: int) -> str:
    """``text`` cut at the token cap: without the word being written, ending at the last
    sentence end not yet shown, or else at the last whole word followed by "…"."""
    words = list(_ANSWER_WORD.finditer(text))
    if words and words[-1].end() == len(text) and words[-1].start() >= shown:
        text = text[: words[-1].start()]  # the word the cap cut (or may have cut)
    ends = [m.end() for m in _SENTENCE_END.finditer(text) if m.end() > shown]
    if ends:
        return text[: ends[-1]]
    text = text.rstrip()
    kept = text.rstrip(" ,;:-–—([")
    return (kept if len(kept) >= shown else text) + "…"
