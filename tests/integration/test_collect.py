"""The collect flow on the real platform: traffic through the gateway → logs → dataset, on real Prefect
and MLflow servers. Other tests of the session log traffic too: assertions on rows are about this
test's request ids, the reconciliation is over everything stored."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from data_contracts.dataset import read_manifest, read_parquet, read_watermark
from sim.audit import stored_rows, wait_stored

pytestmark = pytest.mark.slow
# (temperature, top_p) of request i: SAMPLING[i % 3]; mu is logged after the scaling and the nucleus cut
SAMPLING = [(1.0, 1.0), (0.5, 1.0), (0.8, 0.8)]
PROMPTS = ["def add(a, b):\n    return", "for i in range(", "import os\nprint(os.path.", "class Point:\n    def __init__(self"]


def post(url: str, key: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def verdict(i: int, text: str) -> dict | None:
    """Most completions get a verdict, cycling through the events; every tenth gets none."""
    if i % 10 == 9:
        return None
    event = ("accepted", "rejected", "partial")[i % 3]
    return {"event": event, "accepted_chars": min(2, len(text))} if event == "partial" else {"event": event}


@torch.no_grad()
def assert_mu_is_the_sampled_distribution(rows: list[dict], registry, checkpoints) -> None:
    """The engine's logged mu is log softmax(logits / T) of the served weights at each row's temperature, cut to
    its top-p nucleus: the distribution the token was drawn from, which the trainer scores the policy at
    (training/rollout.py)."""
    from data_contracts.samples import RewardSample
    from training.policy import load_policy
    from training.ppo_loss import token_logprobs
    from training.rollout import collate
    from training.value_head import position_ids_from_mask

    rows = [RewardSample.model_validate(r) for r in rows if r["completion_token_ids"]]
    assert {(r.temperature, r.top_p) for r in rows} == set(SAMPLING), "rows of every sampling setting"
    far_from_raw = cut_gap = 0.0
    for version in sorted({r.version for r in rows}):
        info = registry.get("tab", version)
        model = load_policy(checkpoints.local_dir(info), base_path=checkpoints.local_dir(registry.get("tab", info.base_version)))
        b = collate([r for r in rows if r.version == version], 0)
        logits = model(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=position_ids_from_mask(b.attention_mask)
        ).logits
        m = b.mask.bool()
        served = token_logprobs(b.sampled_logits(logits), b.completion_ids)  # (B, T) tempered, on the nucleus
        assert (served - b.behaviour_logprobs)[m].abs().max() < 2e-3, f"v{version}"
        raw = token_logprobs(b.completion_view(logits), b.completion_ids)  # (B, T) at T = 1
        half = (b.temperatures == 0.5)[:, None] & m
        if half.any():
            far_from_raw = max(far_from_raw, float((raw - b.behaviour_logprobs)[half].abs().max()))
        whole = token_logprobs(b.tempered_logits(logits), b.completion_ids)  # (B, T) tempered, whole vocabulary
        nucleus = (b.top_ps < 1)[:, None] & m
        if nucleus.any():
            cut_gap = max(cut_gap, float((b.behaviour_logprobs - whole)[nucleus].max()))
    assert far_from_raw > 0.05  # at T = 0.5 the raw log-probs are not mu
    # with top_p 0.8 the engine renormalised over the nucleus: mu is above the whole-vocabulary log-prob
    assert cut_gap > 0.01


def wait_logged(settings, parts: tuple[str, ...], timeout_s: float = 20.0) -> str:
    """The newest INFO lines of the Prefect server's run logs, once one line holds each of `parts` (logs reach the
    server in batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = {"logs": {"level": {"ge_": 20}}, "sort": "TIMESTAMP_DESC", "limit": 200}
        lines = [r["message"] for r in httpx.post(f"{settings.prefect.api_url}/logs/filter", json=body, timeout=10).json()]
        if all(any(p in line for line in lines) for p in parts) or time.monotonic() > deadline:
            return "\n".join(lines)
        time.sleep(1.0)


