"""Served-weight verification: the engine must reproduce the trainer's greedy tokens and log-probs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from serving.engine import EngineClient
from training.probe import ProbeSet, load_probe


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
        return (f"probe {verdict} for {self.served_name} on {self.replica}: max |Δ logprob| = {self.max_abs_diff:.2e}, "
                f"{self.token_mismatches} of {self.items} prompts produced other tokens")


def run_probe(engine: EngineClient, served_name: str, probe: ProbeSet, atol: float, replica: str = "") -> ProbeReport:
    max_diff, mismatches, details = 0.0, 0, []
    for i, item in enumerate(probe.items):
        ids, logprobs = engine.complete(served_name, item.prompt_token_ids, len(item.completion_token_ids))
        if ids != item.completion_token_ids:
            mismatches += 1
            details.append(f"prompt {i}: served tokens {ids} != trainer tokens {item.completion_token_ids}")
        # Compare log-probs position by position while the token streams agree.
        for t, (a, b) in enumerate(zip(logprobs, item.logprobs)):
            if ids[: t + 1] != item.completion_token_ids[: t + 1]:
                break
            max_diff = max(max_diff, abs(a - b))
    ok = mismatches == 0 and max_diff <= atol
    if max_diff > atol:
        details.append(f"max |Δ logprob| {max_diff:.3e} > tolerance {atol:.1e}")
    return ProbeReport(served_name, replica, ok, max_diff, mismatches, len(probe.items), details)


def verify(engine: EngineClient, served_name: str, checkpoint_dir: Path, atol: float, replica: str = "") -> ProbeReport:
    """Raise ProbeFailed unless the replica serves exactly the weights whose probe sits in checkpoint_dir."""
    report = run_probe(engine, served_name, load_probe(checkpoint_dir), atol, replica)
    if not report.ok:
        raise ProbeFailed(report.summary() + "\n  " + "\n  ".join(report.details))
    return report
