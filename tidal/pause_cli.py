"""`tidal pause|resume MODEL` (the flywheel) and `tidal approve MODEL` (a release waiting for a human).

pause:   record the pause in the store (every stage checks it; a running canary rolls back at its next look),
         pause the model's Prefect deployments (their schedules and triggers stop; the UI shows them paused),
         and answer a release waiting for approval with a rollback.
resume:  record the resume and resume the deployments.
approve: answer the typed form of the model's paused release (the same form the Prefect UI shows).
"""

from __future__ import annotations

import getpass
import json
import time

import httpx

from tidal.settings import TidalSettings


def _prefect_up(settings: TidalSettings) -> bool:
    p = settings.prefect
    try:
        headers = p.auth_headers("prefect") if p.remote else {}
        return httpx.get(p.api_url.rstrip("/") + "/health", headers=headers, verify=p.verify, timeout=5).is_success
    except httpx.HTTPError:
        return False


def _set_deployments(model: str, pause: bool) -> list[str]:
    """Pause (or resume) the model's deployments that the Prefect server has; returns their names."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from flows.deployments import deployment_names

    done = []
    with get_client(sync_client=True) as client:
        for name in deployment_names(model):
            try:
                dep = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            (client.pause_deployment if pause else client.resume_deployment)(dep.id)
            done.append(name)
    return done


def waiting_releases(model: str) -> list:
    """The model's promote runs paused for a human's answer (oldest first)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["promote"])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))),
        )
    return sorted((r for r in runs if r.parameters.get("model") == model), key=lambda r: r.expected_start_time or 0)


def answer(run, decision: str, approver: str, reason: str) -> str:
    """Resume a paused release with a typed answer; returns what happened (the server refuses an answer its form
    does not accept, naming why, and the run stays paused)."""
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus

    with get_client(sync_client=True) as client:
        for attempt in range(3):
            try:
                result = client.resume_flow_run(run.id, run_input={"decision": decision, "approver": approver, "reason": reason})
                break
            except httpx.HTTPStatusError as e:  # a server error decided nothing: retried while the run still waits
                state = client.read_flow_run(run.id).state
                if e.response.status_code < 500 or attempt == 2 or state is None or state.type != StateType.PAUSED:
                    raise
                time.sleep(2)
    if result.status != SetStateStatus.ACCEPT:
        raise ValueError(f"run {run.name} refused the answer: {result.details.reason}")
    return f"run {run.name}: {decision} ({approver}: {reason})"


def cmd_pause(settings: TidalSettings, args) -> None:
    from tidal.client_env import use_platform_env
    from tidal.flywheel_pause import record_pause
    from tidal.store import open_store

    settings.model(args.model)  # unknown model → clear error
    use_platform_env(settings)
    pause = args.cmd == "pause"
    rec = record_pause(open_store(settings), args.model, pause, args.by, args.reason)
    out: dict = {"record": rec.model_dump(mode="json"), "deployments": [], "releases_rolled_back": []}
    if not _prefect_up(settings):
        out["prefect"] = f"unreachable at {settings.prefect.api_url}: deployments left as they are (the stages read the record)"
    else:
        out["deployments"] = _set_deployments(args.model, pause)
        if pause:
            why = f"flywheel paused: {args.reason}" if len(args.reason) >= 3 else "flywheel paused"
            out["releases_rolled_back"] = [answer(r, "rollback", args.by, why) for r in waiting_releases(args.model)]
    print(json.dumps(out, indent=2))


def cmd_approve(settings: TidalSettings, args) -> None:
    from tasks.promote_approval import go_on_decision
    from tidal.client_env import use_platform_env

    settings.model(args.model)
    use_platform_env(settings)
    runs = waiting_releases(args.model)
    if not runs:
        raise ValueError(f"{args.model}: no release is waiting for approval (`tidal status` shows the fleet)")
    run = runs[0]
    key = run.state.state_details.pause_key or "inconclusive"
    decision = "rollback" if args.rollback else go_on_decision(key)
    print(answer(run, decision, args.by, args.reason) + f"; it asked: {key}")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user with no name
        return "cli"


def add_parser(sub) -> None:
    me = _user()
    for verb, text in (
        ("pause", "stop the model's flywheel: no collect, train or release runs; a running canary rolls back"),
        ("resume", "let the model's flywheel run again"),
    ):
        p = sub.add_parser(verb, help=text)
        p.add_argument("model")
        p.add_argument("--by", default=me, help=f"who (recorded; default {me})")
        p.add_argument("--reason", default="", help="why (recorded, shown by `tidal status`)")
        p.set_defaults(func=cmd_pause)
    ap = sub.add_parser("approve", help="answer the model's release that waits for a human (canary.approve_before, ask)")
    ap.add_argument("model")
    ap.add_argument("--by", default=me, help=f"approver (recorded on the version; default {me})")
    ap.add_argument("--reason", required=True, help="why (recorded on the version; 3 characters or more)")
    ap.add_argument("--rollback", action="store_true", help="roll the candidate back instead of letting it go on")
    ap.set_defaults(func=cmd_approve)
