"""The typed form a human answers when a canary is inconclusive (a Prefect pause with `wait_for_input`).

Prefect renders the form in the UI from this model and validates every answer against it: a decision
other than promote/rollback, or an answer without an approver or a reason, is refused and the flow
stays paused.
"""

from __future__ import annotations

import json
from typing import Literal

from prefect.input import RunInput
from pydantic import Field

from tidal import lineage


class Approval(RunInput):
    decision: Literal["promote", "rollback"] = Field(description="Promote the candidate, or roll it back.")
    approver: str = Field(min_length=1, max_length=100, description="Who decides (recorded on the version).")
    reason: str = Field(min_length=3, max_length=500, description="Why (recorded on the version).")

    def audit_tags(self) -> dict[str, str]:
        return {
            lineage.release_tag("approved"): json.dumps(
                {"decision": self.decision, "approver": self.approver, "reason": self.reason}
            )
        }

    def summary(self) -> str:
        return f"{self.decision} approved by {self.approver}: {self.reason}"


def approval_description(release, look) -> str:
    """Markdown shown above the form: the figures the decision rests on."""
    rows = "\n".join(f"| {k} | {v} |" for k, v in look.row().items())
    return (
        f"## {release.candidate.served_name} vs {release.champion.served_name}: inconclusive\n\n"
        f"{look.reason}\n\n| figure | value |\n|---|---|\n{rows}\n"
    )
