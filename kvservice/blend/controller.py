"""Loading controller (CacheBlend section 5): pick the recompute ratio and the storage tier
from measurements, so that loading the cached KV stays hidden behind selective recompute.

For a request whose cached chunks hold ``N`` tokens over ``L`` layers:

- recompute time at ratio r: ``r * N * L / recompute_throughput`` (token-layers per second,
  measured by the engine);
- load time: for each tier serving chunks, ``bytes / read_bandwidth`` (tiers load in
  parallel, so the request waits for the slowest);
- the break-even ratio ``r_eq = load_s / full_recompute_s`` makes recompute exactly as long
  as the load. Recomputing more tokens than ``r_min`` costs nothing while the load is the
  bottleneck anyway, so ``r = clamp(max(r_min, r_eq), 0, 1)``. (A ratio the admin fixes on
  the dashboard comes with the request and does not reach the controller.)
- the cheapest tier (S3 < disk < CPU memory < device) whose load time at the floor ratio
  (``r_min``, or the fidelity target's) is no longer than the recompute time keeps loading
  hidden.

Per chunk, load or recompute (the paper's loading controller; :func:`choose_loads`): a chunk
is either read (its KV arrives over its tier's link) or recomputed whole, like a cache miss.
Blend runs in two passes (``kvservice.blend.prefill``): the first computes the misses and the
question layer by layer as the read chunks' layers arrive, the second the selected tokens
of the read chunks and the question again, once everything is there. A request so takes
about ``max(load_s, first_pass_s) + second_pass_s``. On a link so slow that a chunk takes
longer to arrive than to recompute, recomputing some chunks instead shortens the request;
recomputing all of them is full prefill (no second pass). The plan with the least estimate is
chosen among "the ``n`` chunks slowest to load, relative to their recompute, are
recomputed" for every ``n``. Then, where loading is what the request waits on, the whole
request is weighed: unless that plan is estimated at least ``FULL_MARGIN`` (5 %) faster than
full prefill, full prefill runs, so a blend is never estimated slower than full, whatever the
link.

Estimates learn from what requests took (:meth:`LoadingController.observe_plan`): on a CPU
worker the reads, checksums and decoding take cores from compute while they overlap it, so
each read byte costs more than its link time. What the estimate missed, per read byte, is
priced into the next plans.

:func:`choose_ratio` and :func:`choose_loads` are the pure decisions;
:class:`LoadingController` keeps the running measurements (EWMA) and calls them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvservice.protocol.ratio import DEFAULT_RECOMPUTE_RATIO

TIER_COST_ORDER = ("s3", "disk", "cpu", "device")  # cheapest storage first


@dataclass(frozen=True)
class RatioDecision:
    recompute_ratio: float
    source: str  # "auto" (break-even), "r_min" or "target" (the floor, or no measurements)
    load_s_estimate: float | None
    recompute_s_estimate: float | None  # at the chosen ratio
    cheapest_hidden_tier: str | None  # None: no measured tier hides loading
    why: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_ratio(
    *,
    num_tokens: int,
    num_layers: int,
    load_bytes_by_tier: Mapping[str, int],
    tier_bandwidth: Mapping[str, float | None],
    recompute_token_layers_per_s: float | None,
    r_min: float = DEFAULT_RECOMPUTE_RATIO,
    target_ratio: float | None = None,
) -> RatioDecision:
    """The recompute ratio for one request, and the cheapest tier that would hide loading.

    ``load_bytes_by_tier``: bytes of layer KV each tier must deliver for this request;
    ``tier_bandwidth``: measured read bandwidth in bytes/s (None or absent: not measured).
    ``target_ratio``: the lowest ratio the measured curve says reaches the operator's
    fidelity target (``kvservice.protocol.curve.ratio_for_target``); it is the floor in ``r_min``'s
    place, which loading may raise (recomputing while the load runs is free) but not lower.
    """
    limits = (("r_min", r_min), ("target ratio", target_ratio))
    for name, value in limits:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    token_layers = num_tokens * num_layers
    throughput = recompute_token_layers_per_s if recompute_token_layers_per_s else None
    full_recompute_s = token_layers / throughput if throughput and token_layers else None
    load_by_tier, unmeasured = _load_seconds(load_bytes_by_tier, tier_bandwidth)
    load_s = max(load_by_tier.values(), default=0.0) if not unmeasured else None
    floor = _Floor(target_ratio, "target") if target_ratio is not None else _Floor(r_min, "r_min")
    why: dict[str, Any] = {
        "num_tokens": num_tokens,
        "num_layers": num_layers,
        "r_min": r_min,
        "target_ratio": target_ratio,
        "recompute_token_layers_per_s": throughput,
        "full_recompute_s": full_recompute_s,
        "load_s_by_tier": load_by_tier,
        "unmeasured_tiers": unmeasured,
    }
    break_even = load_s / full_recompute_s if load_s is not None and full_recompute_s else None
    why["break_even_ratio"] = break_even
    ratio, source, why["rule"] = _ratio_rule(
        floor, break_even, load_s, full_recompute_s, unmeasured
    )
    total_bytes = sum(max(0, b) for b in load_bytes_by_tier.values())
    hidden_tier = _cheapest_hidden_tier(
        floor.ratio, full_recompute_s, total_bytes, tier_bandwidth, why
    )
    recompute_s = ratio * full_recompute_s if full_recompute_s is not None else None
    return RatioDecision(
        recompute_ratio=min(1.0, max(0.0, ratio)),
        source=source,
        load_s_estimate=load_s,
        recompute_s_estimate=recompute_s,
        cheapest_hidden_tier=hidden_tier,
        why=why,
    )


@dataclass(frozen=True)
class _Floor:
    """The least ratio a request gets before loading is weighed: r_min, or the ratio of the
    operator's fidelity target (``source`` "target")."""

    ratio: float
    source: str

    @property
    def named(self) -> str:
        return "r_min" if self.source == "r_min" else "the fidelity target's ratio"


