"""The gateway in front of real vLLM replicas: SDK compatibility, canary split, durable logs, feedback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from serving.request_ids import RequestIdSigner
from serving.routes import assign
from tests.conftest import make_bucket
from tests.integration.tcpproxy import TcpProxy
from tidal.procs import stop_group, wait_http
from tidal.registry import publish
from tidal.sandbox import SPARE
from tidal.store import S3Store
from training.variants import random_adapter

pytestmark = pytest.mark.slow
PROMPT = "def add(a, b):\n    return"


def post(url: str, key: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def complete(url: str, key: str, user: str, max_tokens: int = 2, **extra) -> dict:
    r = post(url, key, "/v1/completions", {"model": "tab", "prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 1, "user": user, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def stored_rows(store, kind: str) -> list[dict]:
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, key in enumerate(store.list(f"logs/{kind}/")):
            store.get_file(key, Path(tmp) / f"{i}.parquet")
            tables.append(pq.read_table(Path(tmp) / f"{i}.parquet"))
    return pa.concat_tables(tables).to_pylist() if tables else []


def wait_stored(store, kind: str, ids: set[str], timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        rows = stored_rows(store, kind)
        if ids <= {r["request_id"] for r in rows} or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


@pytest.fixture(scope="module")
def canary(fleet, registry, checkpoints, champion, gateway, tmp_path_factory, platform):
    """tab on 2 replicas, a LoRA candidate deployed, routes control v1 90% / canary 10%."""
    fleet.scale("tab", 2)
    adapter = random_adapter(checkpoints.local_dir(champion), tmp_path_factory.mktemp("canary") / "a", seed=11)
    v = publish(registry, checkpoints.store, "tab", adapter, "lora", 1, {"tidal.origin": "test canary"})
    fleet.deploy("tab", v.version)
    time.sleep(1.5)  # one fleet poll: the gateway sees the new served name
    routes = platform.routes_client().canary("tab", v.version, 0.1, by="test", reason="canary split test")
    return v.version, routes


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
    stream = list(client.chat.completions.create(model="tab", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))
    assert stream and all("." in c.id for c in stream)
    assert sorted(m.id for m in client.models.list().data) == ["tab", "tabfull"]
    rows = {r["request_id"]: r for r in wait_stored(checkpoints.store, "completions", {chunks[0].id, chat.id})}
    streamed = rows[chunks[0].id]  # a streamed completion is logged whole: text, token ids, log-probs
    assert streamed["completion_text"] == "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(streamed["completion_token_ids"]) == len(streamed["behaviour_logprobs"]) == 8
    assert len(rows[chat.id]["behaviour_logprobs"]) == len(rows[chat.id]["completion_token_ids"]) > 0


def test_canary_split_is_sticky_and_every_record_names_its_version(gateway, keys, canary, checkpoints):
    version, routes_dump = canary
    from serving.routes import ModelRoutes

    routes = ModelRoutes.model_validate(routes_dump)
    users = [f"user-{i}" for i in range(1000)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda u: complete(gateway, keys["alice"], u), users))
    arms = [a["tidal"]["arm"] for a in answers]
    share = arms.count("canary") / len(users)
    assert abs(share - 0.1) < 4 * (0.1 * 0.9 / len(users)) ** 0.5  # binomial, 4 sigma
    assert arms == [assign(routes, u).name for u in users]  # the exact, deterministic assignment
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


def test_feedback_is_accepted_once_from_its_own_client(gateway, keys, checkpoints, settings):
    rid = complete(gateway, keys["alice"], "fb-user")["id"]
    ok = post(gateway, keys["alice"], "/v1/feedback", {"request_id": rid, "event": "accepted"})
    assert ok.status_code == 200 and ok.json()["recorded"]
    cases = {
        "duplicate": (keys["alice"], {"request_id": rid, "event": "rejected"}, 409),
        "other client": (keys["bob"], {"request_id": complete(gateway, keys["alice"], "x")["id"], "event": "accepted"}, 403),
        "forged signature": (keys["alice"], {"request_id": rid[:-2] + ("AA" if rid[-2:] != "AA" else "BB"), "event": "accepted"}, 400),
        "garbage id": (keys["alice"], {"request_id": "not-an-id", "event": "accepted"}, 400),
        "late": (keys["alice"], {"request_id": RequestIdSigner(settings.gateway.secret.encode()).issue(
            "tab", "alice", int(time.time() * 1000) - 3 * 86400_000), "event": "accepted"}, 410),
        "partial without chars": (keys["alice"], {"request_id": complete(gateway, keys["alice"], "y")["id"], "event": "partial"}, 422),
        "unknown event": (keys["alice"], {"request_id": rid, "event": "loved"}, 422),
    }
    for name, (key, body, status) in cases.items():
        r = post(gateway, key, "/v1/feedback", body)
        assert r.status_code == status, (name, r.status_code, r.text)
        assert "message" in r.text or "detail" in r.text
    rows = wait_stored(checkpoints.store, "feedback", {rid})
    mine = [r for r in rows if r["request_id"] == rid]
    assert len(mine) == 1 and mine[0]["event"] == "accepted" and mine[0]["client_id"] == "alice" and mine[0]["model"] == "tab"


def test_bad_requests_get_4xx_with_a_message(gateway, keys, canary, settings):
    alice = keys["alice"]
    cases = [
        ("no key", httpx.post(gateway + "/v1/completions", json={"model": "tab", "prompt": "x"}), 401),
        ("wrong key", post(gateway, "nope-nope-nope-nope", "/v1/completions", {"model": "tab", "prompt": "x"}), 401),
        ("oversized", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x" * 300_000}), 413),
        ("malformed json", httpx.post(gateway + "/v1/completions", content=b"{nope", headers={
            "Authorization": f"Bearer {alice}", "Content-Type": "application/json"}), 422),
        ("wrong type", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x", "max_tokens": "many"}), 422),
        ("too many tokens", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x", "max_tokens": 100_000}), 400),
        ("unknown model", post(gateway, alice, "/v1/completions", {"model": "nope", "prompt": "x"}), 404),
        ("n > 1", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x", "n": 2}), 422),
        ("prompt over the context", post(gateway, alice, "/v1/completions", {"model": "tab", "prompt": "x = 1\n" * 2000}), 400),
        ("admin without token", httpx.post(gateway + "/admin/routes/tab/rollback", json={}), 401),
        ("admin with a client key", post(gateway, alice, "/admin/routes/tab/rollback", {}), 401),
        ("route to an unserved version", post(gateway, "sandbox-admin-token", "/admin/routes/tab/canary", {"version": 999, "weight": 0.1}), 409),
        ("weights not summing to 1", httpx.put(gateway + "/admin/routes/tab", json={"arms": [{"name": "control", "version": 1, "weight": 0.5}]},
                                               headers={"Authorization": "Bearer sandbox-admin-token"}), 422),
    ]
    for name, r, status in cases:
        assert r.status_code == status, (name, r.status_code, r.text)
        assert r.text and "Traceback" not in r.text and "alice-key" not in r.text, name
    log = Path(settings.log_dir / "gateway.log").read_text()
    assert keys["alice"] not in log and keys["bob"] not in log  # keys never reach the logs


def test_gateway_kill9_loses_no_acknowledged_completion(gateway, keys, platform, checkpoints, canary):
    acked, stop = [], threading.Event()

    def load():
        while not stop.is_set():
            try:
                r = post(gateway, keys["alice"], "/v1/completions", {"model": "tab", "prompt": PROMPT, "max_tokens": 1, "user": "kill"}, timeout=10)
                if r.status_code == 200:
                    acked.append(r.json()["id"])
            except httpx.HTTPError:
                time.sleep(0.05)  # gateway down: not acknowledged, nothing to keep

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(3)
    routes_before = platform.routes_client().show()["routes"]
    os.kill(platform.running("gateway").pid, signal.SIGKILL)
    time.sleep(1)
    platform.up_gateway()  # restarts it; the WAL left behind is recovered and uploaded
    assert platform.routes_client().show()["routes"] == routes_before  # the split survives a restart
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join()
    assert len(acked) > 20
    rows = wait_stored(checkpoints.store, "completions", set(acked), timeout=90)
    counts = {}
    for r in rows:
        counts[r["request_id"]] = counts.get(r["request_id"], 0) + 1
    assert [rid for rid in acked if counts.get(rid) != 1] == []  # each acknowledged completion exactly once


def test_object_store_outage_delays_uploads_but_loses_nothing(settings, keys, canary, tmp_path, s3_endpoint):
    """A second gateway logging to S3 (moto) behind a proxy that goes down mid-load."""
    proxy_port, gw_port = settings.prefect.port + SPARE, settings.prefect.port + SPARE + 1  # the sandbox's spare ports
    proxy = TcpProxy(int(s3_endpoint.rsplit(":", 1)[1]), proxy_port)
    gw = None
    try:
        proxy.start()
        make_bucket(s3_endpoint, "tidal-logs")
        store = S3Store("tidal-logs", "gw2", f"http://127.0.0.1:{proxy_port}", "us-east-1")
        config = settings.model_dump(mode="json")
        config.update(data_dir=str(tmp_path / "data"), store={"url": "s3://tidal-logs/gw2", "s3_endpoint_url": f"http://127.0.0.1:{proxy_port}"})
        config["gateway"]["port"] = gw_port
        (tmp_path / "tidal.yaml").write_text(yaml.safe_dump(config))
        gw = subprocess.Popen([sys.executable, "-m", "serving.gateway_app"], env={**os.environ, "TIDAL_CONFIG": str(tmp_path / "tidal.yaml")},
                              stdout=open(tmp_path / "gw.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{gw_port}"
        wait_http(url + "/health", 60, "second gateway", proc=gw, log=str(tmp_path / "gw.log"))
        time.sleep(1.5)
        acked = [complete(url, keys["bob"], f"s3-{i}")["id"] for i in range(20)]
        proxy.stop()  # the object store is unreachable
        acked += [complete(url, keys["bob"], f"s3-{i}")["id"] for i in range(20, 60)]  # serving goes on
        time.sleep(3)
        metrics = httpx.get(url + "/metrics").text
        assert 'gateway_wal{figure="upload_errors_total"}' in metrics
        assert float(metrics.split('gateway_wal{figure="upload_errors_total"} ')[1].split()[0]) > 0
        proxy.start()
        rows = wait_stored(store, "completions", set(acked), timeout=90)
        assert sorted(r["request_id"] for r in rows if r["request_id"] in set(acked)) == sorted(acked)
    finally:
        proxy.stop()
        if gw is not None:
            stop_group(gw.pid)


def test_replica_dying_before_first_byte_is_retried_on_another(gateway, keys, fleet, canary):
    victim = fleet.replicas("tab")[0]
    os.kill(victim["pid"], signal.SIGKILL)
    codes = [post(gateway, keys["alice"], "/v1/completions", {"model": "tab", "prompt": PROMPT, "max_tokens": 1, "user": f"f{i}"}).status_code
             for i in range(30)]
    assert codes == [200] * 30
