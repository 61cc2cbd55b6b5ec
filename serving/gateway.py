"""The gateway's logic: route a request to an arm, call the engine, log the completion durably,
shape the answer for the client; and validate feedback (signed ids, window, owner, once)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import orjson

from data_contracts.records import FeedbackEvent, SamplingParams, feedback_group
from data_contracts.suggestion_filter import withholds
from serving.api_models import ChatRequest, CompletionRequest, FeedbackRequest
from serving.completion_formats import CHAT, TEXT
from serving.engine_http import BrokenOff, ConnectFailed, EngineClient, EngineResponse, StaleConnection
from serving.feedback_checks import claim_key, conversation_problem, feedback_problem
from serving.feedback_ledger import CompletionLengths, FeedbackLedger
from serving.request_ids import InvalidRequestId, RequestIdSigner
from serving.routes import ArmSpec, ModelRoutes, RouteTable, arm_key, assign, assignment_key, user_hash, user_hash_key
from serving.upstream import Endpoint, NoReplica, ReplicaPool, Saturated, describe_failure
from tidal.clock import now_ms
from tidal.model_settings import FeedbackPolicy

log = logging.getLogger("tidal.gateway")
WATCHDOG_PERIOD_S = 1.0  # how often the canary watchdog looks: a missed deadline costs at most this much more


class GatewayError(Exception):
    """An error the client caused or can act on: HTTP status, message, optional headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class Limits:
    max_prompt_chars: int
    max_tokens: int
    feedback_window_ms: int
    upstream_timeout_s: float
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 30.0
    wal_append_timeout_s: float = 10.0
    feedback: dict[str, FeedbackPolicy] = field(default_factory=dict)  # model → the events it takes (default: Tab's)


@dataclass
class Routed:
    arm: ArmSpec
    served_name: str
    sampling: SamplingParams
    t0: float
    t0_ms: int
    min_first_logprob: float | None = None  # the version's suggestion filter (data_contracts/suggestion_filter.py)

    def withholds(self, logprobs: list[float]) -> bool:
        """Whether the version's suggestion filter withholds a completion with these (T,) engine log-probs."""
        return withholds(self.min_first_logprob, logprobs)


