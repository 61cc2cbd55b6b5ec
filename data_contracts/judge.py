"""Judge rewards: logged completions scored by a judge model, recorded as feedback with source='judge'.

A judge is any OpenAI-compatible endpoint, or a model on this platform's fleet (called on a replica directly, so its
requests are not logged as the model's traffic). Each completion is rendered into the judge's prompt template, the
reply parsed by its pattern, the score rescaled from the judge's scale into the judged model's
`feedback.score_range`, and stored as a FeedbackEvent (event 'score', source 'judge', client 'judge:<name>@<version>')
under judgements/model=M/judge=<id>/. A judgement that fails (no reply, no score in it, a score off the scale) is
quarantined with its reason; each run records what it asked, scored, failed, and the tokens, cost and latency.

The collection attaches the model's judge's rows to the completions it assembles (data_contracts/pipeline.py), so
judge scores reach a dataset when the judge ran before its collection, or through re-scoring afterwards
(`tidal collect MODEL --rule ...`); the reward rule weighs them (feedback-blend's judge_weight), apart from users'.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tidal.judge_settings import JudgeSettings


class JudgeRun(BaseModel):
    """`run-<time>.json` beside a run's judgements: what one run of the judge stage did."""

    model_config = ConfigDict(extra="forbid")

    model: str
    judge: str = Field(description="The judge's id, name@version.")
    judge_model: str = Field(description="The model that judged, as the endpoint named it.")
    started_ms: int
    since_ms: int = Field(description="Completions served from here ...")
    until_ms: int = Field(description="... to here were candidates.")
    candidates: int = Field(description="Shown completions in the window not judged by this judge before.")
    asked: int = Field(description="Judgements asked this run (at most max_completions; the rest wait).")
    scored: int
    failed: int
    failed_by_reason: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    latency_ms_p50: float | None
    latency_ms_p99: float | None
    judgements_key: str | None = Field(description="The FeedbackEvent rows written (None: none scored).")
    quarantine_key: str | None = Field(description="The failed judgements with their reasons (None: none failed).")


@dataclass
class Verdict:
    """One judgement: a score on the judge's scale, or why there is none."""

    request_id: str
    score: float | None
    reason: str  # '' when scored
    reply: str
    latency_ms: float
    prompt_tokens: int = 0
    completion_tokens: int = 0


def render(cfg: JudgeSettings, prompt: str, completion: str) -> str:
    low, high = cfg.scale
    return cfg.template.format(prompt=prompt, completion=completion, low=low, high=high)


def parse(cfg: JudgeSettings, reply: str) -> tuple[float | None, str]:
    """(score, '') from a judge's reply, or (None, reason): 'no_score' (the pattern does not match) or
    'off_scale' (a number outside cfg.scale)."""
    m = re.search(cfg.pattern, reply or "")
    if m is None:
        return None, "no_score"
    try:
        score = float(m.group(1))
    except (TypeError, ValueError):
        return None, "no_score"
    low, high = cfg.scale
    return (score, "") if low <= score <= high else (None, "off_scale")


def rescale(cfg: JudgeSettings, score: float, target: tuple[float, float]) -> float:
    """A score on the judge's scale → the judged model's score_range (what the contract and the rules read)."""
    low, high = cfg.scale
    t_low, t_high = target
    return t_low + (score - low) / (high - low) * (t_high - t_low)


def ask_all(cfg: JudgeSettings, client, model: str, rows: list[dict]) -> list[Verdict]:
    """Judge each row ({request_id, prompt_text, completion_text}) through `client` (an openai.OpenAI) at cfg's
    concurrency; every row gets a Verdict, a failed call one with reason 'error:<type>'."""

    def one(row: dict) -> Verdict:
        t0 = time.perf_counter()
        try:
            r = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": render(cfg, row["prompt_text"], row["completion_text"])}],
                max_tokens=cfg.max_tokens,
                temperature=cfg.temperature,
                timeout=cfg.timeout_s,
            )
        except Exception as e:  # noqa: BLE001  any failure of the endpoint is this judgement's, quarantined by its type
            return Verdict(row["request_id"], None, f"error:{type(e).__name__}", "", (time.perf_counter() - t0) * 1000)
        reply = r.choices[0].message.content or ""
        score, reason = parse(cfg, reply)
        usage = r.usage
        return Verdict(
            row["request_id"],
            score,
            reason,
            reply,
            (time.perf_counter() - t0) * 1000,
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
        )

    with ThreadPoolExecutor(cfg.concurrency) as pool:
        return list(pool.map(one, rows))


def summary(verdicts: list[Verdict], cfg: JudgeSettings) -> dict:
    """The run's counts, tokens, cost and latency."""
    latency = np.array([v.latency_ms for v in verdicts])
    prompt, completion = sum(v.prompt_tokens for v in verdicts), sum(v.completion_tokens for v in verdicts)
    failed = Counter(v.reason for v in verdicts if v.score is None)
    return {
        "asked": len(verdicts),
        "scored": sum(v.score is not None for v in verdicts),
        "failed": sum(failed.values()),
        "failed_by_reason": dict(sorted(failed.items())),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cost_usd": round((prompt + completion) / 1000 * cfg.usd_per_1k_tokens, 6),
        "latency_ms_p50": float(np.percentile(latency, 50)) if len(latency) else None,
        "latency_ms_p99": float(np.percentile(latency, 99)) if len(latency) else None,
    }