def _load_seconds(
    load_bytes_by_tier: Mapping[str, int], tier_bandwidth: Mapping[str, float | None]
) -> tuple[dict[str, float], list[str]]:
    """Seconds each tier takes to deliver its bytes, and the tiers with bytes to deliver whose
    bandwidth is not measured."""
    load_by_tier: dict[str, float] = {}
    unmeasured = []
    for tier, nbytes in load_bytes_by_tier.items():
        if nbytes <= 0:
            continue
        bandwidth = tier_bandwidth.get(tier)
        if bandwidth:
            load_by_tier[tier] = nbytes / bandwidth
        else:
            unmeasured.append(tier)
    return load_by_tier, unmeasured


def _ratio_rule(floor: _Floor, break_even, load_s, full_recompute_s, unmeasured):
    """(ratio, source, rule): the floor, raised to the break-even ratio where loading takes
    longer than recomputing the floor's share of the tokens."""
    if break_even is None:
        missing = (
            "recompute throughput" if full_recompute_s is None else f"bandwidth of {unmeasured}"
        )
        return floor.ratio, floor.source, f"no measurement of {missing} yet: {floor.named}"
    if break_even <= floor.ratio:
        rule = (
            f"loading ({load_s:.4f} s) hides behind recomputing {floor.named} of the tokens "
            f"({floor.ratio * full_recompute_s:.4f} s): r = {floor.named} ({floor.ratio:.3f})"
        )
        return floor.ratio, floor.source, rule
    if break_even < 1.0:
        rule = (
            f"loading takes {load_s:.4f} s; recomputing {break_even:.1%} of the tokens takes "
            "as long, so that extra recompute is free"
        )
        return break_even, "auto", rule
    rule = (
        f"loading ({load_s:.4f} s) is slower than recomputing every token "
        f"({full_recompute_s:.4f} s): full recompute"
    )
    return 1.0, "auto", rule


def _cheapest_hidden_tier(target, full_recompute_s, total_bytes, tier_bandwidth, why) -> str | None:
    """The cheapest tier whose load of ``total_bytes`` hides behind recomputing ``target``
    of the tokens; each measured tier's verdict goes into ``why``."""
    if full_recompute_s is None:
        return None
    budget_s = target * full_recompute_s
    why["hide_budget_s"] = budget_s
    verdicts, hidden_tier = {}, None
    for tier in TIER_COST_ORDER:
        bandwidth = tier_bandwidth.get(tier)
        if not bandwidth:
            continue
        tier_load_s = total_bytes / bandwidth
        verdicts[tier] = {"load_s": tier_load_s, "hidden": tier_load_s <= budget_s}
        if hidden_tier is None and tier_load_s <= budget_s:
            hidden_tier = tier
    why["tiers"] = verdicts
    return hidden_tier


