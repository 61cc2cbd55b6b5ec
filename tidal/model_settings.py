"""A served model's declaration (`models:` in tidal.yaml): what every plane needs to know about one model.

Serving reads its replicas, update strategy and the alias it serves; the release plane its canary margins.
A leaf module, so that serving and the release plane share the declaration without importing each other.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, model_validator

from tidal.judge_settings import JudgeSettings
from tidal.section import Section
from tidal.strategy import UpdateStrategy


class Margins(Section):
    """How much worse than control a candidate may be on each guardrail and still be promoted (non-inferiority
    margins). Set per model (`models[].canary_margins`) where a model's users tolerate more or less."""

    accepted_chars: float = Field(
        0.05,
        ge=0,
        lt=1,
        description=(
            "Accepted characters per request may be at most this share below control's: promotion needs the always-valid "
            "lower bound of the difference above -margin x control's mean; an upper bound below it rolls back."
        ),
    )
    error_rate: float = Field(
        0.02,
        ge=0,
        le=1,
        description=(
            "The canary's error rate may exceed control's by at most this (absolute): promotion needs the upper bound "
            "of the excess below it, a lower bound above it rolls back."
        ),
    )
    slow_share: float = Field(
        0.01,
        ge=0,
        le=1,
        description=(
            "The share of canary requests slower than max_p99_ratio x control's p99 + p99_slack_ms may exceed control's "
            "share by at most this (0.01: the 1% a p99 allows), with the same two bounds."
        ),
    )


class CorpusSource(Section):
    """The model's own text, which the trainer's code loss (train.ppo.ptx_coef) learns from and the offline gate's
    bits/byte check scores on; split train/held-out by `bootstrap.heldout_fraction` (data_contracts/corpus.py)."""

    source: str = Field(
        "stdlib",
        min_length=1,
        description=(
            "'stdlib' = the interpreter's standard library (what the pretrained base learned); a directory of the "
            "model's own text (read where the trainer runs); an s3://bucket/prefix holding it (read with the store's "
            "endpoint and credentials, copied where the trainer, the gate or the import runs: a trainer pod on a "
            "cluster has no directory of yours); or 'none' = no corpus: the gate skips bits/byte and says so, and "
            "train.ppo.ptx_coef must be 0."
        ),
    )
    pattern: str = Field(
        "*.py", min_length=1, description="Files of the directory or prefix that belong to the corpus (recursive glob)."
    )

    @model_validator(mode="after")
    def _s3_names_a_prefix(self):
        if self.source.startswith("s3://"):
            parsed = urlparse(self.source)
            if not parsed.netloc or not parsed.path.strip("/"):
                raise ValueError(
                    f"corpus.source {self.source!r} names no prefix: expected s3://bucket/prefix, the prefix holding the "
                    "model's text"
                )
        return self


class ServingCapacity(Section):
    """How many replicas the capacity scheduler may give the model (`capacity.mode: tidal`, capacity/): enough for
    its forecast demand plus headroom, and for its latency objective, between min_replicas and max_replicas."""

    min_replicas: int = Field(1, ge=0, description="Never fewer, whatever the demand: training is never lent these.")
    max_replicas: int | None = Field(None, ge=1, description="Never more; None = the model's `replicas` (sized for the peak).")
    rps_per_replica: float = Field(
        4.0,
        gt=0,
        description=(
            "Requests per second one replica serves within the latency objective. The default is one CPU replica at "
            "concurrency 1 (4.7 requests/s, 16 tokens, bench/gateway.py) less a margin; measure yours with "
            "bench/gateway.py at the concurrency your users bring."
        ),
    )
    headroom: float = Field(
        0.25, ge=0, le=4, description="Replicas for forecast demand x (1 + headroom): room for a ramp the forecast misses."
    )
    latency_objective_ms: float = Field(
        2000.0,
        gt=0,
        description=(
            "The p99 latency the model's users are promised (the gateway's, per minute). A minute over it adds a replica "
            "at once, whatever the forecast said (infra/monitoring/rules.yml alerts on the same objective)."
        ),
    )


