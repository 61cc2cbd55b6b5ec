"""Gateway pieces that need no servers: the rate limiter, the body limit, the replica pool."""

from __future__ import annotations

import asyncio
import time

import pytest

from serving.fleet_replies import FleetState, ModelStatus, ReplicaState, ReplicaStatus
from serving.gateway import GatewayError
from serving.gateway_app import BodyLimit
from serving.gateway_metrics import RateLimiter
from serving.upstream import NoReplica, ReplicaPool


def replica(name: str, url: str, served: dict[str, int], state: ReplicaState = "ready") -> ReplicaStatus:
    return ReplicaStatus(name=name, state=state, url=url, pid=None, base_version=1, served=served, restarts=0, last_error="")


def fleet(*replicas: ReplicaStatus) -> FleetState:
    """The supervisor's status for one model, tab, served on v1 by `replicas`."""
    tab = ModelStatus(
        strategy="reload",
        base_version=1,
        serving_version=1,
        adapters=[],
        surge_versions=[],
        desired_replicas=len(replicas),
        replicas=list(replicas),
    )
    return FleetState(engine_flavor="cpu", runtime="local", models={"tab": tab})


def test_rate_limiter_allows_a_burst_then_says_when_to_retry():
    limiter = RateLimiter(rate=10.0, burst=3)
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.take("a")
    assert 0.0 < wait <= 0.1 + 1e-9  # one token refills in 1/rate s
    assert limiter.take("b") == 0.0  # buckets are per client
    time.sleep(wait + 0.01)
    assert limiter.take("a") == 0.0


def _run_body_limit(body_chunks: list[bytes], declared: int | None, max_bytes: int):
    sent, reached = [], []

    async def app(scope, receive, send):
        while True:
            msg = await receive()
            reached.append(msg)
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    messages = [{"type": "http.request", "body": c, "more_body": i < len(body_chunks) - 1} for i, c in enumerate(body_chunks)]

    async def receive():
        return messages.pop(0)

    async def send(msg):
        sent.append(msg)

    headers = [(b"content-length", str(declared).encode())] if declared is not None else []
    asyncio.run(BodyLimit(app, max_bytes)({"type": "http", "headers": headers}, receive, send))
    return sent[0]["status"], reached


def test_body_limit_refuses_declared_and_streamed_oversize():
    assert _run_body_limit([b"x" * 10], 10, 100)[0] == 200
    status, reached = _run_body_limit([b"x" * 10], 1000, 100)
    assert status == 413 and reached == []  # refused before the app read anything
    status, _ = _run_body_limit([b"x" * 60, b"x" * 60], None, 100)  # chunked, no length declared
    assert status == 413


def test_pool_rotates_ready_replicas_and_puts_failed_ones_last():
    pool = ReplicaPool("http://unused", "t", poll_s=1.0, penalty_s=30.0)
    pool.apply(
        fleet(
            replica("tab-0", "http://a", {"tab@v1": 1, "tab@v2": 2}),
            replica("tab-1", "http://b", {"tab@v1": 1}),
            replica("tab-2", "http://c", {"tab@v1": 1}, state="starting"),
        )
    )
    assert pool.snapshot.serving_version == {"tab": 1}
    firsts = {pool.candidates("tab@v1")[0].replica for _ in range(4)}
    assert firsts == {"tab-0", "tab-1"}  # round robin, never the starting replica
    assert [e.replica for e in pool.candidates("tab@v2")] == ["tab-0"]
    pool.penalize("tab-0")
    assert [pool.candidates("tab@v1")[0].replica for _ in range(3)] == ["tab-1"] * 3
    with pytest.raises(NoReplica, match="tab@v9"):
        pool.candidates("tab@v9")


def test_gateway_error_carries_status_and_headers():
    e = GatewayError(429, "slow down", {"Retry-After": "1"})
    assert (e.status, e.message, e.headers) == (429, "slow down", {"Retry-After": "1"})


