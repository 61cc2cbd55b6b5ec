"""The judge stage's steps (flows/judge.py): find what to judge, reach the judge, ask it, store the judgements."""

from __future__ import annotations

import os

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from data_contracts import judgements
from data_contracts.judge import JudgeRun, Verdict, ask_all
from serving.client import fleet_client
from serving.settings import ServingSettings
from tidal.judge_settings import JudgeSettings
from tidal.store import ObjectStore


class JudgeError(RuntimeError):
    """The judge cannot be reached or asked: names the setting to fix."""


@task(cache_policy=NO_CACHE)
def find_unjudged(store: ObjectStore, model: str, cfg: JudgeSettings, since_ms: int, until_ms: int) -> list[dict]:
    rows = judgements.candidates(store, model, since_ms, until_ms, judgements.judged_ids(store, model, cfg.id))
    get_run_logger().info("%s: %d shown completions not judged by %s yet", model, len(rows), cfg.id)
    return rows


@task(cache_policy=NO_CACHE)
def judge_endpoint(cfg: JudgeSettings, settings: ServingSettings) -> tuple[str, str, str]:
    """(base URL, model name, API key) of the judge: a ready replica's engine for 'fleet' (asked of the fleet's admin
    API), else the endpoint."""
    key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
    if cfg.api_key_env and not key:
        raise JudgeError(f"judge {cfg.id}: environment variable {cfg.api_key_env} (judge.api_key_env) is not set")
    if cfg.endpoint != "fleet":
        return cfg.endpoint.rstrip("/"), cfg.model, key or "none"
    ready = [r for r in fleet_client(settings, timeout_s=30.0).replicas(cfg.model) if r.state == "ready" and r.served]
    if not ready:
        raise JudgeError(f"judge {cfg.id}: model {cfg.model!r} has no ready replica on the fleet (judge.model, or scale it)")
    replica = ready[0]
    served = max(replica.served, key=replica.served.get)  # its newest version
    return replica.url.rstrip("/") + "/v1", served, "none"


@task(cache_policy=NO_CACHE)
def ask_judge(cfg: JudgeSettings, endpoint: tuple[str, str, str], rows: list[dict]) -> list[Verdict]:
    from openai import OpenAI

    url, model, key = endpoint
    client = OpenAI(base_url=url, api_key=key, max_retries=1)
    verdicts = ask_all(cfg, client, model, rows)
    get_run_logger().info(
        "%s judged %d completions: %d scored", cfg.id, len(verdicts), sum(v.score is not None for v in verdicts)
    )
    return verdicts


@task(cache_policy=NO_CACHE)
def store_judgements(
    store: ObjectStore, model: str, cfg: JudgeSettings, verdicts: list[Verdict], score_range, record: dict, now_ms: int
) -> JudgeRun:
    return judgements.write_run(store, model, cfg, verdicts, score_range, record, now_ms)
