from __future__ import annotations

import threading

import pytest
import torch

from kvservice.model.sampling import SamplingParams
from kvservice.protocol.prompt import PromptFormat
from kvservice.serve.engine import Engine, Request
from kvservice.store.compute_threads import run_in_passing_thread, single_threaded


@pytest.fixture
def restore_threads():
    count = torch.get_num_threads()
    yield count
    torch.set_num_threads(count)  # threads started later take this count again


def test_a_passing_thread_gives_back_its_result_or_its_error_and_is_gone():
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert run_in_passing_thread(work) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="missing"):
        run_in_passing_thread(lambda: {}["missing"])


def test_single_threaded_holds_for_this_thread_and_threads_started_after(restore_threads):
    single_threaded()
    assert torch.get_num_threads() == 1
    assert run_in_passing_thread(torch.get_num_threads) == 1


def test_the_batcher_thread_computes_with_the_engines_count_whatever_the_callers(
    smollm2, smollm2_tokenizer, restore_threads
):
    torch.set_num_threads(2)  # whatever the cores: two threads are told apart from one
    engine = Engine(smollm2, smollm2_tokenizer, PromptFormat(smollm2_tokenizer))
    assert engine.batcher.threads == 2  # the building thread's count
    single_threaded()  # as the worker's main thread is after loading
    seen: list[tuple[str, int]] = []
    prompt = engine.format.build(["Paris is in France."], "Where is Paris?")
    request = Request(prompt, [None], sampling=SamplingParams(max_tokens=1))
    try:
        events = engine.stream(
            request,
            on_prefill=lambda *_: seen.append(
                (threading.current_thread().name, torch.get_num_threads())
            ),
        )
        tokens = [e for e in events if e.token_id >= 0]  # then the finishing event
        assert len(tokens) == 1
    finally:
        engine.close()
    assert seen == [("batcher", 2)]
    assert torch.get_num_threads() == 1
