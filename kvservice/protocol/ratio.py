"""The recompute ratio: the one default and the operator's setting turned into what a request
carries, for both processes.

Why here, in the torch-free protocol, and not only in ``kvservice.blend.planning``: the web app
puts into each chat request what the operator's setting asks for
(``webapp.dashboard.selectors.request_ratios``) and shows beside the setting's form the ratio
target mode will pick; it may import only ``kvservice.protocol``. So the part of the decision
that needs no engine lives here, called by both: :func:`plan_ratios` turns the setting
(auto, a fixed ratio, a fidelity target; progressive blend), the measured curve of the store's
codec (``kvservice.protocol.curve``) and the running model's fingerprint into the request's
fields. The worker's planner (``kvservice.blend.planning.RatioPolicy``) takes those fields and
adds the engine's part: the loading controller's choice on the loader's estimate (the bytes
each tier will deliver), once the loader has opened the request's chunks.

A curve is measured on one model: its JSON's ``env.model_fingerprint`` is that model's
fingerprint, the first part of its chunk keys (``kvservice.protocol.keys.ChunkKey``). Target
mode reads a curve only where that fingerprint is the running model's
(:func:`curve_fits_model`); on another model it reads none and the loading controller decides,
as in auto, from its floor :data:`DEFAULT_RECOMPUTE_RATIO` (:func:`no_curve_note` says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvservice.protocol.curve import CurveSeries, plan_for_target

# Blend's ratio where nothing else sets one: the loading controller's floor (r_min), the
# engine's and the prefill's default. CacheBlend's 15 %; on SmolLM2-135M, Musique 20-39
# (docs/ratio_curve.json), its mean KL to full is a third of reuse's.
DEFAULT_RECOMPUTE_RATIO = 0.15

AUTO, FIXED, TARGET = "auto", "fixed", "target"  # the dashboard's modes


@dataclass(frozen=True)
class RatioSetting:
    """The operator's setting (``webapp.dashboard.models.DashboardSettings``)."""

    mode: str = AUTO
    fixed_ratio: float | None = None  # mode "fixed"
    fidelity_target: float | None = None  # mode "target": mean KL to full at most this
    refresh_ratio: float | None = None  # progressive blend (None: the worker's, 0: off)


@dataclass(frozen=True)
class RatioPlan:
    """What a request carries (``GenerateRequest``'s fields of the same names), and for
    target mode the first-token ratio the curve gives and why no curve was read."""

    recompute_ratio: float | None = None  # a fixed ratio (None: the worker decides)
    target_ratio: float | None = None  # the controller's floor in r_min's place
    refresh_ratio: float | None = None  # None: the worker's BLEND_REFRESH_RATIO, 0: off
    no_curve: str | None = None  # target mode read no curve: why, in the operator's words

    def request_fields(self) -> dict[str, float | None]:
        return {
            "recompute_ratio": self.recompute_ratio,
            "target_ratio": self.target_ratio,
            "refresh_ratio": self.refresh_ratio,
        }

    @property
    def target_refresh(self) -> float | None:
        """The ratio progressive blend upgrades to where the curve chose it (None: plain)."""
        return (self.refresh_ratio or None) if self.target_ratio is not None else None


def curve_fits_model(curve: CurveSeries, model_fingerprint: str | None) -> bool:
    """Whether ``curve`` may steer target mode for the running model: unless both
    fingerprints are known and differ (a curve that records none cannot be checked, nor can
    a model no heartbeat has named yet)."""
    measured_on = curve.model_fingerprint
    return not (measured_on and model_fingerprint and measured_on != model_fingerprint)


def no_curve_note(curve: CurveSeries, model_fingerprint: str | None, command: str) -> str | None:
    """Why target mode reads no curve for the running model, with the bench run that measures
    one; None where ``curve`` fits it."""
    if curve_fits_model(curve, model_fingerprint):
        return None
    return (
        "No ratio curve has been measured for this model (the curve was measured on another "
        f"one); target mode uses the loading controller's ratio, at least "
        f"{DEFAULT_RECOMPUTE_RATIO:g}, as in auto. Measure one with: {command}"
    )


def plan_ratios(
    setting: RatioSetting,
    curve: CurveSeries | None,
    model_fingerprint: str | None = None,
    command: str = "python -m kvservice.bench --ratios ... --json ...",
) -> RatioPlan:
    """The request's ratios for ``setting``: a fixed ratio as it is; for a fidelity target,
    the least first-token ratio ``curve`` (the store's codec's) says reaches it, by plain or
    progressive blend (``kvservice.protocol.curve.plan_for_target``; refresh 0 where plain
    blend does), else, with no curve, one no point of which reaches it, or one of another
    model, nothing (the worker's controller decides as in auto); in auto, the progressive
    setting as it is."""
    plain = RatioPlan(refresh_ratio=setting.refresh_ratio)
    if setting.mode == FIXED:
        return RatioPlan(recompute_ratio=setting.fixed_ratio, refresh_ratio=setting.refresh_ratio)
    if setting.mode != TARGET or setting.fidelity_target is None or curve is None:
        return plain
    note = no_curve_note(curve, model_fingerprint, command)
    if note is not None:
        return RatioPlan(refresh_ratio=setting.refresh_ratio, no_curve=note)
    if not curve.points:
        return plain
    ratio, refresh = plan_for_target(
        curve.points, setting.fidelity_target, setting.refresh_ratio or None
    )
    if ratio is None:
        return plain
    return RatioPlan(target_ratio=ratio, refresh_ratio=refresh or 0.0)


def resolve_refresh_ratio(requested: float | None, worker: float | None) -> float | None:
    """Progressive blend's ratio after the first token: the request's, else the worker's
    ``BLEND_REFRESH_RATIO`` (None or 0: not upgraded)."""
    return worker if requested is None else requested
