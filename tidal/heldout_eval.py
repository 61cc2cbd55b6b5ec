"""`tidal eval`, and the demo's last step: versions replayed on held-out users (the same seeded requests for each
version, so differences are paired), their metrics with intervals, and paired comparisons against a reference.
Versions not loaded are deployed for the replay and unloaded after (lora: an adapter; restart: a surge replica)."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.settings import TidalSettings

METRIC_NAMES = ("suggestion_rate", "accept_rate", "reward_per_request", "accepted_chars_per_request")


def replica_serving(fleet, model: str, version: int) -> str | None:
    for r in fleet.replicas(model):
        if r.state == "ready" and version in r.served.values():
            return r.url
    return None


def evaluate_versions(
    settings: TidalSettings, platform, model: str, versions: list[int], n: int, seed: int, code_dir: Path | None = None
) -> dict:
    """{version: {"suggestion_filter": what it withholds, "metrics": {name: Estimate}, "baseline_k": k, "baseline":
    {name: Estimate}, "outcomes": Outcomes,
    "baseline_outcomes": Outcomes}} on held-out users (outcomes: request by request, for paired comparisons).
    Versions not loaded are deployed for the replay and unloaded after (lora: an adapter; restart: a surge
    replica)."""
    from data_contracts.suggestion_filter import describe, from_tags
    from sim.evaluate import best_truncation, complete_all, eval_cases, outcomes, summarize
    from tidal.registry import Registry

    registry, fleet = Registry(settings.mlflow.tracking_uri), platform.fleet_client()
    cfg, rule = settings.demo.users, settings.collect.rule_for(model)
    cases = eval_cases(cfg, settings.bootstrap.heldout_fraction, n, seed, code_dir)
    out = {}
    for v in versions:
        info = registry.get(model, v)
        url, loaded_here = replica_serving(fleet, model, v), False
        if url is None:  # lora: the adapter is loaded; restart: a surge replica boots on it
            fleet.deploy(model, v)
            url, loaded_here = replica_serving(fleet, model, v), True
        try:
            texts = complete_all(
                url,
                info.served_name,
                cases,
                cfg.max_tokens,
                cfg.temperature,
                cfg.stop,
                settings.demo.eval_concurrency,
                None if (f := from_tags(info.tags)) is None else f.min_first_logprob,
            )
        finally:
            if loaded_here and registry.aliases(model).get("champion") != v:
                fleet.undeploy(model, v)
        k, baseline = best_truncation(cases, texts, rule)
        served = outcomes(cases, texts, rule)  # the users' verdicts once; metrics and paired comparisons share them
        out[v] = {
            "suggestion_filter": describe(from_tags(info.tags)),
            "metrics": summarize(served),
            "baseline_k": k,
            "baseline": baseline,
            "outcomes": served,
            "baseline_outcomes": outcomes(cases, [t[:k] for t in texts], rule),
        }
    return out


def paired(result: dict, reference: int) -> dict[int, dict]:
    """{version: {metric: Comparison}} of every other version against `reference` on the same requests."""
    from sim.paired import compare

    return {v: compare(result[reference]["outcomes"], r["outcomes"]) for v, r in result.items() if v != reference}


def print_eval(model: str, result: dict, n: int, reference: int | None = None) -> None:
    print(f"\n{model}: held-out users ({n} requests from eval files never trained on; 95% CIs)")
    print(f"{'version':<22}" + "".join(f"{m:>30}" for m in METRIC_NAMES))
    for v, r in result.items():
        print(f"{'v' + str(v):<22}" + "".join(f"{str(r['metrics'][m]):>30}" for m in METRIC_NAMES))
        label = f"  v{v} cut to {r['baseline_k']} chars"
        print(f"{label:<22}" + "".join(f"{str(r['baseline'][m]):>30}" for m in METRIC_NAMES))
        print(f"  v{v} {r['suggestion_filter']}")
    reference = next(iter(result)) if reference is None else reference
    for v, comparisons in paired(result, reference).items():
        print(f"v{v} − v{reference}, paired on the same {n} requests (×: ratio b/a; ±: difference; 95% bootstrap CIs)")
        for m in METRIC_NAMES:
            print(f"  {comparisons[m].describe():<60} {'significant' if comparisons[m].significant else ''}")


def cmd_eval(settings: TidalSettings, args) -> None:
    from tidal.client_env import use_platform_env
    from tidal.platform import Platform

    use_platform_env(settings)
    versions = [int(v.strip().lstrip("v")) for v in args.versions.split(",") if v.strip()]
    if not versions:
        raise ValueError("--versions needs at least one version, e.g. --versions 1,4")
    code_dir = Path(args.code_dir) if args.code_dir else None
    result = evaluate_versions(settings, Platform(settings), args.model, versions, args.requests, args.seed, code_dir)
    if args.json:
        print(
            json.dumps(
                {
                    "versions": {v: _flat(r) for v, r in result.items()},
                    "reference": versions[0],
                    "paired": {v: {m: _comparison(c) for m, c in cs.items()} for v, cs in paired(result, versions[0]).items()},
                }
            )
        )
    else:
        print_eval(args.model, result, args.requests, versions[0])


def _flat(r: dict) -> dict:
    return {
        **{m: vars(e) for m, e in r["metrics"].items()},
        "baseline_k": r["baseline_k"],
        "suggestion_filter": r["suggestion_filter"],
        **{f"baseline_{m}": vars(e) for m, e in r["baseline"].items()},
    }


def _comparison(c) -> dict:
    return {"a": c.a, "b": c.b, "delta": vars(c.delta), "ratio": vars(c.ratio) if c.ratio else None, "significant": c.significant}
