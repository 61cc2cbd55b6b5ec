"""A version's suggestion filter: withhold a completion whose first token the version itself found unlikely.

Most suggestions users reject are samples from the tail of the policy's distribution: on the demo's version 1,
the 30% of completions whose first sampled token had the lowest log-prob held 0.5% of the characters users kept
(docs/learning.md). Showing nothing there costs the user nothing and spares a rejection, which is the abstain
decision the flywheel asks the model to learn, taken from the model's own confidence.

The offline gate fits one threshold per candidate on the dataset's verdicts (`fit_filter`: the candidate's
log-prob of each logged first token against the characters its user kept), and it is registered with the
version as the `tidal.suggestion_filter` lineage tag. The gateway applies it to that version's completions
(`withholds`), and so does the held-out evaluation: the filter is part of what the version serves. A leaf:
numpy and pydantic only, so serving reads it without torch.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tidal import lineage


class SuggestionFilter(BaseModel):
    """The stored form (the lineage tag's JSON): the threshold and the evidence it was fitted on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_first_logprob: float | None = Field(
        description=(
            "A completion whose first token the version gave a log-prob below this (the engine's, as logged) is "
            "withheld: the client gets an empty completion. None: nothing is withheld (see `reason`)."
        )
    )
    fitted_rows: int = Field(ge=0, description="Logged completions with a verdict the threshold was fitted on.")
    kept_rows: int = Field(ge=0, description="Of those, the ones whose user kept characters.")
    withheld_share: float = Field(ge=0, le=1, description="Share of the fitted rows the threshold withholds.")
    kept_chars_share: float = Field(
        ge=0, le=1, description="Share of the fitted rows' kept characters that stay shown under the threshold."
    )
    reason: str = Field(description="Why this threshold: the budget that bound it, or why there is none.")

    def withholds(self, logprobs: list[float]) -> bool:
        """Whether a completion with these (T,) per-token log-probs is withheld (an empty one never is)."""
        return self.min_first_logprob is not None and bool(logprobs) and logprobs[0] < self.min_first_logprob


def from_tags(tags: dict[str, str]) -> SuggestionFilter | None:
    """A registered version's filter, read from its lineage tags (None: it was registered without one)."""
    raw = tags.get(lineage.SUGGESTION_FILTER)
    return None if raw is None else SuggestionFilter.model_validate_json(raw)


def fit_filter(
    first_logprobs: np.ndarray, kept_chars: np.ndarray, max_chars_loss: float, max_withheld: float, min_kept_rows: int
) -> SuggestionFilter:
    """The highest threshold that withholds at most `max_withheld` of the rows and loses at most `max_chars_loss`
    of the characters users kept. first_logprobs: (N,) the version's log-prob of each shown completion's first
    token; kept_chars: (N,) the characters its user kept (0 for a rejection)."""
    lp, kept = np.asarray(first_logprobs, dtype=np.float64), np.asarray(kept_chars, dtype=np.float64)
    if lp.shape != kept.shape or lp.ndim != 1:
        raise ValueError(f"first_logprobs {lp.shape} and kept_chars {kept.shape}: expected two (N,) arrays")
    if not np.isfinite(lp).all():
        raise ValueError("first_logprobs holds NaN/inf: the candidate's forward pass is broken")
    n, kept_rows, total = len(lp), int((kept > 0).sum()), float(kept.sum())
    evidence = {"fitted_rows": n, "kept_rows": kept_rows}
    if kept_rows < min_kept_rows:
        return SuggestionFilter(
            min_first_logprob=None,
            withheld_share=0.0,
            kept_chars_share=1.0,
            reason=f"not fitted: {kept_rows} logged completions kept characters, {min_kept_rows} needed",
            **evidence,
        )
    order = np.argsort(lp, kind="stable")
    lp_sorted, lost = lp[order], np.concatenate([[0.0], np.cumsum(kept[order])])  # lost[i]: chars of the i lowest rows
    best, bound = 0, "withholding even the least likely suggestion would lose more kept characters than allowed"
    for i in range(1, n):
        if lp_sorted[i] == lp_sorted[i - 1]:
            continue  # a threshold at lp_sorted[i] withholds the rows strictly below it: ties go together
        if i > max_withheld * n:
            bound = f"withheld share capped at {max_withheld:g}"
            break
        if lost[i] > max_chars_loss * total:
            bound = f"kept-characters loss capped at {max_chars_loss:g}"
            break
        best = i
    if best == 0:
        return SuggestionFilter(min_first_logprob=None, withheld_share=0.0, kept_chars_share=1.0, reason=bound, **evidence)
    threshold = float(lp_sorted[best])
    return SuggestionFilter(
        min_first_logprob=threshold,
        withheld_share=best / n,
        kept_chars_share=1.0 - lost[best] / total,
        reason=bound,
        **evidence,
    )


def describe(f: SuggestionFilter | None) -> str:
    """One line for reports: what the version withholds."""
    if f is None:
        return "no suggestion filter"
    if f.min_first_logprob is None:
        return f"no suggestion filter ({f.reason})"
    return (
        f"withholds suggestions whose first token has log-prob < {f.min_first_logprob:.3f} (p < "
        f"{math.exp(f.min_first_logprob):.3f}); on {f.fitted_rows} logged verdicts: {f.withheld_share:.0%} withheld, "
        f"{f.kept_chars_share:.1%} of kept characters still shown ({f.reason})"
    )
