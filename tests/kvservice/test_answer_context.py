"""What the worker puts in the prompt: history within its token cap, numbered passages
counted in the context budget."""

from __future__ import annotations

from kvservice.blend.planning import HISTORY_MAX_TOKENS, fit_context
from kvservice.protocol import ChunkRef, GenerateRequest, Turn
from kvservice.protocol.prompt import PromptFormat


def test_history_is_capped_in_tokens_keeping_the_newest_turns(smollm2_tokenizer) -> None:
    prompt = PromptFormat.for_tokenizer(smollm2_tokenizer)
    history = [
        Turn("user", f"Question number {i} about the leave policy, asked at length?")
        for i in range(40)
    ]
    request = GenerateRequest(
        request_id="r", question="And sick leave?", chunks=[], history=history, max_new_tokens=160
    )
    suffix = fit_context(prompt, 2048, request).suffix_ids
    bare = prompt.question_ids("And sick leave?")
    assert 0 < len(suffix) - len(bare) <= HISTORY_MAX_TOKENS
    text = smollm2_tokenizer.decode(suffix)
    assert "Question number 39" in text and "Question number 0 " not in text


def test_a_passage_counts_with_its_number_marker_in_the_context_budget(
    smollm2_tokenizer,
) -> None:
    prompt = PromptFormat.for_tokenizer(smollm2_tokenizer)
    fixed = len(prompt.head_ids) + len(prompt.question_ids("Why?")) + 10  # 10: the answer
    chunk = ChunkRef(chunk_id=1, token_ids=list(range(100, 400)))
    numbered = sum(map(len, prompt.numbered([chunk.token_ids])))
    assert numbered > len(chunk.token_ids)  # "[1]" and a new line

    def kept(context_len: int) -> list[int]:
        request = GenerateRequest(
            request_id="r", question="Why?", max_new_tokens=10, chunks=[chunk]
        )
        return fit_context(prompt, context_len, request).chunk_ids

    assert kept(fixed + numbered) == [1]
    assert kept(fixed + numbered - 1) == []  # room for the passage, not for its marker
