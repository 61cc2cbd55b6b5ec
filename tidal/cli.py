"""`tidal` console command: thin wrappers over the platform, fleet and flows."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from tidal.pause_cli import add_parser as add_pause_parser
from tidal.quarantine_cli import add_parser as add_quarantine_parser
from tidal.settings import TidalSettings, load_settings

if TYPE_CHECKING:
    from tidal.platform import PlatformStatus


def _platform(settings: TidalSettings):
    from tidal.client_env import use_platform_env
    from tidal.platform import Platform

    use_platform_env(settings)
    return Platform(settings)


def ensure_champions(settings: TidalSettings) -> None:
    """Give every configured model without a version under its serve alias one: its `checkpoint` imported, or
    else a base policy pretrained here."""
    from flows.bootstrap import bootstrap
    from flows.import_checkpoint import import_checkpoint
    from tidal.registry import Registry

    registry = Registry(settings.mlflow.tracking_uri)
    for m in settings.models:
        if registry.by_alias(m.name, m.serve_alias) is not None:
            continue
        if m.checkpoint:
            print(f"{m.name}: no '{m.serve_alias}' version yet; importing {m.checkpoint}")
            import_checkpoint(model=m.name, source=m.checkpoint, champion=True)
        else:
            print(f"{m.name}: no '{m.serve_alias}' version yet; bootstrapping the base policy (a few minutes)")
            bootstrap(model=m.name)


def cmd_up(settings: TidalSettings, args) -> None:
    platform = _platform(settings)
    platform.up_servers()
    ensure_champions(settings)
    platform.up_flows()
    if not args.no_fleet:
        platform.up_fleet()
        platform.up_gateway()
        platform.up_capacity()
    if args.with_prometheus:
        platform.up_prometheus()
    print_status(platform.status())


def cmd_down(settings: TidalSettings, args) -> None:
    stopped = _platform(settings).down()
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


def cmd_status(settings: TidalSettings, args) -> None:
    status = _platform(settings).status()
    print(status.model_dump_json(indent=2)) if args.json else print_status(status)


def cmd_bootstrap(settings: TidalSettings, args) -> None:
    platform = _platform(settings)
    platform.up_servers()
    from flows.bootstrap import bootstrap

    for name in args.models or [m.name for m in settings.models]:
        bootstrap(model=name, force=args.force)


def cmd_import(settings: TidalSettings, args) -> None:
    _platform(settings).up_servers()
    from flows.import_checkpoint import import_checkpoint  # after up_servers: Prefect reads its API URL on import

    import_checkpoint(model=args.model, source=args.source, champion=args.champion)


def refuse_if_paused(settings: TidalSettings, stage: str, *models: str) -> None:
    """A paused model's stage ends before a flow run starts (the flow checks too, for scheduled and triggered runs)."""
    from tidal.flywheel_pause import ensure_running
    from tidal.store import open_store

    store = open_store(settings)
    for model in models:
        ensure_running(store, model, stage)


def cmd_collect(settings: TidalSettings, args) -> None:
    names = args.models or [m.name for m in settings.models]
    refuse_if_paused(settings, "collect", *names)
    _platform(settings).up_servers()
    from flows.collect import collect  # after up_servers: Prefect reads its API URL on import

    if args.rule is not None:  # re-scoring: one model's stored dataset under another rule
        if len(names) != 1 or args.include_open_hour:
            raise SystemExit("tidal collect --rule re-scores one model's dataset: name one model, without --include-open-hour")
        from flows.rescore import rescore

        print(names[0], rescore(model=names[0], rule=args.rule, source=args.source))
        return
    for name in names:
        print(name, collect(model=name, include_open_hour=args.include_open_hour))


def cmd_judge(settings: TidalSettings, args) -> None:
    _platform(settings).up_servers()
    from flows.judge import judge  # after up_servers: Prefect reads its API URL on import

    judge(model=args.model, hours=args.hours)


def cmd_train(settings: TidalSettings, args) -> None:
    refuse_if_paused(settings, "train", args.model)
    _platform(settings).up_servers()
    from flows.train import train  # after up_servers: Prefect reads its API URL on import
    from tidal.progress import log_status, with_progress

    # the trainer's own iteration lines (with their ETA) from the model's train log, while the flow waits for it
    status = log_status(settings.train_log(args.model), ("iteration ", "resuming"), "training: preparing the run")
    version = with_progress(lambda: train(model=args.model, dataset_id=args.dataset), status, every_s=5.0)
    print(f"{args.model}: candidate v{version}")


def cmd_promote(settings: TidalSettings, args) -> None:
    refuse_if_paused(settings, "promote", args.model)
    _platform(settings).up_servers()
    from flows.promote import promote  # after up_servers: Prefect reads its API URL on import

    print(f"{args.model}: {promote(model=args.model, candidate=args.candidate, require_gate=not args.no_gate)}")


def cmd_rollback(settings: TidalSettings, args) -> None:
    from release.operations import rollback_now
    from tidal.registry import Registry

    platform = _platform(settings)
    out = rollback_now(
        Registry(settings.mlflow.tracking_uri),
        platform.routes_client(),
        platform.fleet_client(),
        args.model,
        to=args.to,
        by=args.by,
        reason=args.reason,
    )
    print(json.dumps(out, indent=2))


