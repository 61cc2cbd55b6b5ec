"""The typed forms a human answers when a release waits for them (a Prefect pause with `wait_for_input`).

A release asks when its canary is inconclusive (`canary.on_inconclusive: ask`) or before a step listed in
`canary.approve_before` (1.0: before promoting). Prefect renders the form in the UI from these models and
validates every answer against it: a decision the form does not offer, or an answer without an approver or a
reason, is refused and the flow stays paused. `tidal approve` and `tidal pause` answer the same forms.

The pause key names what the run waits for (`promote`, `inconclusive`, `step-N`), so a client can tell which
decision means "go on" without reading the form.
"""

from __future__ import annotations

import json
from typing import Literal

from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from pydantic import Field

from tidal import lineage


class _Answer(RunInput):
    approver: str = Field(min_length=1, max_length=100, description="Who decides (recorded on the version).")
    reason: str = Field(min_length=3, max_length=500, description="Why (recorded on the version).")
    decision: str

    def audit_tags(self, key: str) -> dict[str, str]:
        """The version's tag for this answer: `approved` for the release's last decision, `approved_step_N` for a step."""
        event = "approved" if key in ("promote", "inconclusive") else f"approved_{key.replace('-', '_')}"
        record = {"decision": self.decision, "approver": self.approver, "reason": self.reason}
        return {lineage.release_tag(event): json.dumps(record)}

    def summary(self) -> str:
        return f"{self.decision} approved by {self.approver}: {self.reason}"


class Approval(_Answer):
    """The release's last decision: promote to 100%, or roll back."""

    decision: Literal["promote", "rollback"] = Field(description="Promote the candidate, or roll it back.")


class StepApproval(_Answer):
    """Before a step of the ramp: move the canary's traffic up to it, or roll back."""

    decision: Literal["advance", "rollback"] = Field(description="Move to the next step's weight, or roll back.")


# pause key → the decision that lets the release go on
GO_ON = {"promote": "promote", "inconclusive": "promote", "step": "advance"}


def go_on_decision(pause_key: str) -> str:
    return GO_ON[pause_key.split("-")[0]]


def needs_human(look, cfg) -> bool:
    """Whether the ramp's last decision waits for a human: an inconclusive canary under `on_inconclusive: ask`, or
    a promotion under `approve_before: [1.0]`."""
    return (look.action == "inconclusive" and cfg.on_inconclusive == "ask") or (
        look.action == "promote" and 1.0 in cfg.approve_before
    )


def ask_human(release, look, cfg, routes, registry, key: str) -> _Answer:
    """Pause the flow run until a human answers (or cfg.approval_timeout_s passes: the flow fails and the watchdog
    rolls the canary back). The canary holds its weight meanwhile; the answer is tagged on the candidate."""
    model, version = release.model, release.candidate.version
    routes.watch(model, version, cfg.approval_timeout_s + cfg.watchdog_s)  # the wait is the human's, not a lost release
    form = StepApproval if key.startswith("step-") else Approval
    answer = pause_flow_run(
        wait_for_input=form.with_initial_data(
            description=approval_description(release, look, question(key, cfg)), decision="rollback"
        ),
        timeout=int(cfg.approval_timeout_s),
        poll_interval=cfg.approval_poll_s,
        key=key,
    )
    registry.set_tags(model, version, answer.audit_tags(key))
    return answer


def question(key: str, cfg) -> str:
    if key == "inconclusive":
        return "inconclusive: promote or roll back?"
    if key == "promote":
        return "promote to 100%? (canary.approve_before)"
    n = int(key.split("-")[1])
    return f"advance to step {n} at {cfg.steps[n - 1]:.0%}? (canary.approve_before)"


def approval_description(release, look, asked: str) -> str:
    """Markdown shown above the form: what is asked, and the figures the decision rests on."""
    rows = "\n".join(f"| {k} | {v} |" for k, v in look.row().items())
    return (
        f"## {release.candidate.served_name} vs {release.champion.served_name}: {asked}\n\n"
        f"{look.reason}\n\n| figure | value |\n|---|---|\n{rows}\n"
    )
