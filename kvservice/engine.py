"""Requests -> blended prefill -> decode: sampling, stop tokens, streaming, batched decode.

Prompt format (the same at precompute and at query time, so cached tokens are exactly the
prompt's tokens): ``[head][chunk 1]...[chunk n][question + assistant opening]``, each part
tokenized on its own and the ids concatenated. The head is the chat template's opening with
the deployment's system prompt and instruction: fixed per deployment, so chunks are
precomputed after it (``Engine.precompute``) and its hash goes into their keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvservice.blend import BlendResult, Mode, blend_prefill
from kvservice.chunk import ChunkKV, LayeredKV
from kvservice.model import KVCache, Transformer, precompute_chunks, precompute_head
from kvservice.prompt import Prompt, PromptFormat

# --------------------------------------------------------------------------------------------
# Sampling


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
            logits.float(), self._prompt_mask, self._output_counts,
            repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
        )  # fmt: skip


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


# --------------------------------------------------------------------------------------------
# Requests and results


@dataclass
class Request:
    prompt: Prompt
    chunks: list[LayeredKV]  # cached KV of prompt.chunk_ids, same order
    mode: Mode = "blend"
    recompute_ratio: float = 0.15
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the text this token adds (may be "" while a multi-byte character is open)
    index: int
    ttft_s: float | None = None  # on the first event only
    finish_reason: str | None = None  # "stop" or "length" on the last event


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    ttft_s: float
    finish_reason: str
    prefill: BlendResult | None = None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Detokenizer:
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


# --------------------------------------------------------------------------------------------
# The engine


class Engine:
    def __init__(self, model: Transformer, tokenizer, prompt_format: PromptFormat | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.format = prompt_format or PromptFormat(tokenizer)
        self.device = model.device
        self._head_kv: ChunkKV | None = None
        self.stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for token in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>"):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                self.stop_ids.add(token_id)

    @property
    def head_kv(self) -> ChunkKV:
        """The prompt head's KV, computed once (it is the same for every request)."""
        if self._head_kv is None:
            self._head_kv = precompute_head(self.model, self.format.head_ids)
        return self._head_kv

    def precompute(self, chunk_ids: Sequence[Sequence[int]]) -> list[ChunkKV]:
        return precompute_chunks(self.model, self.format.head_ids, chunk_ids)

    def prefill(self, request: Request, extra_capacity: int = 0) -> BlendResult:
        prompt = request.prompt
        return blend_prefill(
            self.model,
            prompt.head_ids,
            request.chunks,
            prompt.question_ids,
            mode=request.mode,
            recompute_ratio=request.recompute_ratio,
            chunk_ids=prompt.chunk_ids,
            head_kv=self.head_kv if prompt.head_ids == self.format.head_ids else None,
            extra_capacity=extra_capacity,
        )

    @torch.no_grad()
    def stream(self, request: Request) -> Iterator[TokenEvent]:
        """Tokens of one request as they are produced; TTFT is taken at the first token."""
        start = time.perf_counter()
        params = request.sampling
        generator = _generator(params.seed, self.device)
        stop = self.stop_ids | set(params.stop_token_ids)
        history = TokenHistory(request.prompt.token_ids)
        stop_strings = StopStrings(params.stop)
        result = self.prefill(request, extra_capacity=params.max_tokens)
        cache, position, logits = result.cache, result.num_tokens, result.logits[None]
        detok = _Detokenizer(self.tokenizer)
        for index in range(params.max_tokens):
            token = int(sample_next(logits, params, generator, history)[0])
            history.observe(token)
            ttft = None
            if index == 0:
                _synchronize(self.device)
                ttft = time.perf_counter() - start
            text = "" if token in stop else stop_strings.push(detok.push(token))
            finish = None
            if token in stop or stop_strings.stopped:
                finish = "stop"
            elif index + 1 == params.max_tokens:
                finish, text = "length", text + stop_strings.flush()
            yield TokenEvent(token, text, index, ttft, finish)
            if finish:
                return
            logits, _ = self.model(
                torch.tensor([[token]], device=self.device),
                torch.tensor([[position]], device=self.device),
                cache,
            )
            position += 1

    def generate(self, request: Request) -> Completion:
        events = list(self.stream(request))
        ids = [
            e.token_id
            for e in events
            if e.token_id not in self.stop_ids | set(request.sampling.stop_token_ids)
        ]
        return Completion(
            token_ids=ids,
            text="".join(e.text for e in events),
            ttft_s=events[0].ttft_s or 0.0,
            finish_reason=events[-1].finish_reason or "length",
        )

    @torch.no_grad()
    def generate_batch(self, requests: Sequence[Request]) -> list[Completion]:
        """Prefill each request (blending is per prompt), then decode them together: the
        caches are padded to one length and padding slots are masked out."""
        start = time.perf_counter()
        if not requests:
            return []
        max_new = max(r.sampling.max_tokens for r in requests)
        prefills = [self.prefill(r) for r in requests]
        batch = len(requests)
        longest = max(p.num_tokens for p in prefills)
        config = self.model.config
        cache = KVCache(config, batch, longest + max_new, self.device, prefills[0].cache.k.dtype)
        for row, p in enumerate(prefills):
            n = p.num_tokens
            cache.k[:, row, :, :n] = p.cache.k[:, 0, :, :n]
            cache.v[:, row, :, :n] = p.cache.v[:, 0, :, :n]
            cache.positions[row, :n] = p.cache.positions[0, :n]
            cache.valid[row, :n] = True
        cache.length = longest
        positions = torch.tensor([p.num_tokens for p in prefills], device=self.device)  # [B]
        logits = torch.stack([p.logits for p in prefills])  # [B, V]
        generators = [_generator(r.sampling.seed, self.device) for r in requests]
        stops = [self.stop_ids | set(r.sampling.stop_token_ids) for r in requests]
        histories = [TokenHistory(r.prompt.token_ids) for r in requests]
        texts = [StopStrings(r.sampling.stop) for r in requests]
        detoks = [_Detokenizer(self.tokenizer) for _ in requests]
        outputs: list[list[int]] = [[] for _ in requests]
        answers = [""] * batch
        finish: list[str | None] = [None] * batch
        ttft = [0.0] * batch
        for step in range(max_new):
            tokens = torch.stack(
                [
                    sample_next(logits[row : row + 1], r.sampling, generators[row], histories[row])[
                        0
                    ]
                    for row, r in enumerate(requests)
                ]
            )  # [B]
            if step == 0:
                _synchronize(self.device)
                ttft = [time.perf_counter() - start] * batch
            for row, r in enumerate(requests):
                if finish[row] is not None:
                    continue
                token = int(tokens[row])
                if token in stops[row]:
                    finish[row] = "stop"
                    continue
                outputs[row].append(token)
                histories[row].observe(token)
                answers[row] += texts[row].push(detoks[row].push(token))
                if texts[row].stopped:
                    finish[row] = "stop"
                elif len(outputs[row]) >= r.sampling.max_tokens:
                    finish[row], answers[row] = "length", answers[row] + texts[row].flush()
            if all(f is not None for f in finish):
                break
            # Finished rows keep stepping (their outputs are ignored): one shape for the batch.
            logits, _ = self.model(tokens[:, None], positions[:, None], cache)
            positions = positions + 1
        return [
            Completion(
                token_ids=ids,
                text=answers[row],
                ttft_s=ttft[row],
                finish_reason=finish[row] or "length",
                prefill=prefills[row],
            )
            for row, ids in enumerate(outputs)
        ]


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