def _app_without_engines(tmp_path, rate: float, burst: int, pool: ReplicaPool | None = None, limits=None):
    """The real app and Gateway, its lifespan not run: no engine, no log upload needed for these paths."""
    import hashlib

    from serving.gateway_app import build_app

    gw = _gateway(tmp_path, pool, limits)
    clients = {hashlib.sha256(b"alice-key-0123456789").hexdigest(): "alice"}
    return build_app(gw, clients, "admin-token-0123456789", RateLimiter(rate, burst), 4096)


def _gateway(tmp_path, pool: ReplicaPool | None = None, limits=None):
    """The real Gateway over a local WAL and store; no engine session until a test opens one."""
    from serving.gateway import Gateway, Limits
    from serving.gateway_metrics import GatewayMetrics
    from serving.logsink import LogSink, LogSinkSettings
    from serving.request_ids import RequestIdSigner
    from serving.routes import RouteTable
    from tidal.store import LocalStore

    sink = LogSink(tmp_path / "wal", LocalStore(tmp_path / "store"), LogSinkSettings())
    if pool is None:
        pool = ReplicaPool("http://unused", "t", poll_s=1.0)
        pool.apply(fleet())
    return Gateway(
        RouteTable(tmp_path / "routes.json"),
        pool,
        sink,
        RequestIdSigner(b"k" * 32),
        b"u" * 32,
        limits or Limits(1000, 64, 60_000, 5.0),
        GatewayMetrics(sink.metrics),
    )


def test_rate_limit_answers_429_with_retry_after(tmp_path):
    from fastapi.testclient import TestClient

    client = TestClient(_app_without_engines(tmp_path, rate=0.5, burst=2))
    auth = {"Authorization": "Bearer alice-key-0123456789"}
    codes = [client.get("/v1/models", headers=auth).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    r = client.get("/v1/models", headers=auth)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and "retry in" in r.json()["error"]["message"]
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_routes_need_the_admin_token_and_a_served_version(tmp_path):
    from fastapi.testclient import TestClient

    client = TestClient(_app_without_engines(tmp_path, rate=100, burst=100))
    body = {"version": 2, "weight": 0.1}
    assert client.post("/admin/routes/tab/canary", json=body).status_code == 401
    r = client.post("/admin/routes/tab/canary", json=body, headers={"Authorization": "Bearer admin-token-0123456789"})
    assert r.status_code == 409 and "tab@v2" in r.json()["error"]["message"]  # not served by any replica


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"\xff\xfe",
        b"[]",
        b'{"model": "tab", "prompt": 5}',
        b'{"model": "tab", "prompt": "x", "temperature": NaN}',
        b'{"model": "tab", "prompt": "sk-secret", "max_tokens": 1e400}',
    ],
)
def test_malformed_completion_bodies_get_422_naming_the_field_without_echoing_it(tmp_path, path, body):
    from fastapi.testclient import TestClient

    client = TestClient(_app_without_engines(tmp_path, rate=100, burst=100))
    r = client.post(
        path, content=body, headers={"Authorization": "Bearer alice-key-0123456789", "Content-Type": "application/json"}
    )
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert errors and all(e["loc"][0] == "body" and e["msg"] and "input" not in e for e in errors)
    assert "sk-secret" not in r.text
    # authentication still comes first
    assert client.post(path, content=body, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_a_failing_fleet_poll_never_shows_the_admin_token(tmp_path, caplog):
    """The supervisor answering an error status made aiohttp's ClientResponseError, whose repr carries the
    request's headers (Authorization included), the pool's last_error: /health returned the admin token and
    the gateway logged it every poll."""
    import http.server
    import threading

    from fastapi.testclient import TestClient

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"supervisor error")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = "admin-token-never-shown-0123"
    try:
        pool = ReplicaPool(f"http://127.0.0.1:{server.server_address[1]}", token, poll_s=0.05)
        app = _app_without_engines(tmp_path, rate=100, burst=100, pool=pool)
        with caplog.at_level("WARNING", logger="tidal.gateway.upstream"), TestClient(app) as client:
            time.sleep(0.3)  # a few polls
            health = client.get("/health").json()
    finally:
        server.shutdown()
    assert "HTTP 500" in health["fleet"] and "/fleet" in health["fleet"], health
    assert token not in health["fleet"] and "Bearer" not in health["fleet"]
    assert caplog.records and all(token not in r.getMessage() for r in caplog.records)