class Gateway:
    def __init__(
        self, routes: RouteTable, pool: ReplicaPool, sink, signer: RequestIdSigner, user_secret: bytes, limits: Limits, metrics
    ):
        self.routes, self.pool, self.sink, self.signer = routes, pool, sink, signer
        self.user_key, self.limits, self.metrics = user_hash_key(user_secret), limits, metrics
        self.arm_key = arm_key(user_secret)  # keys the canary assignment (serving/routes.py assign)
        self.session: aiohttp.ClientSession | None = None  # the fleet supervisor's API
        self.engines = EngineClient(limits.connect_timeout_s, limits.upstream_timeout_s)  # the replicas' engines
        self.feedback_seen = FeedbackLedger(limits.feedback_window_ms)  # request ids that have their verdict
        self.lengths = CompletionLengths(limits.feedback_window_ms)  # request id → characters suggested
        self.wal_stuck_since: float | None = None  # wall time of the first append not durable in time; None = healthy
        self._default_routes: dict[tuple[str, int], ModelRoutes] = {}  # (model, fleet serving version) → its one arm
        self._tasks: list[asyncio.Task] = []
        metrics.route_weights = routes.weights  # the route table, as gauges at each scrape
        routes.on_change = lambda c: metrics.route_changed(c.model, c.action, c.by)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10, sock_connect=self.limits.connect_timeout_s))
        self.sink.start()
        self.recall()
        try:
            await self.pool.refresh(self.session)
        except (TimeoutError, aiohttp.ClientError) as e:
            self.pool.last_error = f"fleet supervisor unreachable at start: {describe_failure(e)}"
        self._tasks.append(asyncio.create_task(self.pool.run(self.session)))
        self._tasks.append(asyncio.create_task(self.watch_canaries()))

    def recall(self) -> None:
        """What a restart must not forget, read back from the WAL: the verdicts given (duplicates stay refused) and
        the suggestions' lengths (an `accepted` verdict still counts its characters)."""
        for rec in self.sink.iter_recent("feedback"):
            self.feedback_seen.claim(claim_key(rec["request_id"], rec["event"]), rec["time_ms"])
        for rec in self.sink.iter_recent("completions"):
            self.lengths.add(rec["request_id"], len(rec.get("completion_text") or ""), rec["time_ms"])

    async def watch_canaries(self) -> None:
        """The release watchdog: a canary whose release missed its check-in deadline goes back to control (at start
        too, so a deadline that passed while the gateway was down is acted on at once)."""
        while True:
            try:
                for r in await asyncio.to_thread(self.routes.expire_watches):
                    self.metrics.watchdog.labels(r.model).inc()
                    log.warning("routes %s: %s", r.model, r.reason)
            except Exception:  # noqa: BLE001  (a full disk, say): logged, and tried again next period
                log.exception("canary watchdog pass failed")
            await asyncio.sleep(WATCHDOG_PERIOD_S)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        self.engines.close()
        await asyncio.to_thread(self.sink.stop)

    # ---- routing -------------------------------------------------------------------------------
    def model_routes(self, model: str) -> ModelRoutes:
        routes = self.routes.get(model)
        if routes is not None:
            return routes
        version = self.pool.snapshot.serving_version.get(model)
        if version is None:
            known = sorted(set(self.routes.all()) | set(self.pool.snapshot.serving_version))
            raise GatewayError(404, f"unknown model {model!r}; served models: {known}")
        default = self._default_routes.get((model, version))
        if default is None:  # built once per (model, version): validating a ModelRoutes per request cost ~3% of CPU
            default = ModelRoutes(
                model=model,
                arms=[ArmSpec(name="control", version=version, weight=1.0)],
                updated_ms=0,
                updated_by="fleet",
                reason="default: the fleet's serving version",
            )
            self._default_routes[(model, version)] = default
        return default

    def route(self, req: CompletionRequest | ChatRequest, client_id: str, max_tokens: int | None) -> Routed:
        t0 = time.perf_counter()
        max_tokens = 16 if max_tokens is None else max_tokens
        if max_tokens > self.limits.max_tokens:
            raise GatewayError(400, f"max_tokens {max_tokens} exceeds this gateway's limit of {self.limits.max_tokens}")
        arm = assign(self.model_routes(req.model), assignment_key(client_id, req.user), self.arm_key)
        sampling = arm.apply(
            SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                max_tokens=max_tokens,
                stop=req.stops(),
                seed=req.seed,
            )
        )
        served_name = f"{req.model}@v{arm.version}"
        return Routed(arm, served_name, sampling, t0, now_ms(), self.pool.snapshot.min_first_logprob.get(served_name))

    def engine_body(self, req, routed: Routed, extra: dict) -> dict:
        s = routed.sampling
        body = {
            "model": routed.served_name,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stream": req.stream,
            "return_token_ids": True,
            **extra,
        }
        if s.stop:
            body["stop"] = s.stop
        if s.seed is not None:
            body["seed"] = s.seed
        return body

    async def call_engine(self, path: str, served_name: str, body: dict) -> tuple[EngineResponse, Endpoint, int]:
        """POST to a replica serving served_name; returns the response, its replica and the in-flight token the
        caller releases (pool.release) once the response is read. Failing before the response headers (refused,
        no connection within connect_timeout_s, no headers within first_byte_timeout_s: a hung replica), the call
        is retried once: on another replica when there is one, else on the same one. Such a replica is put in
        penalty; a closed keep-alive connection (the engine timed it out as we reused it) is not."""
        try:
            eps = self.pool.candidates(served_name)
        except Saturated as e:
            raise GatewayError(503, str(e), {"Retry-After": "1"}) from None
        payload = orjson.dumps(body)
        tried, last = [], ""
        for ep in [eps[0], *(eps[1:2] or eps[:1])]:
            tried.append(ep.replica)
            token = self.pool.acquire(ep.replica)
            try:
                resp = await self.engines.post(ep.url, path, payload, self.limits.first_byte_timeout_s)
            except StaleConnection as e:
                self.pool.release(ep.replica, token)
                last = describe_failure(e)
                continue
            except (TimeoutError, ConnectFailed, BrokenOff) as e:
                self.pool.release(ep.replica, token)
                self.pool.penalize(ep.replica)
                self.metrics.failovers.labels(served_name.split("@")[0]).inc()
                last = describe_failure(e) if str(e) else f"no answer within {self.limits.first_byte_timeout_s:g} s"
                continue
            except BaseException:
                self.pool.release(ep.replica, token)
                raise
            if resp.status >= 400:
                try:
                    text = await resp.text(500)
                except (BrokenOff, TimeoutError):
                    text = "(its answer broke off)"
                resp.release()
                self.pool.release(ep.replica, token)
                status = 400 if resp.status < 500 else 502
                raise GatewayError(status, f"engine {ep.replica} refused the request ({resp.status}): {text}")
            return resp, ep, token
        raise GatewayError(503, f"{served_name}: failed before answering on {tried}: {last}")

    async def engine_json(self, path: str, served_name: str, body: dict) -> tuple[dict, Endpoint]:
        """A non-streaming answer, read whole, and its replica. A replica that dies after its response headers (a
        kill -9 mid-answer) breaks off the body; nothing has reached the user yet, so the call is made once more,
        with that replica in penalty (call_engine then picks another)."""
        for attempt in range(2):
            resp, ep, token = await self.call_engine(path, served_name, body)
            try:
                async with resp:
                    return orjson.loads(await resp.read()), ep
            except BrokenOff as e:
                self.pool.penalize(ep.replica)
                self.metrics.failovers.labels(served_name.split("@")[0]).inc()
                if attempt:
                    raise GatewayError(502, f"engine {ep.replica} broke off its answer: {describe_failure(e)}") from None
            except TimeoutError:
                raise GatewayError(
                    504,
                    f"engine {ep.replica} did not finish within {self.limits.upstream_timeout_s:g} s (gateway.upstream_timeout_s)",
                ) from None
            finally:
                self.pool.release(ep.replica, token)
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def durable(self, kind: str, record: dict) -> None:
        """Append to the WAL and wait until it is fsynced, at most wal_append_timeout_s: a stuck disk fails the
        request (503) and /health, instead of holding every request. The append itself goes on (asyncio.wait
        neither cancels it nor starts a task): a record late to the disk is still logged, and the first append
        that completes marks the WAL healthy."""
        written = self.sink.submit(kind, record)
        written.add_done_callback(self._append_done)
        await asyncio.wait((written,), timeout=self.limits.wal_append_timeout_s)
        if not written.done():
            self.wal_stuck_since = self.wal_stuck_since or time.time()
            raise GatewayError(
                503,
                f"the request log did not make this {kind} record durable within "
                f"{self.limits.wal_append_timeout_s:g} s (see /health); it is written once the "
                "disk recovers",
            )
        written.result()  # a failed write raises here

    def _append_done(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            self.wal_stuck_since = None

    def new_record(self, req, routed: Routed, client_id: str, rid: str, ep: Endpoint, prompt_text: str) -> dict:
        return {
            "request_id": rid,
            "time_ms": routed.t0_ms,
            "model": req.model,
            "version": routed.arm.version,
            "served_name": routed.served_name,
            "arm": routed.arm.name,
            "user_hash": user_hash(req.user or client_id, self.user_key),
            "client_id": client_id,
            "prompt_text": prompt_text,
            "replica": ep.replica,
            "sampling": routed.sampling.model_dump(),
        }

    async def log_completion(self, record: dict, routed: Routed) -> None:
        """The record (CompletionRecord's fields, built above from typed values) made durable. It is validated as a
        CompletionRecord where the WAL is uploaded, and quarantined with its reason if it fails: validating it here
        too cost ~6% of the gateway's CPU per completion and could only refuse the user after the engine's work."""
        record["latency_ms"] = (time.perf_counter() - routed.t0) * 1000
        await self.durable("completions", record)
        text = record["completion_text"]
        self.metrics.observe(record["model"], record["version"], record["arm"], record["latency_ms"], len(text))
        self.lengths.add(record["request_id"], len(text), record["time_ms"])

    # ---- completions ---------------------------------------------------------------------------
    async def complete(self, req: CompletionRequest, client_id: str, chat: bool = False):
        if not chat and req.echo:
            raise GatewayError(400, "echo=true is not supported")
        prompt_text = orjson.dumps([m.model_dump() for m in req.messages]).decode() if chat else req.prompt
        if len(prompt_text) > self.limits.max_prompt_chars:
            raise GatewayError(
                413, f"prompt has {len(prompt_text)} characters; this gateway accepts at most {self.limits.max_prompt_chars}"
            )
        conversation = self.conversation(req, client_id) if chat else None
        routed = self.route(req, client_id, (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens)
        fmt = CHAT if chat else TEXT
        if chat:
            extra = {"messages": [m.model_dump() for m in req.messages], "logprobs": True, "top_logprobs": req.top_logprobs or 0}
        else:
            extra = {"prompt": req.prompt, "logprobs": req.logprobs or 0}  # 0 still returns each sampled token's log-prob
        body = self.engine_body(req, routed, extra)
        try:
            if req.stream:
                resp, ep, token = await self.call_engine(fmt.path, routed.served_name, body)
            else:
                data, ep = await self.engine_json(fmt.path, routed.served_name, body)
        except NoReplica as e:
            self.metrics.errors.labels(req.model, routed.arm.version, routed.arm.name).inc()
            raise GatewayError(503, str(e)) from None
        except GatewayError as e:
            if e.status >= 500:  # the arm failed the user (canary guardrail); 4xx are the client's doing
                self.metrics.errors.labels(req.model, routed.arm.version, routed.arm.name).inc()
            raise
        rid = self.signer.issue(req.model, client_id, routed.t0_ms, version=routed.arm.version, arm=routed.arm.name)
        record = self.new_record(req, routed, client_id, rid, ep, prompt_text)
        if chat:  # a turn of a conversation: the first turn's id names it, the assistant replies so far its turn
            conversation = conversation or rid
            record.update(conversation_id=conversation, turn=sum(m.role == "assistant" for m in req.messages))
        if req.stream:
            meta = {"X-Tidal-Request-Id": rid, "X-Tidal-Version": str(routed.arm.version)}
            if chat:
                meta["X-Tidal-Conversation-Id"] = conversation
            return self.stream(resp, req, routed, record, fmt, ep, token), meta
        choice = data["choices"][0]
        text, ids, lps = fmt.extract(choice)
        withheld = routed.withholds(lps)
        record.update(
            completion_text="" if withheld else text,
            completion_token_ids=ids,
            behaviour_logprobs=lps,
            prompt_token_ids=choice.get("prompt_token_ids") or data.get("prompt_token_ids") or [],
            finish_reason="withheld" if withheld else choice.get("finish_reason") or "stop",
        )
        await self.log_completion(record, routed)  # durable before the client hears of it
        if withheld:
            self.metrics.withheld.labels(req.model, routed.arm.name).inc()
            choice = fmt.empty(choice)
        data["id"], data["model"] = rid, req.model
        data["choices"] = [fmt.for_client(choice, req)]
        if not getattr(req, "return_token_ids", False):
            data.pop("prompt_token_ids", None)
        data["tidal"] = {"request_id": rid, "version": routed.arm.version, "arm": routed.arm.name, "withheld": withheld}
        if chat:
            data["tidal"]["conversation_id"] = conversation
        return data

    async def stream(
        self, resp: EngineResponse, req, routed: Routed, record: dict, fmt, ep: Endpoint, token: int
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._relay(resp, req, routed, record, fmt):
                yield chunk
        finally:  # (a stream never started is dropped from the count after upstream_timeout_s)
            self.pool.release(ep.replica, token)

    async def _relay(self, resp: EngineResponse, req, routed: Routed, record: dict, fmt) -> AsyncIterator[bytes]:
        text, ids, lps, prompt_ids, finish = [], [], [], [], "stop"
        withheld: bool | None = None  # decided at the first chunk with a token: nothing of a withheld one is relayed
        tidal = {"request_id": record["request_id"], "version": routed.arm.version, "arm": routed.arm.name}
        done = False  # [DONE] seen: the rest (the chunked body's end) is read, so the connection is kept alive
        async with resp:
            async for lines in resp.line_batches():  # every event that has arrived: relayed in one write
                out = []
                for raw in lines:
                    if done:
                        break
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    chunk = orjson.loads(payload)
                    if not chunk.get("choices"):
                        continue
                    choice = chunk["choices"][0]
                    t, i, lp = fmt.extract(choice)
                    text.append(t)
                    ids.extend(i)
                    lps.extend(lp)
                    prompt_ids = prompt_ids or choice.get("prompt_token_ids") or chunk.get("prompt_token_ids") or []
                    finish = choice.get("finish_reason") or finish
                    if withheld is None and lp:
                        withheld = routed.withholds(lps)
                    if withheld:
                        continue
                    chunk["id"], chunk["model"] = record["request_id"], req.model
                    chunk["choices"] = [fmt.for_client(choice, req)]
                    chunk.pop("prompt_token_ids", None)
                    chunk["tidal"] = tidal
                    out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if out:
                    yield b"".join(out)
        record.update(
            completion_text="" if withheld else "".join(text),
            completion_token_ids=ids,
            behaviour_logprobs=lps,
            prompt_token_ids=prompt_ids,
            finish_reason="withheld" if withheld else finish,
        )
        await self.log_completion(record, routed)  # [DONE] only after the record is durable
        if withheld:
            self.metrics.withheld.labels(req.model, routed.arm.name).inc()
        yield b"data: [DONE]\n\n"

    # ---- feedback ------------------------------------------------------------------------------
    def conversation(self, req: ChatRequest, client_id: str) -> str | None:
        """The turn's conversation id, checked (serving/feedback_checks.py); None: the turn starts one."""
        problem = conversation_problem(self.signer, req.conversation_id, req.model, client_id)
        if problem is not None:
            raise GatewayError(*problem)
        return req.conversation_id

    async def feedback(self, req: FeedbackRequest, client_id: str) -> FeedbackEvent:
        try:
            claims = self.signer.verify(req.request_id)
        except InvalidRequestId as e:
            self.metrics.feedback.labels("rejected_" + e.reason).inc()
            raise GatewayError(400, f"unknown or forged request id ({e.reason}): {e}") from None
        if claims.client_id != client_id:
            self.metrics.feedback.labels("rejected_client").inc()
            raise GatewayError(
                403, "this request id belongs to another client; feedback must come from the client that made the request"
            )
        now = now_ms()
        if now - claims.time_ms > self.limits.feedback_window_ms:
            self.metrics.feedback.labels("rejected_late").inc()
            raise GatewayError(
                410,
                f"feedback window closed: the completion is {(now - claims.time_ms) / 1000:.0f} s old, "
                f"the window is {self.limits.feedback_window_ms / 1000:.0f} s",
            )
        policy = self.limits.feedback.get(claims.model) or FeedbackPolicy()
        problem = feedback_problem(req, claims.model, policy)
        if problem is not None:
            self.metrics.feedback.labels("rejected_invalid").inc()
            raise GatewayError(422, problem)
        key = claim_key(req.request_id, req.event)
        if not self.feedback_seen.claim(key, now):  # claimed before the await: a concurrent duplicate sees it
            self.metrics.feedback.labels("rejected_duplicate").inc()
            group = feedback_group(req.event)
            raise GatewayError(
                409,
                f"a '{group}' event for this request id was already recorded (one per completion: a Tab verdict, a "
                "score, a thumbs and an edit)",
            )
        event = FeedbackEvent(
            request_id=req.request_id,
            time_ms=now,
            model=claims.model,
            event=req.event,
            accepted_chars=req.accepted_chars,
            client_id=client_id,
            score=req.score,
            thumbs=req.thumbs,
            edit_text=req.edit_text,
        )
        try:
            await self.durable("feedback", event.model_dump())
        except GatewayError:  # not durable in time, but still being written: the verdict stays claimed
            raise
        except BaseException:
            self.feedback_seen.release(key)
            raise
        self.metrics.feedback.labels(req.event).inc()
        if feedback_group(req.event) == "verdict":  # the Tab metrics: accept rate, characters kept, the rule's reward
            length = self.lengths.pop(req.request_id)
            self.metrics.verdict(claims.model, claims.version, claims.arm, req.event, req.accepted_chars, length)
        return event
