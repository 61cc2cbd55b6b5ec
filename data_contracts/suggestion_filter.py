"""A version's suggestion filter: withhold a completion whose first token the version itself found unlikely.

Most suggestions users reject are samples from the tail of the policy's distribution (docs/learning.md): showing
nothing where the first sampled token was unlikely costs the user few kept characters and spares many rejections,
which is the abstain decision the flywheel asks the model to learn, taken from the model's own confidence.

The offline gate fits one threshold per candidate on the dataset's verdicts (`fit_filter`: the candidate's
log-prob of each logged first token against the characters its user kept, each row weighted by the candidate's
probability of that first token over the logging version's, so that the shares are those of the candidate's own
samples: a sharper candidate draws fewer unlikely first tokens), and it is registered with the
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
    fitted_rows: int = Field(
        ge=0,
        description=(
            "Logged completions the threshold was fitted on: those with a verdict, and those the logging versions' "
            "filters withheld (`withheld_rows`)."
        ),
    )
    kept_rows: int = Field(ge=0, description="Of those, the ones whose user kept characters.")
    withheld_rows: int = Field(
        0,
        ge=0,
        description=(
            "Of those, completions the logging versions' filters withheld: no verdict and no kept characters, but the "
            "version's own first-token log-prob says whether it would withhold them too."
        ),
    )
    withheld_share: float = Field(
        ge=0, le=1, description="Share of the fitted rows the threshold withholds (importance-weighted to the version's samples)."
    )
    kept_chars_share: float = Field(
        ge=0, le=1, description="Share of the fitted rows' kept characters that stay shown under the threshold (weighted too)."
    )
    reason: str = Field(description="Why this threshold: the budget that bound it, or why there is none.")

    def withholds(self, logprobs: list[float]) -> bool:
        """Whether a completion with these (T,) per-token log-probs is withheld (an empty one never is)."""
        return withholds(self.min_first_logprob, logprobs)


def withholds(min_first_logprob: float | None, logprobs: list[float]) -> bool:
    """The filter's one rule, for callers holding only the threshold (the gateway, the held-out replay)."""
    return min_first_logprob is not None and bool(logprobs) and logprobs[0] < min_first_logprob


def from_tags(tags: dict[str, str]) -> SuggestionFilter | None:
    """A registered version's filter, read from its lineage tags (None: it was registered without one)."""
    raw = tags.get(lineage.SUGGESTION_FILTER)
    return None if raw is None else SuggestionFilter.model_validate_json(raw)


def fit_filter(
    first_logprobs: np.ndarray,
    kept_chars: np.ndarray,
    max_chars_loss: float,
    max_withheld: float,
    min_kept_rows: int,
    weights: np.ndarray | None = None,
    already_withheld: int = 0,
    withheld_rows: int = 0,
) -> SuggestionFilter:
    """The highest threshold that withholds at most `max_withheld` of the rows and loses at most `max_chars_loss`
    of the characters users kept. first_logprobs: (N,) the version's log-prob of each shown completion's first
    token; kept_chars: (N,) the characters its user kept (0 for a rejection); weights: (N,) each row's importance
    weight, so that shares are those of the version's own first tokens rather than the logged ones (None: 1);
    already_withheld: requests of the same logs the logging versions' filters withheld (no verdict, not among the
    rows). They count as withheld by this threshold too: the withheld share is of every request, so each new
    version's cap does not stack on its parent's. When the logs keep those completions, they are rows instead
    (kept_chars 0, their weights the version's over the logging one's) and `withheld_rows` counts them: whether the
    version withholds them is then measured, not assumed (a sharper version draws likelier first tokens there too)."""
    lp, kept = np.asarray(first_logprobs, dtype=np.float64), np.asarray(kept_chars, dtype=np.float64)
    w = np.ones_like(lp) if weights is None else np.asarray(weights, dtype=np.float64)
    if lp.shape != kept.shape or lp.shape != w.shape or lp.ndim != 1:
        raise ValueError(f"first_logprobs {lp.shape}, kept_chars {kept.shape}, weights {w.shape}: expected (N,) arrays")
    if not (np.isfinite(lp).all() and np.isfinite(w).all()) or (w < 0).any():
        raise ValueError("first_logprobs or weights hold NaN/inf (or a negative weight): the forward pass is broken")
    kept_rows = int((kept > 0).sum())
    evidence = {"fitted_rows": len(lp), "kept_rows": kept_rows, "withheld_rows": withheld_rows}
    if kept_rows < min_kept_rows:
        return SuggestionFilter(
            min_first_logprob=None,
            withheld_share=0.0,
            kept_chars_share=1.0,
            reason=f"not fitted: {kept_rows} logged completions kept characters, {min_kept_rows} needed",
            **evidence,
        )
    order = np.argsort(lp, kind="stable")
    # withheld[i], lost[i]: the weighted share of rows and of kept characters below the i-th lowest log-prob
    shown = len(lp) / (len(lp) + already_withheld)  # share of the requests whose completion was shown and judged
    withheld = (1 - shown) + shown * np.concatenate([[0.0], np.cumsum(w[order])]) / w.sum()
    lost = np.concatenate([[0.0], np.cumsum((w * kept)[order])]) / max((w * kept).sum(), 1e-300)
    lp_sorted, n = lp[order], len(lp)
    best, bound = 0, "withholding even the least likely suggestion would lose more kept characters than allowed"
    for i in range(1, n):
        if lp_sorted[i] == lp_sorted[i - 1]:
            continue  # a threshold at lp_sorted[i] withholds the rows strictly below it: ties go together
        if withheld[i] > max_withheld:
            bound = f"withheld share capped at {max_withheld:g}"
            break
        if lost[i] > max_chars_loss:
            bound = f"kept-characters loss capped at {max_chars_loss:g}"
            break
        best = i
    if best == 0 and not already_withheld:
        return SuggestionFilter(min_first_logprob=None, withheld_share=0.0, kept_chars_share=1.0, reason=bound, **evidence)
    # best == 0 with requests already withheld: the threshold at the least likely shown row keeps withholding those
    # (no row shown lies below it), and nothing more
    return SuggestionFilter(
        min_first_logprob=float(lp_sorted[best]),
        withheld_share=float(withheld[best]),
        kept_chars_share=float(1.0 - lost[best]),
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
        f"{math.exp(f.min_first_logprob):.3f}); on {f.fitted_rows} logged completions"
        + (f" ({f.withheld_rows} withheld by their versions)" if f.withheld_rows else "")
        + f": {f.withheld_share:.0%} withheld, "
        f"{f.kept_chars_share:.1%} of kept characters still shown ({f.reason})"
    )