def test_refused_requests_on_random_paths_add_no_metric_series(tmp_path):
    """Request metrics were labelled with the raw path, so each 401 on a random admin path made a new series:
    unauthenticated callers could grow the gateway's memory without bound."""
    import uuid

    from fastapi.testclient import TestClient

    client = TestClient(_app_without_engines(tmp_path, rate=100, burst=100))

    def series() -> set[str]:
        text = client.get("/metrics").text
        return {line.split(" ")[0] for line in text.splitlines() if line.startswith("gateway_requests_total{")}

    for _ in range(50):
        name = uuid.uuid4().hex
        assert client.put(f"/admin/routes/{name}", json={"arms": []}).status_code == 401
        assert client.post(f"/admin/routes/{name}/rollback", json={}).status_code == 401
    assert series() == {
        'gateway_requests_total{code="401",endpoint="/admin/routes/{model}"}',
        'gateway_requests_total{code="401",endpoint="/admin/routes/{model}/rollback"}',
    }


def test_a_logged_user_hash_never_reveals_the_request_id_signing_key(tmp_path):
    """User hashes were keyed by the gateway secret itself, and the request-id key is HMAC(secret, its label): a
    client sending that label as its user id had the signing key's first half logged as its user hash."""
    import hmac

    from serving.gateway import Gateway, Limits
    from serving.gateway_metrics import GatewayMetrics
    from serving.logsink import LogSink, LogSinkSettings
    from serving.request_ids import _KEY_LABEL, RequestIdSigner
    from serving.routes import RouteTable, user_hash
    from tidal.store import LocalStore

    secret = b"gateway-secret-0123456789abcdef"
    sink = LogSink(tmp_path / "wal", LocalStore(tmp_path / "store"), LogSinkSettings())
    gw = Gateway(
        RouteTable(tmp_path / "routes.json"),
        ReplicaPool("http://unused", "t" * 16, poll_s=1.0),
        sink,
        RequestIdSigner(secret),
        secret,
        Limits(1000, 64, 60_000, 5.0),
        GatewayMetrics(sink.metrics),
    )
    signing_key = hmac.digest(secret, _KEY_LABEL, "sha256")
    logged = user_hash(_KEY_LABEL.decode(), gw.user_key)
    assert logged != signing_key[:16].hex() and gw.user_key not in (secret, signing_key)


def test_a_request_finding_every_replica_at_its_in_flight_cap_gets_503_with_retry_after(tmp_path):
    """Nothing bounded the engine calls in flight: one client could pile any number onto a replica."""
    from fastapi.testclient import TestClient

    pool = ReplicaPool("http://unused", "t" * 16, poll_s=1.0, max_in_flight=2, call_limit_s=60.0)
    pool.apply(fleet(replica("tab-0", "http://127.0.0.1:9", {"tab@v1": 1})))
    tokens = [pool.acquire("tab-0") for _ in range(2)]
    client = TestClient(_app_without_engines(tmp_path, rate=100, burst=100, pool=pool))
    r = client.post(
        "/v1/completions", json={"model": "tab", "prompt": "x"}, headers={"Authorization": "Bearer alice-key-0123456789"}
    )
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert "2 requests in flight" in r.json()["error"]["message"] and "max_in_flight_per_replica" in r.json()["error"]["message"]
    pool.release("tab-0", tokens[0])
    assert pool.in_flight("tab-0") == 1 and [e.replica for e in pool.candidates("tab@v1")] == ["tab-0"]


