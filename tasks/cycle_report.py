"""The record of one flywheel cycle (`state/flywheel/model=M/cycle-N.json`), read back as itself, and the one
way cycles are shown as a table (the flywheel's Prefect artifact, the demo's console and markdown report).

A leaf module: the flywheel's tasks write it; the demo, the benchmarks and the tests read it.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from release.report import CanaryRecord, step_table

# What the release plane (or the loop before it) decided for a cycle's data.
Decision = Literal["promoted", "rolled_back", "gate_failed", "train_failed", "release_failed", "no_new_data"]
DECISIONS: tuple[Decision, ...] = get_args(Decision)

# Per-version figures of the served traffic in a cycle's dataset (tasks/flywheel.py served_metrics).
METRICS = ("requests", "suggestion_rate", "accept_rate", "reward_per_request", "accepted_chars_per_request")


class CycleReport(BaseModel):
    """One flywheel cycle: the data it learned from, the candidate, and what the release plane decided."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str
    cycle: int = Field(ge=1)
    champion_before: int
    dataset_id: str
    rows: int = Field(description="Samples in the cycle's dataset.")
    candidate: int | None = Field(None, description="The version trained this cycle (or found already trained).")
    decision: Decision | None = Field(None, description="None while the cycle runs.")
    reason: str = ""
    champion_after: int = 0
    served: dict[int, dict[str, float]] = Field(
        default_factory=dict, description=("Version -> METRICS over the dataset's rows that version served.")
    )
    canary: CanaryRecord | None = Field(None, description="The candidate's canary, if it had one (release/report.py).")
    suggestion_filter: str = Field("", description="What the candidate's suggestion filter withholds ('' without a candidate).")

    def champion_metrics(self) -> dict[str, float]:
        """METRICS of the traffic the champion served in this cycle's dataset ({} if it served none)."""
        return self.served.get(self.champion_before, {})

    def row(self) -> dict:
        """One row of the flywheel's table artifact."""
        champ = self.champion_metrics()
        return {
            "cycle": self.cycle,
            "champion": f"v{self.champion_before}",
            "candidate": f"v{self.candidate}" if self.candidate else "-",
            "dataset": self.dataset_id,
            "rows": self.rows,
            **{k: round(champ.get(k, float("nan")), 4) for k in METRICS[1:]},
            "decision": self.decision,
            "reason": self.reason[:200],
            "champion_after": f"v{self.champion_after}",
        }


def cycle_table(reports: list[CycleReport]) -> str:
    """The cycles as fixed-width text: the champion's served figures, the decision and why, each canary's steps."""
    nan = float("nan")
    lines = [
        f"{'cycle':>5} {'served':>7} {'rows':>6} {'sugg.rate':>9} {'accept':>7} {'reward/req':>10} {'chars/req':>9}  decision"
    ]
    for r in reports:
        m = r.champion_metrics()
        cand = f" v{r.candidate}" if r.candidate else ""
        lines.append(
            f"{r.cycle:>5} {'v' + str(r.champion_before):>7} {r.rows:>6} {m.get('suggestion_rate', nan):>9.3f} "
            f"{m.get('accept_rate', nan):>7.3f} {m.get('reward_per_request', nan):>10.3f} "
            f"{m.get('accepted_chars_per_request', nan):>9.3f}  {r.decision}{cand} → champion v{r.champion_after}"
            + (f"\n{'':>24}why: {r.reason[:160]}" if r.reason else "")
            + (f"\n{'':>24}v{r.candidate} {r.suggestion_filter}" if r.suggestion_filter else "")
        )
        if r.canary is not None:
            lines.append(step_table(r.canary, indent=" " * 24))
    return "\n".join(lines)
