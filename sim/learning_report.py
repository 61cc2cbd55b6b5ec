"""The learning report: what a run of the flywheel did to its model on held-out users, as one record.

`tidal demo` writes it to `<data_dir>/demo/report.json`; `bench/offline_ppo.py` prints the same keys as its last
line. Ratios and differences are the final version against version 1 on the same requests (sim/paired.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from sim.paired import Comparison

Interval = tuple[float, float]


class LearningReport(BaseModel):
    final_version: int = Field(description="The version judged: the final champion (the demo) or the trained policy.")
    requests_per_version: int = Field(description="Held-out requests each version answered (the same ones).")
    # Ratios are None where version 1 scored 0 (no accept among few requests): replay more requests.
    accept_ratio: float | None = Field(description="Accept rate per suggestion shown, final / v1.")
    accept_ratio_ci: Interval | None = Field(description="Its paired 95% bootstrap interval.")
    suggestion_ratio: float | None = Field(description="Share of requests with a suggestion shown, final / v1.")
    suggestion_ratio_ci: Interval | None
    chars_ratio: float | None = Field(description="Accepted characters per request, final / v1.")
    chars_ratio_ci: Interval | None
    reward_delta: float = Field(description="Reward per request, final − v1 (a difference: the mean can be negative).")
    reward_delta_ci: Interval
    chars_vs_truncation: float = Field(description="Accepted characters per request, final − v1's best truncation.")
    chars_vs_truncation_ci: Interval
    reward_vs_truncation: float = Field(description="Reward per request, final − v1's best truncation.")
    reward_vs_truncation_ci: Interval
    beats_truncation: bool = Field(
        description=(
            "The final version is at least level with v1's best truncation baseline on both accepted characters and "
            "reward per request (point estimates)."
        )
    )
    promoted: int | None = Field(description="Candidates promoted through the canary (the demo); None offline.")
    total_s: float = Field(description="Wall seconds of the whole run.")
    train_s: float = Field(description="Wall seconds the trainer processes took, summed over the candidates.")


def _ci(e) -> Interval | None:
    return None if e is None else (e.low, e.high)


def _mean(e) -> float | None:
    return None if e is None else e.mean


def learning_report(
    vs_v1: dict[str, Comparison],
    vs_truncation: dict[str, Comparison],
    final_version: int,
    requests: int,
    promoted: int | None,
    total_s: float,
    train_s: float,
) -> LearningReport:
    """From the paired comparisons of the final version against v1 and against v1 cut to its best k characters."""
    acc, sug, chars, rew = (
        vs_v1[m] for m in ("accept_rate", "suggestion_rate", "accepted_chars_per_request", "reward_per_request")
    )
    tc, tr = vs_truncation["accepted_chars_per_request"], vs_truncation["reward_per_request"]
    return LearningReport(
        final_version=final_version,
        requests_per_version=requests,
        accept_ratio=_mean(acc.ratio),
        accept_ratio_ci=_ci(acc.ratio),
        suggestion_ratio=_mean(sug.ratio),
        suggestion_ratio_ci=_ci(sug.ratio),
        chars_ratio=_mean(chars.ratio),
        chars_ratio_ci=_ci(chars.ratio),
        reward_delta=rew.delta.mean,
        reward_delta_ci=_ci(rew.delta),
        chars_vs_truncation=tc.delta.mean,
        chars_vs_truncation_ci=_ci(tc.delta),
        reward_vs_truncation=tr.delta.mean,
        reward_vs_truncation_ci=_ci(tr.delta),
        beats_truncation=tc.delta.mean >= 0 and tr.delta.mean >= 0,
        promoted=promoted,
        total_s=round(total_s, 1),
        train_s=round(train_s, 1),
    )