def test_a_call_token_a_lost_stream_never_released_expires_after_the_call_limit(monkeypatch):
    pool = ReplicaPool("http://unused", "t" * 16, poll_s=1.0, max_in_flight=1, call_limit_s=30.0)
    pool.acquire("tab-0")
    assert pool.in_flight("tab-0") == 1
    later = time.monotonic() + 31
    monkeypatch.setattr("serving.upstream.time.monotonic", lambda: later)
    assert pool.in_flight("tab-0") == 0


def test_a_stuck_wal_fails_requests_and_health_within_its_timeout_then_recovers(tmp_path, monkeypatch):
    """Only a 120 s total timeout existed: a disk that stopped acknowledging fsyncs held every request, and
    /health still said ok."""
    import os
    import threading
    import types

    import orjson
    from fastapi.testclient import TestClient

    import serving.wal as wal_module
    from serving.gateway import Limits
    from serving.request_ids import RequestIdSigner

    stuck, disk = threading.Event(), threading.Event()  # stuck: fsyncs hang until the disk answers again
    real_fsync = os.fsync

    def fsync(fd):
        if stuck.is_set():
            disk.wait(30)
        real_fsync(fd)

    proxy = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    proxy.fsync = fsync
    monkeypatch.setattr(wal_module, "os", proxy)
    app = _app_without_engines(tmp_path, rate=100, burst=100, limits=Limits(1000, 64, 60_000, 5.0, wal_append_timeout_s=0.3))
    rid = RequestIdSigner(b"k" * 32).issue("tab", "alice", int(time.time() * 1000))
    auth = {"Authorization": "Bearer alice-key-0123456789"}
    with TestClient(app) as client:
        stuck.set()
        t0 = time.monotonic()
        r = client.post("/v1/feedback", json={"request_id": rid, "event": "accepted"}, headers=auth)
        waited = time.monotonic() - t0
        assert r.status_code == 503 and "durable within 0.3 s" in r.json()["error"]["message"], r.text
        assert waited < 10  # the stuck disk holds the request for the timeout, not for good
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["ok"] is False and "not durable" in health.json()["wal"]
        # the verdict stays claimed: it is still being written
        assert client.post("/v1/feedback", json={"request_id": rid, "event": "accepted"}, headers=auth).status_code == 409
        disk.set()
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["ok"] is True and health.json()["wal"] == "ok"
    written = [
        orjson.loads(line)["request_id"]
        for p in (tmp_path / "wal" / "feedback").iterdir()
        for line in p.read_bytes().splitlines()
    ]
    assert written == [rid]  # written once the disk recovered


def test_the_gateway_rolls_back_a_canary_whose_release_stops_checking_in(tmp_path):
    """A release that died mid-ramp (killed, crashed, an MLflow error raised out of the flow) left its canary
    routed with nothing watching it. The gateway now rolls a watched canary back once its release misses a check-in."""
    from fastapi.testclient import TestClient

    pool = ReplicaPool("http://127.0.0.1:9", "t" * 16, poll_s=60.0)
    pool.apply(fleet(replica("tab-0", "http://127.0.0.1:9", {"tab@v1": 1, "tab@v2": 2})))
    admin = {"Authorization": "Bearer admin-token-0123456789"}
    with TestClient(_app_without_engines(tmp_path, rate=100, burst=100, pool=pool)) as client:
        r = client.post("/admin/routes/tab/canary", headers=admin, json={"version": 2, "weight": 0.05, "watch_s": 1.5})
        assert r.status_code == 200 and r.json()["watch_until_ms"] is not None, r.text
        for _ in range(3):  # checking in keeps it routed past its first deadline
            time.sleep(0.8)
            assert (
                client.post("/admin/routes/tab/canary/watch", headers=admin, json={"version": 2, "watch_s": 1.5}).status_code
                == 200
            )
        t0 = time.monotonic()
        while client.get("/admin/routes", headers=admin).json()["routes"]["tab"]["updated_by"] != "watchdog":
            assert time.monotonic() - t0 < 10, "the watchdog never rolled the canary back"
            time.sleep(0.1)
        waited = time.monotonic() - t0
        arms = client.get("/admin/routes", headers=admin).json()["routes"]["tab"]["arms"]
        late = client.post("/admin/routes/tab/canary/watch", headers=admin, json={"version": 2, "watch_s": 1.5})
        metrics = client.get("/metrics").text
    assert 0.5 < waited < 1.5 + 1.0 + 0.5, waited  # the deadline, plus at most one watchdog period
    assert [(a["name"], a["version"], a["weight"]) for a in arms] == [("control", 1, 1.0)]
    assert late.status_code == 409 and "watchdog" in late.json()["error"]["message"]
    assert 'gateway_canary_watchdog_rollbacks_total{model="tab"} 1.0' in metrics