@dataclass(frozen=True)
class ChunkLoad:
    """One cached chunk of a request: its tokens, its stored bytes, the tier serving it."""

    tokens: int
    nbytes: int
    tier: str


@dataclass(frozen=True)
class LoadPlan:
    load: tuple[bool, ...]  # per chunk: read its KV (True) or recompute it whole (False)
    load_s_estimate: float | None  # the read chunks' link time (tiers in parallel)
    compute_s_estimate: float | None  # both passes' compute
    total_s_estimate: float | None  # the loads overlapping the first pass, then the second
    full_s_estimate: float | None  # full prefill of the same prompt
    why: dict[str, Any] = field(default_factory=dict)
    read_bytes: int = 0  # the read chunks' stored bytes
    overhead_s: float = 0.0  # of the total: what reading those bytes takes from compute

    @property
    def recomputed(self) -> int:
        return self.load.count(False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"recomputed": self.recomputed}


FULL_MARGIN = 0.05  # blend runs only where estimated at least this much faster than full
OVERHEAD_SMOOTHING = 0.3  # observe_plan's EWMA weight of the newest request, at most


@dataclass(frozen=True)
class _Pricing:
    """What :func:`choose_loads` prices a plan by (its arguments, measured)."""

    chunks: Sequence[ChunkLoad]
    question_tokens: int
    num_layers: int
    tier_bandwidth: Mapping[str, float | None]
    throughput: float  # recompute token-layers per second
    recompute_ratio: float
    read_token_layer_s: float
    overhead_s_per_byte: float

    def load_s(self, chunk: ChunkLoad) -> float | None:
        bandwidth = self.tier_bandwidth.get(chunk.tier)
        return chunk.nbytes / bandwidth if bandwidth else None

    def compute_s(self, tokens: float) -> float:
        return tokens * self.num_layers / self.throughput

    def plan(self, load: Sequence[bool], why: dict[str, Any]) -> LoadPlan:
        """The estimate of reading the chunks marked in ``load`` and recomputing the rest:
        the loads overlap the first pass, then the second; each read byte also costs
        ``overhead_s_per_byte`` (the cores the reads take from compute on a CPU worker)."""
        link_s: dict[str, float] = {}
        first, second, read, nbytes = float(self.question_tokens), 0.0, 0, 0
        for chunk, loaded in zip(self.chunks, load, strict=True):
            if loaded:
                link_s[chunk.tier] = link_s.get(chunk.tier, 0.0) + (self.load_s(chunk) or 0.0)
                second += self.recompute_ratio * chunk.tokens
                read, nbytes = read + chunk.tokens, nbytes + chunk.nbytes
            else:
                first += chunk.tokens
        if any(load):  # the second pass recomputes the question again
            second += self.question_tokens
        load_s, first_s = max(link_s.values(), default=0.0), self.compute_s(first)
        second_s = self.compute_s(second) + read * self.num_layers * self.read_token_layer_s
        overhead_s = nbytes * self.overhead_s_per_byte
        total_s = max(load_s, first_s) + second_s + overhead_s
        full_s = self.compute_s(self.question_tokens + sum(c.tokens for c in self.chunks))
        return LoadPlan(
            tuple(load), load_s, first_s + second_s, total_s, full_s, why, nbytes, overhead_s
        )


