"""Served-weight verification: the engine must give the probe's tokens the log-probs the probe holds.

The engine scores each probe completion teacher-forced (the prompt and the probe's own tokens, vLLM's
prompt_logprobs), rather than generating its own: in a low-precision engine a near tie between two tokens may
go the other way and a free-running comparison would end there, measuring nothing about the weights. The
tolerance depends on the serving dtype (serving/settings.py probe_tolerance, measured by bench/probe_dtype.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from data_contracts.probe import ProbeItem, ProbeSet, load_probe
from serving.engine import EngineClient, EngineError

NON_FINITE_JSON = "Out of range float values are not JSON compliant"  # vLLM's answer when a log-prob is NaN/inf


class ProbeFailed(RuntimeError):
    """Served weights differ from the version's checkpoint; the version must get no traffic."""


@dataclass
class ProbeReport:
    served_name: str
    replica: str
    ok: bool
    max_abs_diff: float
    token_mismatches: int
    items: int
    details: list[str] = field(default_factory=list)

    def summary(self) -> str:
        verdict = "pass" if self.ok else "FAIL"
        return (
            f"probe {verdict} for {self.served_name} on {self.replica}: max |Δ logprob| = {self.max_abs_diff:.2e} "
            f"(teacher-forced), {self.token_mismatches} of {self.items} prompts with non-finite log-probs"
        )


def compare_item(i: int, item: ProbeItem, ids: list[int], logprobs: list[float]) -> tuple[float, bool, list[str]]:
    """One probe prompt: (max |Δ log-prob| while the token streams agree, whether it failed on tokens or
    non-finite values, details). A NaN or inf log-prob fails outright: NaN weights give NaN on both sides,
    and a NaN difference must never read as "no difference"."""
    failed, max_diff, details = False, 0.0, []
    if ids != item.completion_token_ids:
        failed = True
        details.append(f"prompt {i}: served tokens {ids} != trainer tokens {item.completion_token_ids}")
    for t, (a, b) in enumerate(zip(logprobs, item.logprobs)):
        if ids[: t + 1] != item.completion_token_ids[: t + 1]:
            break
        if not (math.isfinite(a) and math.isfinite(b)):
            failed = True
            details.append(f"prompt {i}, token {t}: non-finite log-prob (served {a}, checkpoint {b}): broken (NaN/inf) weights")
            break
        max_diff = max(max_diff, abs(a - b))
    return max_diff, failed, details


def run_probe(engine: EngineClient, served_name: str, probe: ProbeSet, atol: float, replica: str = "") -> ProbeReport:
    """Score every probe completion on the engine, teacher-forced; ok when all are finite and within ``atol``."""
    max_diff, mismatches, details = 0.0, 0, []
    for i, item in enumerate(probe.items):
        try:
            ids = item.completion_token_ids
            logprobs = engine.score(served_name, item.prompt_token_ids, ids)
        except EngineError as e:
            if NON_FINITE_JSON not in str(e):
                raise
            mismatches += 1
            details.append(
                f"prompt {i}: non-finite log-probs served (the engine could not encode them as JSON): broken (NaN/inf) weights"
            )
            continue
        diff, failed, why = compare_item(i, item, ids, logprobs)
        max_diff, mismatches, details = max(max_diff, diff), mismatches + failed, details + why
    ok = mismatches == 0 and max_diff <= atol
    if max_diff > atol:
        details.append(f"max |Δ logprob| {max_diff:.3e} > tolerance {atol:.1e}")
    return ProbeReport(served_name, replica, ok, max_diff, mismatches, len(probe.items), details)


def record_probe(
    engine: EngineClient, served_name: str, prompts: list[list[int]], max_new_tokens: int, note: str = ""
) -> ProbeSet:
    """The probe of weights only an engine has run so far (an imported checkpoint): its own greedy tokens and
    log-probs at its serving dtype, which every later replica on the same dtype must reproduce."""
    items = []
    for ids in prompts:
        completion, logprobs = engine.complete(served_name, ids, max_new_tokens)
        items.append(ProbeItem(prompt_token_ids=ids, completion_token_ids=completion, logprobs=logprobs))
    return ProbeSet(version_note=note, max_new_tokens=max_new_tokens, items=items)


def verify(engine: EngineClient, served_name: str, checkpoint_dir: Path, atol: float, replica: str = "") -> ProbeReport:
    """Raise ProbeFailed unless the replica serves exactly the weights whose probe sits in checkpoint_dir."""
    report = run_probe(engine, served_name, load_probe(checkpoint_dir), atol, replica)
    if not report.ok:
        raise ProbeFailed(report.summary() + "\n  " + "\n  ".join(report.details))
    return report