class _Engine:
    """A raw HTTP engine on 127.0.0.1 for one test: `broken` sends its headers and closes before the body (a replica
    killed mid-answer), else it answers one completion."""

    ANSWER = (
        b'{"choices": [{"text": "ab", "token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.1, -0.2]},'
        b' "prompt_token_ids": [5], "finish_reason": "stop"}]}'
    )

    def __init__(self, broken: bool, answer: bytes = ANSWER, content_type: str = "application/json"):
        import socket
        import threading

        self.broken, self.hits, self.answer, self.content_type = broken, 0, answer, content_type
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.hits += 1
                body = b"" if self.broken else self.answer
                conn.sendall(
                    f"HTTP/1.1 200 OK\r\nContent-Type: {self.content_type}\r\nConnection: close\r\n".encode()
                    + f"Content-Length: {len(self.answer)}\r\n\r\n".encode()
                    + body
                )


def test_a_replica_dying_after_its_headers_is_retried_on_another_and_the_user_never_sees_it(tmp_path):
    """A kill -9 between an engine's headers and its body reached users as a 500 (ClientPayloadError on the read)."""
    broken, good = _Engine(broken=True), _Engine(broken=False)
    pool = ReplicaPool("http://unused", "t" * 16, poll_s=1.0)
    pool.apply(fleet(replica("tab-0", broken.url, {"tab@v1": 1}), replica("tab-1", good.url, {"tab@v1": 1})))
    gw = _gateway(tmp_path, pool)

    async def three_answers() -> list[tuple[dict, str]]:
        return [await gw.engine_json("/v1/completions", "tab@v1", {"prompt": "x"}) for _ in range(3)]

    answers = asyncio.run(three_answers())  # the pool rotates, so the broken replica is tried first at least once
    assert [(data["choices"][0]["text"], ep.replica) for data, ep in answers] == [("ab", "tab-1")] * 3
    assert broken.hits >= 1 and good.hits == 3
    assert pool.in_flight("tab-0") == pool.in_flight("tab-1") == 0  # every call's token released
    broken.sock.close()
    good.sock.close()


def _sse(*chunks: dict) -> bytes:
    import orjson

    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("first_logprob", [-5.0, -0.1])