def choose_loads(
    *,
    chunks: Sequence[ChunkLoad],
    question_tokens: int,
    num_layers: int,
    tier_bandwidth: Mapping[str, float | None],
    recompute_token_layers_per_s: float | None,
    recompute_ratio: float,
    read_token_layer_s: float = 0.0,
    overhead_s_per_byte: float = 0.0,
    full_margin: float = FULL_MARGIN,
) -> LoadPlan:
    """Which chunks to read and which to recompute whole, for the least estimated time.

    ``tier_bandwidth``: read bytes/s per tier (None or absent: not measured; such chunks are
    read, as nothing says they are slow); ``recompute_ratio``: the share of a read chunk's
    tokens that blend recomputes; ``read_token_layer_s``: what blend spends per read token
    and layer beyond the tokens it computes (placing and rotating the cached KV, selecting,
    attention over it; measured, :meth:`LoadingController.observe_blend`), counted in the
    second pass; ``overhead_s_per_byte``: what each read byte adds to the request beyond its
    link time (:meth:`LoadingController.observe_plan`). Time is estimated as
    ``max(load_s, first_pass_s) + second_pass_s`` (the module's docstring); each tier's reads
    share its link, tiers read in parallel. Last, the whole request: where loading is what it
    waits on and the best plan is not estimated at least ``full_margin`` faster than full
    prefill, every chunk is recomputed. (Where loading hides behind compute, every chunk is
    read: a short prompt's blend may cost about what full prefill does, and the stored KV
    is what the product is for.)"""
    throughput = recompute_token_layers_per_s or None
    if throughput is None:
        return LoadPlan(
            tuple(True for _ in chunks),
            None,
            None,
            None,
            None,
            {"rule": "no measurement of recompute throughput yet: every chunk is read"},
        )
    price = _Pricing(
        chunks,
        question_tokens,
        num_layers,
        tier_bandwidth,
        throughput,
        recompute_ratio,
        read_token_layer_s,
        overhead_s_per_byte,
    )
    # the chunks a slow link makes dearest first: load time over recompute time
    cost = {
        i: seconds / price.compute_s(chunk.tokens)
        for i, chunk in enumerate(chunks)
        if chunk.tokens > 0 and (seconds := price.load_s(chunk)) is not None
    }
    order = sorted(cost, key=lambda i: -cost[i])
    why = {"load_over_recompute": {str(i): cost[i] for i in order}}
    every = price.plan([True] * len(chunks), why)
    hidden = every.load_s_estimate <= every.compute_s_estimate
    if hidden:  # loading is not what the request waits on: every chunk is read
        order = []
    best = every
    for recomputed in range(1, len(order) + 1):
        plan = price.plan([i not in order[:recomputed] for i in range(len(chunks))], why)
        if plan.total_s_estimate < best.total_s_estimate - 1e-12:
            best = plan
    full_s = best.full_s_estimate
    if not hidden and any(best.load) and best.total_s_estimate > (1.0 - full_margin) * full_s:
        why["rule"] = (
            f"full prefill: blend's best plan is estimated at {best.total_s_estimate:.3f} s, "
            f"not {full_margin:.0%} below full prefill's {full_s:.3f} s"
        )
        return price.plan([False] * len(chunks), why)
    n = best.recomputed
    why["rule"] = (
        "every chunk is read: loading hides behind compute"
        if n == 0
        else f"{n} of {len(chunks)} chunks recomputed: they take longer to arrive than to "
        "recompute, and the rest arrive while they are computed"
    )
    return best


