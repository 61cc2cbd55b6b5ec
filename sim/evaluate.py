"""Held-out evaluation: replay one fixed sample of Tab requests (eval files, never pretrained or trained
on) against given versions, straight to the replicas serving them — eval traffic never reaches the
gateway's logs, so it never becomes training data.

Every version sees the same sites, users and per-request sampling seeds. Figures come with 95%
confidence intervals: Wilson score intervals for the two proportions (suggestion rate per request, accept
rate per suggestion shown: a normal interval collapses to [0, 0] when no suggestion was accepted, though 0 of
600 only bounds the rate below ~0.6%), normal intervals for the per-request means. Beside each version: the
simple baseline the design notes ask for, the same completions cut to the k characters (best k by accepted characters per request) — a version only counts as learned if it
beats that too.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_contracts import corpus
from data_contracts.rewards import RewardRule
from data_contracts.suggestion_filter import withholds
from sim.tab_sites import TabSite, cursor_sites, site_files
from sim.users import SimUsersConfig, population, verdict

TRUNCATIONS = (2, 3, 4, 6, 8, 12)
Z95 = 1.959964


@dataclass(frozen=True)
class Estimate:
    mean: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def mean_ci(values: list[float]) -> Estimate:
    n = len(values)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / max(1, n - 1))
    return Estimate(m, m - Z95 * sd / math.sqrt(n), m + Z95 * sd / math.sqrt(n))


def proportion_ci(successes: int, trials: int) -> Estimate:
    """successes/trials with its Wilson score interval (sound at 0 and at `trials`, unlike mean ± z·sd)."""
    if trials == 0:
        return Estimate(math.nan, math.nan, math.nan)
    p, z2 = successes / trials, Z95 * Z95
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = Z95 * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return Estimate(p, max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class EvalCase:
    site: TabSite
    min_chars: int  # the user's minimum accepted length
    seed: int  # sampling seed of this request (the same for every version)


def eval_cases(cfg: SimUsersConfig, heldout_fraction: float, n: int, seed: int, code_dir: Path | None = None) -> list[EvalCase]:
    """`n` held-out requests: sites of the eval split (the stdlib's held-out files, or `cfg.code_dir`'s), or, with
    `code_dir`, of every *.py file under it (a team's own code, which the sandbox's policy never saw)."""
    if code_dir is None:
        root, files = site_files("eval", heldout_fraction, cfg.eval_fraction, cfg.code_dir)
    else:
        root = Path(code_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"--code-dir {root} is not a directory; expected a directory of *.py files")
        files = corpus.source_files(root)
        if not files:
            raise ValueError(f"--code-dir {root} holds no *.py files; expected a directory of Python code")
    sites = cursor_sites(root, files, n, seed, cfg.context_bytes)
    users, rng = population(cfg.model_copy(update={"seed": seed})), random.Random(f"eval/{seed}")
    return [EvalCase(s, users[rng.randrange(len(users))].min_chars, rng.randrange(2**31)) for s in sites]


@dataclass(frozen=True)
class Outcomes:
    """Per request (N,): a suggestion shown, accepted, characters kept, reward under the model's rule."""

    shown: np.ndarray
    accepted: np.ndarray
    kept: np.ndarray
    reward: np.ndarray

    def __len__(self) -> int:
        return len(self.shown)


def outcomes(cases: list[EvalCase], texts: list[str], rule: RewardRule) -> Outcomes:
    """The simulated users' verdicts on `texts` (one per case), request by request."""
    if len(cases) != len(texts):
        raise ValueError(f"{len(texts)} completions for {len(cases)} held-out requests: expected one per request")
    shown, acc, kept, rew = [], [], [], []
    for case, text in zip(cases, texts):
        event, k = verdict(text, case.site.intended, case.min_chars)
        shown.append(float(bool(text)))
        acc.append(float(event == "accepted"))
        kept.append(float(k if event in ("accepted", "partial") else 0))
        rew.append(rule.reward(event or "none", k if event == "partial" else None, text))
    return Outcomes(np.array(shown), np.array(acc), np.array(kept), np.array(rew))


def score(cases: list[EvalCase], texts: list[str], rule: RewardRule) -> dict[str, Estimate]:
    """Users' verdicts on `texts` (one per case) → the flywheel's metrics with intervals."""
    return summarize(outcomes(cases, texts, rule))


def summarize(o: Outcomes) -> dict[str, Estimate]:
    """Per-request outcomes → the flywheel's metrics with intervals."""
    # Accepts are a subset of the suggestions shown: per suggestion, a binomial proportion.
    return {
        "suggestion_rate": proportion_ci(int(o.shown.sum()), len(o)),
        "accept_rate": proportion_ci(int(o.accepted.sum()), int(o.shown.sum())),
        "reward_per_request": mean_ci(o.reward.tolist()),
        "accepted_chars_per_request": mean_ci(o.kept.tolist()),
    }


def best_truncation(cases: list[EvalCase], texts: list[str], rule: RewardRule) -> tuple[int, dict[str, Estimate]]:
    """The baseline: completions cut to k characters, k chosen for the most accepted characters per request."""
    scored = {k: score(cases, [t[:k] for t in texts], rule) for k in TRUNCATIONS}
    k = max(scored, key=lambda k: scored[k]["accepted_chars_per_request"].mean)
    return k, scored[k]


def complete_all(
    base_url: str,
    served_name: str,
    cases: list[EvalCase],
    max_tokens: int,
    temperature: float,
    stop: list[str],
    concurrency: int = 4,
    min_first_logprob: float | None = None,
) -> list[str]:
    """Each case's completion from one replica (OpenAI SDK against vLLM's server, seeded per request). With the
    version's suggestion filter (`min_first_logprob`), a completion whose first token's log-prob is below it is
    withheld (""), as the gateway would."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=2, timeout=120)

    def one(case: EvalCase) -> str:
        r = client.completions.create(
            model=served_name,
            prompt=case.site.prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            stop=stop or None,
            seed=case.seed,
            logprobs=0 if min_first_logprob is not None else None,  # 0: each sampled token's own log-prob
        )
        choice = r.choices[0]
        logprobs = (choice.logprobs.token_logprobs or []) if choice.logprobs else []
        return "" if withholds(min_first_logprob, logprobs) else choice.text

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, cases))