FeedbackEventName = Literal["accepted", "rejected", "partial", "score", "thumbs", "edit"]  # records.FeedbackKind
TAB_EVENTS: list[FeedbackEventName] = ["accepted", "rejected", "partial"]


class FeedbackPolicy(Section):
    """Which feedback events the model's clients may send (`models[].feedback`): the gateway refuses others with 422
    naming the field, and the collection's contract quarantines any that reach the logs another way."""

    events: list[FeedbackEventName] = Field(
        default_factory=lambda: list(TAB_EVENTS),
        min_length=1,
        description=(
            "Events taken: the Tab verdicts (accepted, rejected, partial with its characters), 'score' (a number in "
            "score_range), 'thumbs' (up or down), 'edit' (the text the user finally kept: listing it is the opt-in to "
            "storing that text, which the collection scrubs like prompts). One of each group per completion."
        ),
    )
    score_range: tuple[float, float] = Field(
        (1.0, 5.0), description="[low, high] of a 'score' (inclusive); rules see it rescaled to [0, 1]."
    )
    max_edit_chars: int = Field(8000, ge=1, description="Longest edit text taken, in characters.")

    @model_validator(mode="after")
    def _check(self) -> FeedbackPolicy:
        low, high = self.score_range
        if not low < high:
            raise ValueError(f"feedback.score_range=[{low:g}, {high:g}]: low must be below high")
        if len(set(self.events)) != len(self.events):
            raise ValueError(f"feedback.events lists an event twice: {self.events}")
        return self

    def score01(self, score):
        """A score (or an array of them) in score_range → [0, 1]."""
        low, high = self.score_range
        return (score - low) / (high - low)


CanaryMetric = Literal["reward", "accepted", "accepted_chars", "shown_chars", "thumbs_up", "thumbs_down", "score"]
# What each canary metric is per resolved request (release/outcomes.py computes them), and the feedback event it
# needs the model to take (None: any model has it).
CANARY_METRICS: dict[str, tuple[str, FeedbackEventName | None]] = {
    "reward": ("the model's reward rule over every event of the request", None),
    "accepted": ("1 if the Tab verdict was 'accepted', else 0 (the accept rate)", "accepted"),
    "accepted_chars": ("characters the Tab verdict kept (0 without one)", "accepted"),
    "shown_chars": ("characters shown (the answer's length; 0 when nothing was shown)", None),
    "thumbs_up": ("1 if the user gave a thumbs up, else 0", "thumbs"),
    "thumbs_down": ("1 if the user gave a thumbs down, else 0", "thumbs"),
    "score": ("the user's score rescaled to [0, 1] by feedback.score_range (requests without one left out)", "score"),
}
LOWER_IS_BETTER = ("thumbs_down",)


class Guardrail(Section):
    """One metric a candidate may not be shown worse on than control by more than `margin` (non-inferiority):
    an always-valid upper bound of the regression below -margin rolls back, and promotion needs its lower bound
    above -margin."""

    metric: CanaryMetric = Field(description="The metric guarded (see CANARY_METRICS).")
    better: Literal["higher", "lower"] | None = Field(
        None, description="Which direction is better; None = the metric's own (lower for thumbs_down, else higher)."
    )
    margin: float = Field(0.05, ge=0, description="How much worse the canary may be: a share of control's mean, or absolute.")
    relative: bool = Field(True, description="margin is a share of control's mean (true) or in the metric's units (false).")

    @property
    def lower_is_better(self) -> bool:
        return self.better == "lower" if self.better is not None else self.metric in LOWER_IS_BETTER