class LoadingController:
    """Running measurements (EWMA) of tier bandwidth and recompute throughput."""

    def __init__(
        self,
        *,
        r_min: float = DEFAULT_RECOMPUTE_RATIO,
        smoothing: float = 0.3,
    ) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError("smoothing must be in (0, 1]")
        self.r_min = r_min
        self.smoothing = smoothing
        self.recompute_token_layers_per_s: float | None = None
        self.read_token_layer_s = 0.0  # blend's cost per read token and layer (observe_blend)
        self.overhead_s_per_byte = 0.0  # what a read byte adds beyond its link (observe_plan)
        self.tier_bandwidth: dict[str, float] = {}
        self._lock = threading.Lock()
        self.last_decision: RatioDecision | None = None

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    @property
    def target_ratio(self) -> float:
        """The ratio blend aims at before loading is weighed: r_min."""
        return self.r_min

    def observe_recompute(self, *, tokens: int, layers: int, seconds: float) -> None:
        """The engine recomputed ``tokens`` tokens through ``layers`` layers in ``seconds``."""
        if seconds > 0 and tokens * layers > 0:
            with self._lock:
                rate = tokens * layers / seconds
                self.recompute_token_layers_per_s = self._ewma(
                    self.recompute_token_layers_per_s, rate
                )

    def observe_blend(
        self, *, read_token_layers: int, computed_token_layers: int, compute_s: float
    ) -> None:
        """A blend or reuse prefill read cached KV for ``read_token_layers`` (read tokens
        times layers), computed ``computed_token_layers`` (``recomputed_per_layer`` summed)
        and spent ``compute_s`` not waiting for loads. What the computed tokens do not
        explain at the measured recompute throughput is blend's cost per read token and
        layer, for :func:`choose_loads`."""
        with self._lock:
            throughput = self.recompute_token_layers_per_s
            if not throughput or read_token_layers <= 0 or compute_s <= 0:
                return
            rest_s = max(0.0, compute_s - computed_token_layers / throughput)
            per = rest_s / read_token_layers
            old = self.read_token_layer_s or None
            self.read_token_layer_s = self._ewma(old, per)

    def observe_plan(self, plan: LoadPlan, seconds: float) -> None:
        """A request run by ``plan`` took ``seconds`` to its first token. What its estimate
        did not foresee, per byte it read, is what reading costs beyond the link: on a CPU
        worker the reads, checksums and decoding take cores from compute while they overlap
        it (seen on 2 cores: a blend over a slow link 1.5x its estimate). Never below 0: an
        estimate that came out high is left as it is (on the side of full prefill)."""
        if not plan.read_bytes or plan.total_s_estimate is None or seconds <= 0:
            return
        without = plan.total_s_estimate - plan.overhead_s
        per = max(0.0, seconds - without) / plan.read_bytes
        with self._lock:  # noisy request by request: averaged even where nothing else is
            old, weight = self.overhead_s_per_byte, min(self.smoothing, OVERHEAD_SMOOTHING)
            self.overhead_s_per_byte = per if not old else (1 - weight) * old + weight * per

    def observe_tier_bandwidths(self, bandwidths: Mapping[str, float | None]) -> None:
        """Take measured bandwidths as they are (e.g. from the store's stats), replacing."""
        with self._lock:
            for tier, bandwidth in bandwidths.items():
                if bandwidth:
                    self.tier_bandwidth[tier] = bandwidth

    def observe_store_stats(self, tier_stats: Iterable[Any]) -> None:
        """From ``TieredStore.stats().tiers`` (objects with ``name`` and
        ``read_bandwidth_bytes_per_s``)."""
        self.observe_tier_bandwidths({t.name: t.read_bandwidth_bytes_per_s for t in tier_stats})

    def choose(
        self,
        *,
        num_tokens: int,
        num_layers: int,
        load_bytes_by_tier: Mapping[str, int],
        target_ratio: float | None = None,
    ) -> RatioDecision:
        with self._lock:
            bandwidth = dict(self.tier_bandwidth)
            throughput = self.recompute_token_layers_per_s
        decision = choose_ratio(
            num_tokens=num_tokens,
            num_layers=num_layers,
            load_bytes_by_tier=load_bytes_by_tier,
            tier_bandwidth=bandwidth,
            recompute_token_layers_per_s=throughput,
            r_min=self.r_min,
            target_ratio=target_ratio,
        )
        self.last_decision = decision
        return decision

    def choose_loads(
        self,
        *,
        chunks: Sequence[ChunkLoad],
        question_tokens: int,
        num_layers: int,
        recompute_ratio: float,
    ) -> LoadPlan:
        """:func:`choose_loads` on the running measurements."""
        with self._lock:
            bandwidth = dict(self.tier_bandwidth)
            throughput = self.recompute_token_layers_per_s
            read_cost, overhead = self.read_token_layer_s, self.overhead_s_per_byte
        return choose_loads(
            chunks=chunks,
            question_tokens=question_tokens,
            num_layers=num_layers,
            tier_bandwidth=bandwidth,
            recompute_token_layers_per_s=throughput,
            recompute_ratio=recompute_ratio,
            read_token_layer_s=read_cost,
            overhead_s_per_byte=overhead,
        )

    def snapshot(self) -> dict[str, Any]:
        """Plain data for the dashboard."""
        with self._lock:
            return {
                "r_min": self.r_min,
                "recompute_token_layers_per_s": self.recompute_token_layers_per_s,
                "read_token_layer_s": self.read_token_layer_s,
                "overhead_s_per_byte": self.overhead_s_per_byte,
                "tier_bandwidth_bytes_per_s": dict(self.tier_bandwidth),
                "last_decision": None
                if self.last_decision is None
                else self.last_decision.to_dict(),
            }
