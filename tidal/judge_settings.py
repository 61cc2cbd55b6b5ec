"""A model's judge (`models[].judge`): the settings of the stage that scores its logged completions with a judge
model (data_contracts/judge.py). A leaf module, so the model's declaration can hold it."""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from tidal.section import Section

DEFAULT_TEMPLATE = (
    "Rate how well the reply answers the request, from {low:g} (useless) to {high:g} (perfect).\n\n"
    "Request:\n{prompt}\n\nReply:\n{completion}\n\nAnswer with 'Score: N'."
)


def judge_of(model) -> str | None:
    """The id of a model's judge (a ModelSettings' `judge`), None if it has none: whose scores its collection takes."""
    return model.judge.id if model.judge is not None else None


class JudgeSettings(Section):
    """A model's judge (`models[].judge`): where it is, what it is asked, how its reply is read, what it costs."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,62}$", description="The judge's name (its scores record name@version).")
    version: int = Field(1, ge=1, description="Bumped on any change of model, template or pattern.")
    endpoint: str = Field(
        "fleet",
        description=(
            "'fleet' = a ready replica of `model` on this platform's fleet, called directly; else the base URL of an "
            "OpenAI-compatible API (https://.../v1)."
        ),
    )
    model: str = Field(min_length=1, description="The judge model: a model of models[] for 'fleet', else the endpoint's name.")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the endpoint's API key (read at call time, never logged)."
    )
    template: str = Field(DEFAULT_TEMPLATE, description="The judge's prompt: {prompt}, {completion}, {low} and {high}.")
    pattern: str = Field(
        r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", description="A regex whose first group, in the reply, is the score."
    )
    scale: tuple[float, float] = Field((1.0, 10.0), description="[low, high] of the judge's scores (outside: quarantined).")
    max_tokens: int = Field(32, ge=1, description="Tokens the judge may reply with.")
    temperature: float = Field(0.0, ge=0, le=2, description="The judge's sampling temperature.")
    timeout_s: float = Field(60.0, gt=0, description="Longest wait for one judgement.")
    concurrency: int = Field(4, ge=1, le=64, description="Judgements in flight at once.")
    max_completions: int = Field(5000, ge=1, description="Most completions one run judges (the cost cap); the rest wait.")
    usd_per_1k_tokens: float = Field(0.0, ge=0, description="Price of the endpoint, for the run's cost (0: own fleet).")
    schedule_cron: str | None = Field(
        None,
        description=(
            "Run the judge stage (deployment judge-<model>) on this cron (UTC), e.g. '40 * * * *' so scores are in "
            "before the hourly collection; None = on demand (`tidal judge`)."
        ),
    )

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def client_id(self) -> str:
        return f"judge:{self.id}"

    @model_validator(mode="after")
    def _check(self) -> JudgeSettings:
        low, high = self.scale
        if not low < high:
            raise ValueError(f"judge.scale=[{low:g}, {high:g}]: low must be below high")
        try:
            if re.compile(self.pattern).groups < 1:
                raise ValueError(f"judge.pattern {self.pattern!r} has no group: put the score in parentheses")
        except re.error as e:
            raise ValueError(f"judge.pattern {self.pattern!r} is not a regex: {e}") from None
        try:
            self.template.format(prompt="", completion="", low=low, high=high)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"judge.template: {e!r}; use {{prompt}}, {{completion}}, {{low}} and {{high}} only") from None
        return self
