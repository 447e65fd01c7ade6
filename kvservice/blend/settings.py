"""How blend selects what it recomputes and reads what it does not: ``BlendSettings`` and the
measurement behind each default (``kvservice.blend.prefill`` is the driver that reads them)."""

from __future__ import annotations

from dataclasses import dataclass

# Selection defaults, chosen on Musique dev examples 0-19 only and reported on 20-39 (SmolLM2,
# 6 passages, ratio 0.15, teacher-forced KL of 16 answer tokens to full; docs/blend.md).
# Validation 20-39: KL mean 0.037 (median 0.027, p90 0.078) against reuse's 0.121; worse than
# reuse on 0 of 20; top-1 agreement 0.936 against 0.907. CacheBlend's HKVD selection (the
# previous default) gave 0.044 on the tuning examples where this gives 0.033 (reuse 0.101).
# Tuning 0-19, mean KL by the first layer the attention is read from: 0 -> 0.0349,
# 1/3 -> 0.0333, 1/2 -> 0.0344, 2/3 -> 0.0350.
ATTENTION_FROM_DEPTH = 1 / 3
# Smoothing the importance over neighbours (CacheClip) did not help once selection reads the
# question's attention: tuning KL 0.035 unsmoothed, 0.038 over 5 tokens, 0.044 over 11.
SMOOTH_WINDOW = 1
# The cached chunk keys blend does not recompute are read at an attention temperature of
# 1/0.9 (their keys scaled by 0.9 as they are placed; APE's temperature, issue #32): stale
# KV, computed without the other chunks, draws too sharp an attention. Tuning 0-9 at ratio
# 0.10 (auto precision): KL 0.036 against 0.043, better on 7 of 10; a logit bias of -0.5 on
# the same keys gave 0.042, the opposite corrections (x1.1, +0.5) +65 %. Validation 20-39:
# 0.10 KL 0.042 against 0.045, top-1 agreement 0.964 against 0.929 (better KL on 9 of 20);
# 0.15 0.035 against 0.037; 0.05 0.060 against 0.059 (docs/blend.md). Reuse reads the KV as
# stored (through the temperature it was worse). With chunks stored after the retrieval
# preamble (KV_PREAMBLE=on) the stale KV is less sharp and 0.95 fits it on Musique: tuning
# 1-19 at 0.10 0.0420 against 0.9's 0.0459 (better on 14 of 19); validation 20-39 0.05 / 0.10
# / 0.15: 0.042 / 0.034 / 0.029 against 0.050 / 0.039 / 0.034. Not the default: the product's
# handbook test answered 3 of its questions ungrounded with both (docs/blend.md).
STALE_KEY_SCALE = 0.9
# The temperature applies in full to a cached chunk after this many cached chunk tokens, in
# part before (``stale_reading``); 0: in full to every stale chunk. On the handbook's short
# prompts (1-3 passages) the full temperature made blend worse than reuse on 8 of 14
# questions (bench.doc_fidelity). Tuning 0-19 at 0.10: 0 0.0444, 600 0.0450, 1200 0.0437,
# 2400 0.0424; validation 20-39 at 0.05 / 0.10 / 0.15: 0.0506 / 0.0385 / 0.0323 against
# 0.0525 / 0.0412 / 0.0346 (better on 15 / 14 / 15 of 20) (docs/blend.md).
STALE_RAMP_TOKENS = 2400
# Selection reads the layers up to this depth, and the reuse pass stops there. Tuning 0-19 at
# 0.15 (auto precision): to 30 of 30 layers 0.0361, 25 0.0367, 20 0.0377, 15 0.0426; the
# question's deep layers are worth their cost in memory (docs/blend.md).
ATTENTION_TO_DEPTH = 1.0
# What a cached chunk lacks from the context before it moves all its tokens' KV alike in good
# part: per chunk, layer and KV head, the mean over tokens of the true KV's difference from
# the stored KV holds ~35 % of K's difference and ~14 % of V's (tuning examples 0-3). The
# recompute pass measures that mean on the chunk's recomputed tokens (fresh minus stored,
# K before RoPE), drawn towards the mean over every chunk's recomputed tokens by 16 tokens'
# worth of it, and moves the chunk's other tokens by it, layer by layer, in proportion to the
# cached chunk tokens before it up to 1,200; their keys are then read at no temperature
# (``shift_stale``). Tuning 0-19 against no shift: 0.10 KL 0.0424 -> 0.0189, 0.05 0.0532 ->
# 0.0257. Each chunk on its own mean: 0.0199 / 0.0317, and on as few as 1 token 4 of 20
# prompts at 0.05 got worse, one 3.6x; all chunks' mean alone 0.0203 / 0.0277; unramped
# 0.0193 / 0.0271, but on the handbook's short prompts worse than before on 10 of 14 (0.0254
# -> 0.0498 at 0.10); ramped over 1,200 tokens there 0.0239, over 2,400 0.0258 (docs/blend.md).
# Off by default: on examples no shift setting was chosen on it fails now and then, and
# badly. Musique-as-a-library validation 20-39 (bench.doc_fidelity --musique): 0.10 0.0609 ->
# 0.0695 (better on 14, worse on 6; p90 0.101 -> 0.074), because one prompt went 0.200 ->
# 0.557, worse than reuse (0.241); Musique validation 20-39 at 0.05: 0.0506 -> 0.0720, one
# prompt 0.051 -> 0.743 (at 0.10 0.0385 -> 0.0294, better on 15, worse on 5). Where it fails
# (library tuning example 1: 0.129 -> 0.350) the moved KV and the attention are closer to
# full's, and the answer turns at a near tie later on: no guard on the estimate sees that
# (docs/blend.md, 2026-11-26). ``--blend stale_shift=1.0`` turns it on.
STALE_SHIFT = 0.0
STALE_SHIFT_MIN_TOKENS = 1
STALE_SHIFT_POOL = 16
STALE_SHIFT_RAMP_TOKENS = 1200
# Gemma 3's sliding-window layers (15 of 18 in the 270M, each reading the last 512 tokens)
# give the question's attention only to the last window of the context, so they draw the
# selection there: at 0.15 on Musique 72-79 % of the selected tokens lie in the last 512
# before the question, which hold 18-19 % of the candidates. Left out of the selection
# (weight 0: the global layers alone, 21-23 % there) blend got worse on tuning examples 0-4:
# KL 0.0284 against 0.0139, worse on 4 of 5. The last window is what 15 of 18 layers of the
# question read, so recomputing most of it is right (docs/blend.md, "Gemma 3", 2026-11-27).
LOCAL_LAYER_WEIGHT = 1.0