def cmd_fleet(settings: TidalSettings, args) -> None:
    from tidal.progress import replica_summary, with_progress

    platform = _platform(settings)
    client, watcher = platform.fleet_client(), platform.fleet_client(timeout_s=10.0)
    if args.fleet_cmd == "scale":
        call = lambda: client.scale(args.model, args.replicas)  # noqa: E731
    elif args.fleet_cmd == "deploy":
        call = lambda: client.deploy(args.model, args.version)  # noqa: E731
    else:
        call = lambda: client.undeploy(args.model, args.version, force=args.force)  # noqa: E731
    # scale and deploy answer once their replicas are verified (minutes): the replicas' states meanwhile, on stderr
    out = with_progress(call, lambda: replica_summary(watcher.status(), args.model))
    print(json.dumps(out.model_dump(), indent=2))


def cmd_route(settings: TidalSettings, args) -> None:
    client = _platform(settings).routes_client()
    if args.route_cmd == "show":
        out = client.show()
    elif args.route_cmd == "canary":
        out = client.canary(args.model, args.version, args.weight, by=args.by, reason=args.reason)
    else:
        out = client.rollback(args.model, by=args.by, reason=args.reason)
    print(json.dumps(out.model_dump(mode="json"), indent=2))


def cmd_demo(settings: TidalSettings, args) -> None:
    from tidal.demo import cmd_demo as run

    run(settings, args)


def cmd_eval(settings: TidalSettings, args) -> None:
    from tidal.heldout_eval import cmd_eval as run

    run(settings, args)