def test_a_versions_suggestion_filter_withholds_an_unlikely_completion_and_logs_what_was_sampled(tmp_path, stream, first_logprob):
    """tab@v1's filter withholds below -3: the client gets an empty completion (streamed: no text chunk), and the log
    holds the sampled tokens with finish_reason 'withheld' and empty text (what the user saw), never a training row."""
    from serving.api_models import CompletionRequest

    tokens = [
        {"choices": [{"text": t, "token_ids": [i], "logprobs": {"token_logprobs": [lp]}, "finish_reason": None}]}
        for t, i, lp in (("ab", 1, first_logprob), ("c", 2, -0.2))
    ]
    answer = _sse(*tokens) if stream else _Engine.ANSWER.replace(b"-0.1", str(first_logprob).encode())
    engine = _Engine(broken=False, answer=answer, content_type="text/event-stream" if stream else "application/json")
    status = fleet(replica("tab-0", engine.url, {"tab@v1": 1}))
    status.models["tab"] = status.models["tab"].model_copy(update={"suggestion_filters": {1: -3.0}})
    pool = ReplicaPool("http://unused", "t" * 16, poll_s=1.0)
    pool.apply(status)
    gw = _gateway(tmp_path, pool)
    req = CompletionRequest(model="tab", prompt="x", max_tokens=4, stream=stream)

    async def one() -> tuple[str, object]:
        out = await gw.complete(req, "alice")
        if not stream:
            return out["choices"][0]["text"], out["tidal"]["withheld"]
        body, _ = out
        return b"".join([c async for c in body]).decode(), None

    gw.sink.start()
    try:
        text, flag = asyncio.run(one())
        (record,) = list(gw.sink.iter_recent("completions"))
    finally:
        gw.sink.stop()
        engine.sock.close()
    withheld = first_logprob < -3.0
    assert record["completion_token_ids"] == [1, 2] and record["behaviour_logprobs"][0] == pytest.approx(first_logprob)
    assert record["finish_reason"] == ("withheld" if withheld else "stop")
    assert record["completion_text"] == ("" if withheld else "abc" if stream else "ab")
    if stream:
        assert ('"ab"' in text) is (not withheld) and text.endswith("data: [DONE]\n\n")
    else:
        assert (text, flag) == (("", True) if withheld else ("ab", False))
    assert gw.metrics.withheld.labels("tab", "control")._value.get() == float(withheld)


def test_verdicts_and_characters_are_counted_per_version_and_arm_across_a_restart(tmp_path):
    """Feedback was counted by outcome only: the accept rate and accepted characters of a served version were not
    in the metrics. A verdict carries its version and arm in its signed id; `accepted` takes the suggestion's
    length from the completions this gateway logged (its WAL after a restart)."""
    from prometheus_client.parser import text_string_to_metric_families

    from serving.api_models import CompletionRequest, FeedbackRequest
    from serving.routes import ArmSpec, ModelRoutes

    engine = _Engine(broken=False)  # answers "ab"
    pool = ReplicaPool("http://unused", "t" * 16, poll_s=1.0)
    pool.apply(fleet(replica("tab-0", engine.url, {"tab@v1": 1})))

    async def complete(gw) -> str:
        try:
            return (await gw.complete(CompletionRequest(model="tab", prompt="x", max_tokens=4), "alice"))["id"]
        finally:
            gw.engines.close()  # its connections belong to this event loop

    def samples(gw) -> dict[tuple, float]:
        text = gw.metrics.render().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if not s.name.endswith("_created")
        }

    served = (("arm", "control"), ("model", "tab"), ("version", "1"))
    gw = _gateway(tmp_path, pool)
    gw.sink.start()
    try:
        first, second = asyncio.run(complete(gw)), asyncio.run(complete(gw))
        asyncio.run(gw.feedback(FeedbackRequest(request_id=first, event="accepted"), "alice"))
        asyncio.run(gw.feedback(FeedbackRequest(request_id=second, event="partial", accepted_chars=1), "alice"))
        third = asyncio.run(complete(gw))
        m = samples(gw)
    finally:
        gw.sink.stop()
    assert m[("gateway_completions_total", served)] == 3 and m[("gateway_suggested_chars_total", served)] == 6
    assert m[("gateway_verdicts_total", (served[0], ("event", "accepted"), *served[1:]))] == 1
    assert m[("gateway_verdicts_total", (served[0], ("event", "partial"), *served[1:]))] == 1
    assert m[("gateway_accepted_chars_total", served)] == 2 + 1

    restarted = _gateway(tmp_path, pool)  # same WAL: the third suggestion's length is read back at start
    restarted.sink.start()
    try:
        restarted.recall()  # what Gateway.start does after starting the sink
        asyncio.run(restarted.feedback(FeedbackRequest(request_id=third, event="accepted"), "alice"))
        legacy = restarted.signer.issue("tab", "alice", third_time := int(time.time() * 1000))  # no version, no arm
        asyncio.run(restarted.feedback(FeedbackRequest(request_id=legacy, event="accepted"), "alice"))
        arms = [ArmSpec(name="control", version=1, weight=1.0)]
        restarted.routes.set(ModelRoutes(model="tab", arms=arms, updated_ms=third_time, updated_by="test", reason="r"))
        m = samples(restarted)
    finally:
        restarted.sink.stop()
        engine.sock.close()
    assert m[("gateway_accepted_chars_total", served)] == 2
    unknown = (("arm", "unknown"), ("event", "accepted"), ("model", "tab"), ("version", "unknown"))
    assert m[("gateway_verdicts_total", unknown)] == 1
    assert m[("gateway_accepted_chars_unknown_total", (("model", "tab"),))] == 1
    assert m[("gateway_route_weight", (("arm", "control"), ("model", "tab"), ("version", "1")))] == 1.0
    assert m[("gateway_route_changes_total", (("action", "set"), ("by", "test"), ("model", "tab")))] == 1


