"""The gateway in front of real vLLM replicas: SDK compatibility, canary split, durable logs, feedback."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from serving.request_ids import RequestIdSigner
from serving.routes import arm_key, assign, assignment_key
from sim.audit import wait_stored
from tidal.registry import publish
from tidal.tokens import secret
from training.variants import random_adapter

pytestmark = pytest.mark.slow
PROMPT = "def add(a, b):\n    return"


def post(url: str, key: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def complete(url: str, key: str, user: str, max_tokens: int = 2, **extra) -> dict:
    r = post(
        url,
        key,
        "/v1/completions",
        {"model": "tab", "prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 1, "user": user, **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def canary(fleet, registry, checkpoints, champion, gateway, tmp_path_factory, platform):
    """tab on 2 replicas, a LoRA candidate deployed, routes control v1 90% / canary 10%."""
    fleet.scale("tab", 2)
    adapter = random_adapter(checkpoints.local_dir(champion), tmp_path_factory.mktemp("canary") / "a", seed=11)
    v = publish(registry, checkpoints.store, "tab", adapter, "lora", 1, {"tidal.origin": "test canary"})
    fleet.deploy("tab", v.version)
    time.sleep(1.5)  # one fleet poll: the gateway sees the new served name
    routes = platform.routes_client().canary("tab", v.version, 0.1, by="test", reason="canary split test")
    yield v.version, routes
    platform.routes_client().rollback("tab", by="test", reason="canary split test over")


def test_openai_sdk_completions_streaming_and_chat(gateway, keys, canary, checkpoints):
    from openai import OpenAI

    client = OpenAI(base_url=gateway + "/v1", api_key=keys["alice"], max_retries=0)
    r = client.completions.create(model="tab", prompt=PROMPT, max_tokens=8, logprobs=1, user="sdk-user")
    assert r.choices[0].text and "." in r.id
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
    chunks = list(client.completions.create(model="tab", prompt=PROMPT, max_tokens=8, stream=True, user="sdk-user"))
    assert "".join(c.choices[0].text for c in chunks if c.choices) and len({c.id for c in chunks}) == 1
    chat = client.chat.completions.create(model="tab", messages=[{"role": "user", "content": "write a loop"}], max_tokens=8)
    assert chat.choices[0].message.content is not None and "." in chat.id
    stream = list(
        client.chat.completions.create(model="tab", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
    )
    assert stream and all("." in c.id for c in stream)
    assert sorted(m.id for m in client.models.list().data) == ["byo", "tab", "tabfull"]  # byo: routed, 0 replicas
    rows = {r["request_id"]: r for r in wait_stored(checkpoints.store, "completions", {chunks[0].id, chat.id})}
    streamed = rows[chunks[0].id]  # a streamed completion is logged whole: text, token ids, log-probs
    assert streamed["completion_text"] == "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(streamed["completion_token_ids"]) == len(streamed["behaviour_logprobs"]) == 8
    assert len(rows[chat.id]["behaviour_logprobs"]) == len(rows[chat.id]["completion_token_ids"]) > 0


def test_a_chat_conversation_is_logged_turn_by_turn_and_only_its_client_may_continue_it(gateway, keys, checkpoints):
    import openai

    alice = openai.OpenAI(base_url=gateway + "/v1", api_key=keys["alice"], max_retries=0)
    bob = openai.OpenAI(base_url=gateway + "/v1", api_key=keys["bob"], max_retries=0)
    history = [{"role": "user", "content": "write a loop"}]
    first = alice.chat.completions.create(model="tab", messages=history, max_tokens=6)
    conv = first.model_extra["tidal"]["conversation_id"]
    assert conv == first.id  # a conversation is named by its first turn
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
    second = alice.chat.completions.create(model="tab", messages=history, max_tokens=6, extra_body={"conversation_id": conv})
    assert second.model_extra["tidal"]["conversation_id"] == conv and second.id != conv
    with pytest.raises(openai.PermissionDeniedError, match="conversation_id: the conversation belongs to another client"):
        bob.chat.completions.create(model="tab", messages=history, max_tokens=4, extra_body={"conversation_id": conv})
    with pytest.raises(openai.UnprocessableEntityError, match="conversation_id: not a conversation this gateway started"):
        alice.chat.completions.create(model="tab", messages=history, max_tokens=4, extra_body={"conversation_id": "mine"})
    rows = {r["request_id"]: r for r in wait_stored(checkpoints.store, "completions", {first.id, second.id})}
    assert (rows[first.id]["conversation_id"], rows[first.id]["turn"]) == (conv, 0)
    assert (rows[second.id]["conversation_id"], rows[second.id]["turn"]) == (conv, 1)
    # the second turn is trained on the engine's own tokens of the whole conversation so far
    assert len(rows[second.id]["prompt_token_ids"]) > len(rows[first.id]["prompt_token_ids"])
    plain = alice.completions.create(model="tab", prompt=PROMPT, max_tokens=4)
    row = {r["request_id"]: r for r in wait_stored(checkpoints.store, "completions", {plain.id})}[plain.id]
    assert (row["conversation_id"], row["turn"]) == (None, None) and "conversation_id" not in plain.model_extra["tidal"]


def test_simulated_chat_users_hold_conversations_and_rate_their_last_turn(gateway, keys, checkpoints, settings):
    from sim.chat_users import ChatUsersConfig, hold_conversations

    cfg = ChatUsersConfig(conversations=4, max_turns=2, max_tokens=8)
    tally = hold_conversations(gateway, keys["alice"], "tab", settings.bootstrap.heldout_fraction, cfg)
    assert tally.summary()["conversations"] == 4 and not tally.errors, tally.summary()
    ids = {rid for c in tally.conversations for rid in c.request_ids}
    rows = {r["request_id"]: r for r in wait_stored(checkpoints.store, "completions", ids)}
    last = {c.request_ids[-1]: c for c in tally.conversations}
    fb = [r for r in wait_stored(checkpoints.store, "feedback", set(last)) if r["request_id"] in ids]
    for c in tally.conversations:  # turns linked to the first; a wrong first answer was asked again
        assert [(rows[rid]["conversation_id"], rows[rid]["turn"]) for rid in c.request_ids] == [
            (c.request_ids[0], k) for k in range(len(c.request_ids))
        ]
        assert len(c.request_ids) == 2 or c.thumbs == "up"
    # each conversation's thumbs and score, on its last turn only, as the simulator rated it against the true line
    assert sorted((r["request_id"], r["event"], r["thumbs"] or r["score"]) for r in fb) == sorted(
        [(rid, "thumbs", c.thumbs) for rid, c in last.items()] + [(rid, "score", c.score) for rid, c in last.items()]
    )


def test_canary_split_is_sticky_and_every_record_names_its_version(gateway, keys, canary, checkpoints, settings):
    version, routes = canary  # the ModelRoutes the gateway answered the canary change with
    # The split itself is the gateway's own hash over 2000 users (cheap); 250 of them go through
    # the real gateway and engines, which must serve each one exactly that arm.
    key = arm_key(secret(settings.data_path, "request_id", settings.gateway.secret).encode())  # the gateway's own key
    expected = [assign(routes, assignment_key("alice", f"user-{i}"), key).name for i in range(2000)]
    share = expected.count("canary") / len(expected)
    assert abs(share - 0.1) < 4 * (0.1 * 0.9 / len(expected)) ** 0.5  # binomial, 4 sigma
    users = [f"user-{i}" for i in range(250)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda u: complete(gateway, keys["alice"], u), users))
    arms = [a["tidal"]["arm"] for a in answers]
    assert arms == expected[: len(users)] and {"canary", "control"} <= set(arms)  # the exact assignment, both arms
    assert all(a["tidal"]["version"] == (version if arm == "canary" else 1) for a, arm in zip(answers, arms))
    again = [complete(gateway, keys["alice"], u)["tidal"]["arm"] for u in users[:40]]
    assert again == arms[:40]  # sticky

    by_id = {a["id"]: a for a in answers}
    rows = [r for r in wait_stored(checkpoints.store, "completions", set(by_id)) if r["request_id"] in by_id]
    assert len(rows) == len(by_id)  # every acknowledged completion, once
    for row in rows:
        answer = by_id[row["request_id"]]
        assert row["version"] == answer["tidal"]["version"] and row["arm"] == answer["tidal"]["arm"]
        assert row["served_name"] == f"tab@v{row['version']}" and row["client_id"] == "alice"
        engine_lp = answer["choices"][0]["logprobs"]["token_logprobs"]
        assert row["behaviour_logprobs"] == pytest.approx(engine_lp, abs=1e-5)
        assert len(row["completion_token_ids"]) == len(row["behaviour_logprobs"]) == len(engine_lp)
        assert row["completion_text"] == answer["choices"][0]["text"] and row["prompt_text"] == PROMPT
        assert row["user_hash"] != row["request_id"] and not row["user_hash"].startswith("user-")


def test_feedback_is_accepted_once_from_its_own_client(gateway, keys, checkpoints, settings, chaos_report):
    rid = complete(gateway, keys["alice"], "fb-user")["id"]
    ok = post(gateway, keys["alice"], "/v1/feedback", {"request_id": rid, "event": "accepted"})
    assert ok.status_code == 200 and ok.json()["recorded"]
    cases = {
        "duplicate": (keys["alice"], {"request_id": rid, "event": "rejected"}, 409),
        "other client": (keys["bob"], {"request_id": complete(gateway, keys["alice"], "x")["id"], "event": "accepted"}, 403),
        "forged signature": (
            keys["alice"],
            {"request_id": rid[:-2] + ("AA" if rid[-2:] != "AA" else "BB"), "event": "accepted"},
            400,
        ),
        "garbage id": (keys["alice"], {"request_id": "not-an-id", "event": "accepted"}, 400),
        "late": (
            keys["alice"],
            {
                "request_id": RequestIdSigner(settings.gateway.secret.encode()).issue(
                    "tab", "alice", int(time.time() * 1000) - 3 * 86400_000
                ),
                "event": "accepted",
            },
            410,
        ),
        "partial without chars": (
            keys["alice"],
            {"request_id": complete(gateway, keys["alice"], "y")["id"], "event": "partial"},
            422,
        ),
        "unknown event": (keys["alice"], {"request_id": rid, "event": "loved"}, 422),
    }
    for name, (key, body, status) in cases.items():
        r = post(gateway, key, "/v1/feedback", body)
        assert r.status_code == status, (name, r.status_code, r.text)
        assert "message" in r.text or "detail" in r.text
    rows = wait_stored(checkpoints.store, "feedback", {rid})
    mine = [r for r in rows if r["request_id"] == rid]
    assert len(mine) == 1 and mine[0]["event"] == "accepted" and mine[0]["client_id"] == "alice" and mine[0]["model"] == "tab"
    chaos_report.record(
        "8. hostile input: forged, replayed, late, cross-client feedback",
        cases=len(cases),
        rejected_with_4xx=len(cases),
        stored_verdicts_for_the_id=len(mine),
        statuses=" ".join(f"{n}→{c[2]}" for n, c in cases.items()),
    )


def test_bad_requests_get_4xx_with_a_message(gateway, keys, canary, settings, chaos_report):
    alice = keys["alice"]
    cases = [
        ("no key", httpx.post(gateway + "/v1/completions", json={"model": "tab", "prompt": "x"}), 401),
        ("wrong key", post(gateway, "nope-nope-nope-nope", "/v1/completions", {"model": "tab", "prompt": "x"}), 401),
        ("oversized", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x" * 300_000}), 413),
        (
            "malformed json",
            httpx.post(
                gateway + "/v1/completions",
                content=b"{nope",
                headers={"Authorization": f"Bearer {alice}", "Content-Type": "application/json"},
            ),
            422,
        ),
        ("wrong type", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x", "max_tokens": "many"}), 422),
        ("too many tokens", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x", "max_tokens": 100_000}), 400),
        ("unknown model", post(gateway, alice, "/v1/completions", {"model": "nope", "prompt": "x"}), 404),
        ("n > 1", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x", "n": 2}), 422),
        ("prompt over the context", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x = 1\n" * 2000}), 400),
        ("admin without token", httpx.post(gateway + "/admin/routes/tab/rollback", json={}), 401),
        ("admin with a client key", post(gateway, alice, "/admin/routes/tab/rollback", {}), 401),
        (
            "route to an unserved version",
            post(gateway, "sandbox-admin-token", "/admin/routes/tab/canary", {"version": 999, "weight": 0.1}),
            409,
        ),
        (
            "weights not summing to 1",
            httpx.put(
                gateway + "/admin/routes/tab",
                json={"arms": [{"name": "control", "version": 1, "weight": 0.5}]},
                headers={"Authorization": "Bearer sandbox-admin-token"},
            ),
            422,
        ),
    ]
    for name, r, status in cases:
        assert r.status_code == status, (name, r.status_code, r.text)
        assert r.text and "Traceback" not in r.text and "alice-key" not in r.text, name
    log = Path(settings.log_dir / "gateway.log").read_text()
    keys_in_logs = sum(log.count(k) for k in (keys["alice"], keys["bob"]))
    assert keys_in_logs == 0  # keys never reach the logs
    chaos_report.record(
        "8. hostile input: unauthenticated, oversized, malformed requests",
        cases=len(cases),
        server_errors=sum(r.status_code >= 500 for _, r, _ in cases),
        keys_in_logs=keys_in_logs,
        statuses=" ".join(f"{n}→{s}" for n, _, s in cases),
    )


def test_the_supervisor_refuses_to_unload_a_version_the_routes_send_traffic_to(gateway, keys, canary, fleet, platform):
    """An operator rollback during the promote task's unload grace routed everyone to the version being unloaded,
    and a candidate rolled back while it was the control arm could be unloaded too: users then got 503s."""
    from serving.client import AdminError

    version, _ = canary
    before = fleet.replicas("tab")
    with pytest.raises(AdminError) as refused:
        fleet.undeploy("tab", version)
    assert refused.value.status == 409 and f"tab@v{version} still gets traffic" in refused.value.detail
    assert fleet.replicas("tab") == before  # nothing was unloaded
    assert platform.routes_client().show().routes["tab"].arms[1].version == version
    # the canary's users are still served by it
    served = {complete(gateway, keys["alice"], f"user-{i}")["tidal"]["version"] for i in range(40)}
    assert version in served


def test_a_hung_replica_fails_over_within_the_first_byte_timeout_without_a_client_error(
    gateway, keys, canary, fleet, settings, chaos_report
):
    """A replica alive but not answering (SIGSTOP) cost the gateway's 120 s total timeout before failover; now a
    call fails over after first_byte_timeout_s, and the supervisor replaces the hung replica by itself."""
    import os
    import signal

    ready = [r for r in fleet.replicas("tab") if r.state == "ready"]
    assert len(ready) == 2, ready
    hung = ready[0]
    os.kill(hung.pid, signal.SIGSTOP)
    codes, seconds = [], []
    try:
        for i in range(8):
            t0 = time.monotonic()
            r = post(
                gateway,
                keys["alice"],
                "/v1/completions",
                {"model": "tab", "prompt": PROMPT, "max_tokens": 2, "user": f"hang-{i}"},
                timeout=180,
            )
            codes.append(r.status_code)
            seconds.append(time.monotonic() - t0)
    finally:
        try:
            os.kill(hung.pid, signal.SIGCONT)
        except ProcessLookupError:  # the supervisor already replaced it
            pass
    limit = settings.gateway.first_byte_timeout_s
    assert codes == [200] * 8, codes
    assert max(seconds) < limit + 10, seconds  # not the 120 s total timeout
    deadline = time.monotonic() + 240  # the fleet heals: two verified replicas again
    while len([r for r in fleet.replicas("tab") if r.state == "ready"]) < 2 and time.monotonic() < deadline:
        time.sleep(2)
    healed = [r for r in fleet.replicas("tab") if r.state == "ready"]
    assert len(healed) == 2 and hung.pid not in [r.pid for r in healed], healed
    chaos_report.record(
        "9. a replica that hangs (SIGSTOP) rather than dies",
        requests=len(codes),
        client_errors=0,
        first_byte_timeout_s=limit,
        slowest_request_s=round(max(seconds), 1),
        median_request_s=round(sorted(seconds)[len(seconds) // 2], 2),
        healed_in_s=round(240 - (deadline - time.monotonic()), 1),
    )


def test_64_concurrent_seeded_completions_from_one_client_crash_no_engine(gateway, keys, canary, fleet):
    """vLLM CPU's worker died on seeded requests whose prefill was split across steps (chunked prefill, now off):
    64 at once through the gateway, with one key, took the model down."""
    before = {r.name: r.pid for r in fleet.replicas("tab") if r.state == "ready"}
    prompt = "import os\n" + "x = os.path.join('a', 'b')\n" * 20
    with ThreadPoolExecutor(64) as pool:
        codes = list(
            pool.map(
                lambda i: (
                    post(
                        gateway,
                        keys["alice"],
                        "/v1/completions",
                        {"model": "tab", "prompt": prompt, "max_tokens": 8, "seed": i, "user": f"seed-{i}"},
                        timeout=300,
                    ).status_code
                ),
                range(64),
            )
        )
    assert codes == [200] * 64, sorted(set(codes))
    after = {r.name: r.pid for r in fleet.replicas("tab") if r.state == "ready"}
    assert after == before  # no engine restarted