def print_status(status: PlatformStatus) -> None:
    width = max(map(len, status.services), default=8)  # one column of names, the longest (pushgateway) included
    for name, svc in status.services.items():
        if svc.remote:
            print(f"{name:{width}s} {'up' if svc.healthy else 'unreachable':18s} {svc.url:28s} (remote)")
            continue
        state = "up" if svc.healthy else ("starting/unhealthy" if svc.running else "down")
        print(f"{name:{width}s} {state:18s} {svc.url:28s} pid={svc.pid}  log={svc.log}")
    for rec in status.paused.values():
        print(f"flywheel {rec.describe()} (`tidal resume {rec.model}`)")
    for model, link in status.data_docs.items():
        print(f"data docs {model}: {link}")
    fleet = status.fleet
    if fleet:
        if fleet.error:
            print(f"  fleet error: {fleet.error}")
        for model, group in fleet.models.items():
            print(
                f"  model {model}: strategy={group.strategy} base=v{group.base_version} "
                f"adapters={group.adapters} replicas={len(group.replicas)}/{group.desired_replicas}"
            )
            for r in group.replicas:
                served = ", ".join(sorted(r.served))
                print(
                    f"    {r.name:10s} {r.state:9s} {r.url:24s} pid={r.pid} serves [{served}] restarts={r.restarts}"
                    + (f"  last error: {r.last_error}" if r.last_error else "")
                )
    cap = status.capacity
    if cap:
        print(
            f"  capacity ({cap.mode}): {cap.usable_units} {cap.unit}(s): serving {cap.serving_units}, training "
            f"{cap.lent_units}" + (f"  last error: {cap.last_error}" if cap.last_error else "")
        )
        for model, m in cap.models.items():
            print(f"    {model}: {m.replicas} replica(s), needs {m.needed}: {m.reason}")
        for lease in cap.leases:
            print(f"    lease {lease.id} {lease.state:8s} {lease.units} unit(s) to {lease.holder}")
        for e in cap.events[-5:]:
            print(f"    {e.kind:7s} {e.units} unit(s) {e.holder or ''}: {e.reason}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="Online RL of LLMs from production traffic.")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start Prefect, MLflow and the fleet (bootstraps the base policy if missing)")
    up.add_argument("--no-fleet", action="store_true", help="servers only")
    up.add_argument(
        "--with-prometheus",
        action="store_true",
        help="also a local Prometheus scraping the gateway and the supervisor, with infra/monitoring's alert rules",
    )
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop everything `up` started").set_defaults(func=cmd_down)
    st = sub.add_parser("status", help="what runs, where, which versions each replica serves")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)
    bs = sub.add_parser("bootstrap", help="pretrain and register the base policy (version 1, alias champion)")
    bs.add_argument("models", nargs="*")
    bs.add_argument("--force", action="store_true", help="train and register a new base even if a champion exists")
    bs.set_defaults(func=cmd_bootstrap)
    im = sub.add_parser(
        "import", help="register a Hugging Face checkpoint (a directory or s3:// prefix) as the model's next version"
    )
    im.add_argument("model")
    im.add_argument("source", help="save_pretrained directory (config, safetensors weights, tokenizer) or s3://bucket/prefix")
    im.add_argument("--champion", action="store_true", help="make it the champion (what the fleet serves)")
    im.set_defaults(func=cmd_import)
    co = sub.add_parser("collect", help="validate logs since the watermark into a reward dataset")
    co.add_argument("models", nargs="*")
    co.add_argument("--include-open-hour", action="store_true", help="also take the hour still in progress")
    co.add_argument(
        "--rule",
        default=None,
        help="re-score a stored dataset under this rule (NAME@VERSION, or the rule as JSON) into a new dataset version; "
        "the watermark does not move",
    )
    co.add_argument("--from", dest="source", default=None, help="with --rule: the dataset to re-score (default: the latest)")
    co.set_defaults(func=cmd_collect)
    ju = sub.add_parser("judge", help="score the window's logged completions with the model's judge (models[].judge)")
    ju.add_argument("model")
    ju.add_argument("--hours", type=float, default=24.0, help="the window: completions of the last this many hours")
    ju.set_defaults(func=cmd_judge)
    tr = sub.add_parser("train", help="PPO from the champion on a reward dataset; registers a gated candidate")
    tr.add_argument("model")
    tr.add_argument("--dataset", default=None, help="dataset id (default: the latest collected one)")
    tr.set_defaults(func=cmd_train)
    pr = sub.add_parser("promote", help="deploy + verify the candidate, ramp a canary, promote or roll back automatically")
    pr.add_argument("model")
    pr.add_argument("--candidate", default="@candidate", help="version or alias to release (default: @candidate)")
    pr.add_argument("--no-gate", action="store_true", help="release a version that has no passing offline-gate result")
    pr.set_defaults(func=cmd_promote)
    rb = sub.add_parser("rollback", help="instant rollback: traffic and aliases back in one atomic route change")
    rb.add_argument("model")
    rb.add_argument("--to", default=None, help="version to serve (default: the control arm of a running canary, else @previous)")
    rb.add_argument("--by", default="cli", help="who rolls back (recorded)")
    rb.add_argument("--reason", default="", help="why (recorded)")
    rb.set_defaults(func=cmd_rollback)
    fl = sub.add_parser("fleet", help="operate the fleet").add_subparsers(dest="fleet_cmd", required=True)
    sc = fl.add_parser("scale")
    sc.add_argument("model")
    sc.add_argument("replicas", type=int)
    for verb in ("deploy", "undeploy"):
        v = fl.add_parser(verb)
        v.add_argument("model")
        v.add_argument("version", help="3, v3 or @alias")
        if verb == "undeploy":
            v.add_argument(
                "--force",
                action="store_true",
                help="unload even if the gateway's route table sends it traffic (its users get errors)",
            )
    for parser in fl.choices.values():
        parser.set_defaults(func=cmd_fleet)
    rt = sub.add_parser("route", help="the gateway's traffic split").add_subparsers(dest="route_cmd", required=True)
    rt.add_parser("show")
    ca = rt.add_parser("canary", help="send WEIGHT of users to VERSION (sticky, monotone)")
    ca.add_argument("model")
    ca.add_argument("version", type=int)
    ca.add_argument("weight", type=float)
    rb = rt.add_parser("rollback", help="control arm 100%% at once")
    rb.add_argument("model")
    for parser in rt.choices.values():
        parser.add_argument("--by", default="cli", help="who (kept in the route history)")
        parser.add_argument("--reason", default="", help="why (kept in the route history)")
        parser.set_defaults(func=cmd_route)
    de = sub.add_parser("demo", help="the main job: platform up, simulated users, flywheel cycles, held-out report")
    de.add_argument("--cycles", type=int, default=None, help="flywheel cycles (default: demo.cycles, 3)")
    de.add_argument("--model", default=None, help="model to run (default: the first configured)")
    de.set_defaults(func=cmd_demo)
    ev = sub.add_parser(
        "eval",
        help=(
            "replay held-out simulated users against versions: metrics with 95%% CIs, and "
            "each version's paired difference from the first listed"
        ),
    )
    ev.add_argument("model")
    ev.add_argument("--versions", required=True, help="comma-separated versions, e.g. 1,4")
    ev.add_argument("--requests", type=int, default=600, help="held-out requests per version")
    ev.add_argument("--seed", type=int, default=8, help="seed of the held-out sample (same sites for every version)")
    ev.add_argument(
        "--code-dir",
        default=None,
        help=(
            "draw the requests' sites from every *.py file under this directory (your own code) instead of the "
            "held-out eval files; differences are paired against the first version listed"
        ),
    )
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)
    add_quarantine_parser(sub)
    add_pause_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings()
        from tidal.platform import prefect_reachable

        with prefect_reachable(settings):
            args.func(settings, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every user-facing failure: one clear line, no traceback
        from serving.client import AdminError
        from tidal.flywheel_pause import FlywheelPaused
        from tidal.platform import ServerUnavailable
        from tidal.procs import NotReady, PortInUse
        from tidal.registry import RegistryError
        from tidal.section import SettingsError

        if isinstance(
            e,
            (
                AdminError,
                FlywheelPaused,
                NotReady,
                PortInUse,
                RegistryError,
                ServerUnavailable,
                SettingsError,
                FileNotFoundError,
                ValueError,
            ),
        ):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