def test_scores_thumbs_and_edits_are_taken_once_each_and_refused_with_the_field_named(tmp_path):
    """Through the gateway's app: a model's events each once per completion beside its Tab verdict, into the WAL with
    their fields; what the model does not take gets 422 naming the field; a second of a group gets 409."""
    import orjson
    from fastapi.testclient import TestClient

    from serving.gateway import Limits
    from serving.request_ids import RequestIdSigner
    from tidal.model_settings import FeedbackPolicy

    policy = FeedbackPolicy(events=["accepted", "rejected", "partial", "score", "thumbs", "edit"], score_range=(0, 10))
    limits = Limits(1000, 64, 60_000, 5.0, feedback={"tab": policy})
    app = _app_without_engines(tmp_path, rate=100, burst=100, limits=limits)
    now = int(time.time() * 1000)
    rid, plain = (RequestIdSigner(b"k" * 32).issue(m, "alice", now) for m in ("tab", "tabfull"))
    auth = {"Authorization": "Bearer alice-key-0123456789"}
    with TestClient(app) as client:

        def post(body: dict, request_id: str = rid):
            return client.post("/v1/feedback", json={"request_id": request_id, **body}, headers=auth)

        for body in ({"event": "accepted"}, {"event": "score", "score": 7.5}, {"event": "thumbs", "thumbs": "up"}):
            assert post(body).status_code == 200, post(body).text
        assert post({"event": "edit", "edit_text": "kept"}).json() == {"request_id": rid, "event": "edit", "recorded": True}
        again = post({"event": "score", "score": 2})
        assert again.status_code == 409 and "a 'score' event for this request id was already recorded" in again.text
        assert post({"event": "partial", "accepted_chars": 1}).status_code == 409  # one Tab verdict
        out_of_range = post({"event": "score", "score": 11}, plain)
        assert out_of_range.status_code == 422 and "event: 'score' is not an event model 'tabfull' takes" in out_of_range.text
        assert (
            "score_range [0, 10]"
            in post({"event": "score", "score": -1}, RequestIdSigner(b"k" * 32).issue("tab", "alice", now + 1)).text
        )
    written = sorted(
        (orjson.loads(line) for p in (tmp_path / "wal" / "feedback").iterdir() for line in p.read_bytes().splitlines()),
        key=lambda r: ["accepted", "score", "thumbs", "edit"].index(r["event"]),
    )
    assert [(r["event"], r["score"], r["thumbs"], r["edit_text"], r["source"]) for r in written] == [
        ("accepted", None, None, None, "user"),
        ("score", 7.5, None, None, "user"),
        ("thumbs", None, "up", None, "user"),
        ("edit", None, None, "kept", "user"),
    ]
