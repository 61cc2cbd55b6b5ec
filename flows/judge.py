"""Judge stage: a window of a model's logged completions → scores from its judge model → feedback with source='judge'.

    logs/completions/model=M/...  →  judge (a fleet replica or any OpenAI-compatible endpoint)
        →  judgements/model=M/judge=<id>/{part,quarantine,run}-<ms>  (data_contracts/judgements.py)

The collection attaches those scores to the completions it assembles; re-scoring takes them into a dataset
collected before the judge ran (`tidal collect MODEL --rule ...`).
"""

from __future__ import annotations

from prefect import flow

from data_contracts.judge import summary
from tasks.judge import JudgeError, ask_judge, find_unjudged, judge_endpoint, store_judgements
from tidal.clock import now_ms
from tidal.settings import load_settings
from tidal.store import open_store


@flow(name="judge", log_prints=True)
def judge(model: str = "tab", hours: float = 24.0) -> dict:
    """Judge the model's completions of the last `hours` not judged yet (at most judge.max_completions); returns the
    run's JudgeRun record."""
    settings = load_settings()
    declared = settings.model(model)  # unknown model → clear error
    cfg = declared.judge
    if cfg is None:
        raise JudgeError(f"model {model!r} has no judge: set models[].judge (name, model, endpoint)")
    store, started = open_store(settings), now_ms()
    since = started - int(hours * 3_600_000)

    rows = find_unjudged(store, model, cfg, since, started)
    asked = rows[: cfg.max_completions]
    endpoint = judge_endpoint(cfg, settings)
    verdicts = ask_judge(cfg, endpoint, asked) if asked else []
    record = {
        "model": model,
        "judge": cfg.id,
        "judge_model": endpoint[1],
        "started_ms": started,
        "since_ms": since,
        "until_ms": started,
        "candidates": len(rows),
        **summary(verdicts, cfg),
    }
    run = store_judgements(store, model, cfg, verdicts, declared.feedback.score_range, record, now_ms())

    print(
        f"{model}: judge {cfg.id} ({run.judge_model}) scored {run.scored} of {run.asked} completions "
        f"({run.candidates - run.asked} left for the next run); failed {run.failed_by_reason or 0}; "
        f"{run.prompt_tokens + run.completion_tokens} tokens, ${run.cost_usd:.4f}, p50 {run.latency_ms_p50 or 0:.0f} ms"
    )
    return run.model_dump()