def test_collect_turns_gateway_traffic_into_a_reconciled_dataset(settings, gateway, keys, checkpoints, registry, platform):
    from flows.collect import collect  # after the platform is up: Prefect reads its API URL on import

    store, cfg = checkpoints.store, settings.collect
    rule, started = cfg.rule_for("tab"), time.time()
    answers, sent = {}, {}
    for i in range(30):
        temperature, top_p = SAMPLING[i % 3]
        a = post(
            gateway,
            keys["alice"],
            "/v1/completions",
            {
                "model": "tab",
                "prompt": PROMPTS[i % 4],
                "max_tokens": 6,
                "logprobs": 1,
                "user": f"collect-{i}",
                "temperature": temperature,
                "top_p": top_p,
            },
        )
        answers[a["id"]] = a
        v = verdict(i, a["choices"][0]["text"])
        if v is not None:
            assert post(gateway, keys["alice"], "/v1/feedback", {"request_id": a["id"], **v})["recorded"]
            sent[a["id"]] = v
            if i % 3 == 0:  # a thumbs and a score beside the verdict: one event of each group per completion
                thumbs = "up" if v["event"] == "accepted" else "down"
                assert post(gateway, keys["alice"], "/v1/feedback", {"request_id": a["id"], "event": "thumbs", "thumbs": thumbs})
                assert post(gateway, keys["alice"], "/v1/feedback", {"request_id": a["id"], "event": "score", "score": 1 + i % 5})
                sent[a["id"]] |= {"thumbs": thumbs, "score": float(1 + i % 5)}
    some = next(iter(sent))
    refused = httpx.post(
        f"{gateway}/v1/feedback",
        json={"request_id": some, "event": "score", "score": 6},
        headers={"Authorization": f"Bearer {keys['alice']}"},
        timeout=30,
    )
    assert refused.status_code == 422 and "score_range [1, 5]" in refused.text, refused.text
    logged = {
        r["request_id"]: r for r in wait_stored(store, "completions", set(answers), model="tab") if r["request_id"] in answers
    }
    wait_stored(store, "feedback", set(sent), model="tab")
    time.sleep(cfg.upload_grace_s)  # an open-hour run takes what is older than that
    assert read_watermark(store, "tab") is None  # the first collection of this session

    ds_id = collect(model="tab", include_open_hour=True)
    manifest = read_manifest(store, "tab", ds_id).stored()
    samples = {r["request_id"]: r for r in read_parquet(store, manifest["data_key"]).to_pylist()}

    # rows join exactly to the logs and the engine's answers
    expected = {rid for rid, a in answers.items() if rid in sent or a["choices"][0]["text"] == ""}
    assert {rid for rid in samples if rid in answers} == expected
    for rid in expected:
        s, a, log = samples[rid], answers[rid], logged[rid]
        assert s["version"] == log["version"] == a["tidal"]["version"] and s["arm"] == log["arm"] == a["tidal"]["arm"]
        assert s["behaviour_logprobs"] == log["behaviour_logprobs"] and s["completion_token_ids"] == log["completion_token_ids"]
        assert s["prompt_token_ids"] == log["prompt_token_ids"] and s["completion_time_ms"] == log["time_ms"]
        assert s["completion_text"] == a["choices"][0]["text"]
        assert s["behaviour_logprobs"] == pytest.approx(a["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
        v = sent.get(rid, {"event": "none"})
        assert s["event"] == v["event"] and s["accepted_chars"] == v.get("accepted_chars")
        assert (s["thumbs"], s["score"]) == (v.get("thumbs"), v.get("score"))
        assert s["reward"] == pytest.approx(rule.reward(v["event"], v.get("accepted_chars"), s["completion_text"]))
        assert s["reward_rule"] == rule.id
        assert (s["temperature"], s["top_p"]) == (log["sampling"]["temperature"], log["sampling"]["top_p"]) in SAMPLING
    assert_mu_is_the_sampled_distribution([samples[rid] for rid in expected], registry, checkpoints)
    # counts reconcile, over everything stored so far
    counts = manifest["counts"]
    for kind in ("completions", "feedback", "total"):
        c = counts[kind]
        assert c["in"] == c["kept"] + c["quarantined"] + c["filtered"], kind
    assert counts["completions"]["in"] == len(stored_rows(store, "completions", "tab"))
    assert counts["feedback"]["in"] == len(stored_rows(store, "feedback", "tab"))
    assert counts["completions"]["filtered_by_reason"].get("no_feedback", 0) >= sum(
        1 for rid, a in answers.items() if rid not in sent and a["choices"][0]["text"]
    )

    # MLflow: a run of experiment tab/collect with the dataset as input
    exp = registry.client.get_experiment_by_name("tab/collect")
    [run] = registry.client.search_runs([exp.experiment_id], f"tags.`tidal.dataset_id` = '{ds_id}'")
    [inp] = run.inputs.dataset_inputs
    assert run.data.tags["tidal.reward_rule.plugin"].startswith("cursor-tab (tidal-rl ")  # the rule's plugin and package
    assert inp.dataset.name == ds_id and inp.dataset.digest == manifest["digest"].removeprefix("sha256:")[:16]
    # reports: Data Docs in the store, artifacts in Prefect
    assert store.exists(f"reports/data_docs/model=tab/{ds_id}/index.html")
    arts = httpx.post(
        f"{settings.prefect.api_url}/artifacts/filter", json={"artifacts": {"key": {"any_": ["tab-collect"]}}}
    ).json()
    assert any(ds_id in (a.get("data") or "") for a in arts)

    # each step said what it did, with its figures (the lines `tidal collect` shows while it runs)
    said = (
        "tab: read ",
        "log files to read",
        "contracts checked",
        f"tab: {manifest['rows']:,} reward samples under rule {rule.id}",
    )
    steps = wait_logged(settings, said)
    assert all(part in steps for part in said), steps

    # the watermark moved: a second run finds nothing new and writes nothing
    assert read_watermark(store, "tab").dataset_id == ds_id
    assert collect(model="tab", include_open_hour=True) == ds_id
    assert {k.split("/")[2] for k in store.list("datasets/model=tab/")} == {ds_id}

    # re-scoring: the same logs under the blend rule, a second dataset version; the watermark stays
    from flows.rescore import rescore

    blend_id = rescore(model="tab", rule="feedback-blend@1", source=ds_id)
    blend = read_manifest(store, "tab", blend_id)
    assert blend_id != ds_id and blend.rescored_from == ds_id and blend.reward_rule.id == "feedback-blend@1"
    assert read_watermark(store, "tab").dataset_id == ds_id
    for kind in ("completions", "feedback"):
        a, b = counts[kind], getattr(blend.counts, kind)
        assert (b.in_, b.quarantined) == (a["in"], a["quarantined"]) and b.in_ == b.kept + b.quarantined + b.filtered
    rescored = {r["request_id"]: r for r in read_parquet(store, blend.data_key).to_pylist()}
    both = [rid for rid in expected if "thumbs" in sent.get(rid, {})]
    assert both and all(rid in rescored for rid in both)
    for rid in both:  # accepted (+1), thumbs up (+1) and the score rescaled to [-1, 1], averaged (blend_rule.py)
        s, v = rescored[rid], sent[rid]
        assert (v["event"], v["thumbs"]) == ("accepted", "up") and (s["thumbs"], s["score"]) == ("up", v["score"])
        assert s["reward_rule"] == "feedback-blend@1"
        assert s["reward"] == pytest.approx((1 + 1 + (2 * (v["score"] - 1) / 4 - 1)) / 3)
    [blend_run] = registry.client.search_runs([exp.experiment_id], f"tags.`tidal.dataset_id` = '{blend_id}'")
    assert blend_run.data.tags["tidal.rescored_from"] == ds_id
    assert blend_run.data.tags["tidal.rescored_from.rule"] == rule.id

    # the judge stage: tab's judge (tab itself, on the fleet) scores the window's completions (this test's: the
    # session's earlier tests served thousands); re-scoring takes them
    from flows.judge import judge

    hours = (time.time() - started + 1) / 3600
    run = judge(model="tab", hours=hours)
    judged_now = {r["request_id"] for r in read_parquet(store, run["judgements_key"]).to_pylist()} if run["scored"] else set()
    assert run["judge"] == "critic@1" and run["judge_model"].startswith("tab@v") and run["asked"] == run["candidates"]
    assert run["asked"] >= len([a for a in answers.values() if a["choices"][0]["text"]])  # ours at least, all shown
    assert run["scored"] + run["failed"] == run["asked"] and set(run["failed_by_reason"]) <= {"no_score"}
    assert run["scored"] > 0 and run["prompt_tokens"] > 0 and run["latency_ms_p50"] > 0
    if run["failed"]:
        failed = read_parquet(store, run["quarantine_key"]).to_pylist()
        assert len(failed) == run["failed"] and all(f["reason"] == "no_score" for f in failed)
    assert judge(model="tab", hours=hours)["candidates"] == 0  # each completion is judged once
    judged = rescore(model="tab", rule='{"plugin": "feedback-blend", "version": 2, "judge_weight": 1.0}', source=ds_id)
    with_judge = read_manifest(store, "tab", judged)
    assert set(with_judge.judged) == {"critic@1"} and 0 < with_judge.judged["critic@1"] <= run["scored"]
    rows = {r["request_id"]: r for r in read_parquet(store, with_judge.data_key).to_pylist()}
    assert {rid for rid, r in rows.items() if r["judge_score"] is not None} == judged_now & set(rows)
    assert all(1.0 <= r["judge_score"] <= 5.0 for r in rows.values() if r["judge_score"] is not None)  # tab's score_range