@dataclass(frozen=True)
class BlendSettings:
    """How blend selects what it recomputes (defaults chosen and reported as above); the
    bench's ``--blend NAME=VALUE`` sets them to compare selections on the same prompts."""

    attention_from_depth: float = ATTENTION_FROM_DEPTH  # ``attention_importance``
    # ... and the layer it stops at: the reuse pass ends there, and the recompute pass places
    # the deeper layers' cached KV as it reaches them (``kvservice.blend.prefill``).
    attention_to_depth: float = ATTENTION_TO_DEPTH
    smooth_window: int = SMOOTH_WINDOW  # ``smooth_scores``
    rounds: int = 1  # selection rounds: each later one selects by the attention after the last
    first_round_share: float = 0.5  # of the budget, with rounds > 1
    chunk_starts: int = 0  # the first tokens of every cached chunk always recomputed (EPIC)
    stale_bias: float = 0.0  # added to the attention logits of stale keys (APE), ramped alike
    stale_key_scale: float = STALE_KEY_SCALE  # stale cached keys scaled: a temperature (APE)
    stale_ramp_tokens: int = STALE_RAMP_TOKENS  # ... in full only after that many cached tokens
    # each stale chunk's KV moved by this share of the mean difference between fresh and
    # stored KV over its recomputed tokens (``shift_stale``); 0: off
    stale_shift: float = STALE_SHIFT
    stale_shift_min_tokens: int = STALE_SHIFT_MIN_TOKENS  # a chunk with fewer is not moved
    stale_shift_pool: int = STALE_SHIFT_POOL  # each chunk's estimate drawn to all chunks' mean
    stale_shift_ramp_tokens: int = STALE_SHIFT_RAMP_TOKENS  # ... in full after that many
    # how much the question's attention in a sliding-window layer (Gemma 3's local layers)
    # counts in selection against a global layer's (``local_layer_weights``); 1: alike
    local_layer_weight: float = LOCAL_LAYER_WEIGHT