class CanaryMetrics(Section):
    """What a model's canaries decide on (`models[].canary`): the primary metric that must improve for promotion and
    the guardrails that must not regress. The error rate, latency and served-weight guardrails hold for every model
    (their margins: canary_margins). Not given: the Tab set, `canary.primary` guarded by accepted characters per
    request within canary_margins.accepted_chars (a model that stops suggesting must not win)."""

    primary: CanaryMetric = Field("reward", description="Must be significantly higher on the canary to promote.")
    guardrails: list[Guardrail] = Field(
        default_factory=lambda: [Guardrail(metric="accepted_chars")],
        description=(
            "Metrics the canary must be shown non-inferior on. Leave out what the model's users do not care about: a "
            "chat model without a shown_chars guardrail is not rolled back for shorter answers."
        ),
    )
    watch: list[CanaryMetric] = Field(
        default_factory=list, description="Metrics reported at every look and not acted on (the Tab set watches 'accepted')."
    )

    @model_validator(mode="after")
    def _check(self) -> CanaryMetrics:
        if self.primary in LOWER_IS_BETTER:
            raise ValueError(
                f"canary.primary={self.primary!r}: the primary must be a metric where higher is better; guard "
                f"{self.primary} with a guardrail instead (better: lower)"
            )
        named = [g.metric for g in self.guardrails]
        if self.primary in named:
            raise ValueError(f"canary.guardrails lists the primary {self.primary!r}: it is tested as the primary already")
        if len(set(named)) != len(named):
            raise ValueError(f"canary.guardrails lists a metric twice: {named}")
        return self

    def metrics(self) -> list[str]:
        """Every metric a look compares: the primary, the guardrails, then the watched ones."""
        out = [self.primary, *(g.metric for g in self.guardrails)]
        return out + [m for m in self.watch if m not in out]


class ModelSettings(Section):
    name: str = Field(..., pattern=r"^[a-z][a-z0-9_-]{0,62}$", description="Registered model name; also the served name prefix.")
    replicas: int = Field(1, ge=0, description="Replicas the fleet keeps running.")
    update_strategy: UpdateStrategy = Field(
        "lora",
        description=(
            "How new versions reach the replicas: 'lora' loads adapters beside the base; 'restart' boots replicas on a "
            "full checkpoint; 'reload' and 'nccl' (CUDA engines only, 2+ replicas) swap a full checkpoint into running "
            "engines in place, one replica at a time (serving/weight_sync/)."
        ),
    )
    serve_alias: str = Field("champion", description="Registry alias whose version the replicas serve at start.")
    checkpoint: str | None = Field(
        None,
        description=(
            "A Hugging Face checkpoint (save_pretrained directory or s3://bucket/prefix) that `tidal up` imports as the "
            "champion when the model has none; None = pretrain a small base policy here (`tidal bootstrap`)."
        ),
    )
    corpus: CorpusSource = Field(
        default_factory=CorpusSource, description="The text the code loss trains on and the gate's bits/byte scores."
    )
    capacity: ServingCapacity = Field(
        default_factory=ServingCapacity,
        description="Replicas the capacity scheduler may give the model under `capacity.mode: tidal` (capacity/).",
    )
    feedback: FeedbackPolicy = Field(
        default_factory=FeedbackPolicy, description="Feedback events the model's clients may send (default: Tab's)."
    )
    canary_margins: Margins | None = Field(
        None, description=("This model's guardrail non-inferiority margins for its canaries; None = canary.margins.")
    )
    judge: JudgeSettings | None = Field(
        None, description="The judge that scores this model's logged completions (`tidal judge`); None = no judge."
    )
    canary: CanaryMetrics | None = Field(
        None,
        description=(
            "The primary metric and the guardrails this model's canaries decide on; None = the Tab set (canary.primary, "
            "accepted characters guarded within the model's accepted_chars margin)."
        ),
    )

    @model_validator(mode="after")
    def _check_canary(self) -> ModelSettings:
        if self.canary is None:
            if not set(TAB_EVENTS) & set(self.feedback.events):
                raise ValueError(
                    f"models[{self.name}]: feedback.events={self.feedback.events} takes no Tab verdict, so the default "
                    "canary (accepted characters guarded) cannot judge its candidates: set models[].canary, e.g. "
                    "{primary: reward, guardrails: [{metric: thumbs_down}]}"
                )
            return self
        for metric in self.canary.metrics():
            needs = CANARY_METRICS[metric][1]
            if needs is not None and needs not in self.feedback.events:
                raise ValueError(
                    f"models[{self.name}].canary uses {metric!r}, which needs the '{needs}' event, and "
                    f"models[{self.name}].feedback.events={self.feedback.events} does not take it: add '{needs}' to "
                    f"feedback.events or drop {metric!r} from the canary"
                )
        return self
