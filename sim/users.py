"""Simulated Tab users: they request completions through the gateway with the official OpenAI SDK and
send feedback judged only against the code they were about to type — never from model internals.

The verdict (one user, one suggestion s, intended rest of the line t):
    s empty                                        → no feedback (nothing was shown)
    s is a prefix of t and len(s) >= min_chars     → accepted
    s and t share a prefix of k >= min_chars chars → partial, accepted_chars = k (kept up to the first mismatch)
    otherwise                                      → rejected
Users differ: each has its own minimum length (a one-character suggestion is not worth a keystroke),
its own pause between requests (typing speed) and its own feedback delay, all drawn from a seeded
population, so a run is reproducible given the seed (up to the order concurrent requests arrive in).
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import Field, model_validator

from sim.daily_curve import DailyCurve
from sim.tab_sites import TabSite, cursor_sites, site_files
from tidal.section import Section


class SimUsersConfig(Section):
    users: int = Field(400, ge=1, description="Simulated users (each sticks to one canary arm by its id).")
    seed: int = Field(7, description="Seeds the population, the cursor sites and each request's sampling seed.")
    sites: int = Field(4000, ge=1, description="Distinct cursor sites drawn from the traffic files (re-used round-robin).")
    concurrency: int = Field(4, ge=1, description="Requests in flight at once.")
    max_tokens: int = Field(16, ge=1, description="Completion budget a Tab request asks for.")
    temperature: float = Field(
        1.0,
        ge=0,
        le=2,
        description=(
            "Sampling temperature of Tab requests. PPO weighs rows of any temperature above 0 correctly (the engines log "
            "mu after the scaling); lower shows better suggestions but explores less, and greedy (0) rows are not trained on."
        ),
    )
    stop: list[str] = Field(
        default_factory=lambda: ["\n"],
        description=(
            "Stop strings of Tab requests: single-line suggestions by default, as editors ask for them. The policy "
            "ends a suggestion by sampling a line break (a frequent token, so PPO explores where to stop); one "
            "sampled first means nothing is shown."
        ),
    )
    min_chars: tuple[int, int] = Field((3, 6), description="Range of the per-user minimum accepted length (chars), inclusive.")
    think_s: tuple[float, float] = Field((0.0, 0.5), description="Range of a user's pause before each request (typing speed).")
    feedback_delay_s: tuple[float, float] = Field(
        (0.2, 2.0), description="Range of a user's delay between suggestion and verdict."
    )
    context_bytes: int = Field(
        480,
        ge=16,
        description=(
            "Code before the cursor sent as the prompt, in UTF-8 bytes: a byte-level BPE token covers at least one byte, "
            "so 480 bytes + max_tokens always fit the engines' 512-token context."
        ),
    )
    eval_fraction: float = Field(0.5, gt=0, lt=1, description="Share of held-out files kept for evaluation (never in traffic).")
    code_dir: Path | None = Field(
        None, description="A directory of Python code to draw sites from instead of the stdlib's held-out files."
    )
    daily: DailyCurve | None = Field(
        None,
        description=(
            "A day of traffic, compressed (sim/daily_curve.py): requests are sent at the curve's rate, at most "
            "`concurrency` in flight, and a user's latency counts from the moment its request was due. None: the users "
            "send as fast as the engines answer (a closed loop, each after its think time)."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> SimUsersConfig:
        for name in ("min_chars", "think_s", "feedback_delay_s"):
            lo, hi = getattr(self, name)
            if lo < 0 or hi < lo:
                raise ValueError(f"sim {name}={[lo, hi]}: need 0 <= low <= high")
        if self.min_chars[0] < 1:
            raise ValueError("sim min_chars must start at >= 1: an empty prefix is no acceptance")
        return self


@dataclass(frozen=True)
class UserProfile:
    user_id: str
    min_chars: int  # shortest suggestion this user accepts
    think_s: float  # pause before each request
    feedback_delay_s: float  # suggestion shown → verdict sent


def population(cfg: SimUsersConfig) -> list[UserProfile]:
    rng = random.Random(f"users/{cfg.seed}")
    return [
        UserProfile(
            f"sim-{cfg.seed}-{i}", rng.randint(*cfg.min_chars), rng.uniform(*cfg.think_s), rng.uniform(*cfg.feedback_delay_s)
        )
        for i in range(cfg.users)
    ]


def verdict(suggestion: str, intended: str, min_chars: int) -> tuple[str | None, int]:
    """(event or None for no feedback, characters kept) — the rule in the module docstring."""
    if not suggestion:
        return None, 0
    k = 0
    for a, b in zip(suggestion, intended):
        if a != b:
            break
        k += 1
    if k == len(suggestion) and k >= min_chars:
        return "accepted", k
    if k >= min_chars:
        return "partial", k
    return "rejected", 0


@dataclass
class Tally:
    """What users saw, per served version (thread-safe counters; `snapshot` for reports)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    by_version: dict[int, Counter] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    acked: list[str] = field(default_factory=list)  # request ids of completions the gateway answered with 200
    feedback_acked: list[str] = field(default_factory=list)  # request ids whose feedback the gateway acknowledged
    latencies_ms: list[float] = field(default_factory=list)  # client-side, per acknowledged completion
    answered_at: list[float] = field(default_factory=list)  # time.monotonic() of each, in the same order

    def add(
        self, version: int, event: str | None, shown: bool, kept: int, request_id: str = "", latency_ms: float | None = None
    ) -> None:
        with self.lock:
            if request_id:
                self.acked.append(request_id)
            if latency_ms is not None:
                self.latencies_ms.append(latency_ms)
                self.answered_at.append(time.monotonic())
            c = self.by_version.setdefault(version, Counter())
            c["requests"] += 1
            c["suggestions"] += int(shown)
            c[event or "none"] += 1
            c["accepted_chars"] += kept

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)

    def feedback_ok(self, request_id: str) -> None:
        with self.lock:
            self.feedback_acked.append(request_id)

    def snapshot(self) -> dict[int, dict[str, int]]:
        with self.lock:
            return {v: dict(c) for v, c in self.by_version.items()}


class SimTraffic(threading.Thread):
    """Users sending Tab requests through the gateway until `stop` is set (or `max_requests` sent). While `quiet`
    is set they send nothing new (the batch in flight finishes, verdicts still fall due): a traffic trough."""

    def __init__(
        self,
        cfg: SimUsersConfig,
        gateway_url: str,
        api_key: str,
        model: str,
        heldout_fraction: float,
        max_requests: int | None = None,
    ):
        super().__init__(daemon=True, name="sim-traffic")
        from openai import (
            OpenAI,  # the official SDK, unchanged: the gateway is OpenAI-compatible
        )

        root, files = site_files("traffic", heldout_fraction, cfg.eval_fraction, cfg.code_dir)
        self.cfg, self.model, self.max_requests = cfg, model, max_requests
        self.sites: list[TabSite] = cursor_sites(root, files, cfg.sites, cfg.seed, cfg.context_bytes)
        self.users = population(cfg)
        self.client = OpenAI(base_url=gateway_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=gateway_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
        self.stop, self.quiet, self.tally, self.sent = threading.Event(), threading.Event(), Tally(), 0
        self._due: list[tuple[float, int, str, str, int]] = []  # heap of (due time, seq, request id, event, chars)
        self._due_lock = threading.Lock()

    def one(self, i: int, due: float | None = None) -> None:
        """Request i; `due` (perf_counter) is when a paced request was due: its latency counts from then, queueing
        included, and the user does not pause first."""
        rng = random.Random(f"{self.cfg.seed}/{i}")
        user, site = self.users[rng.randrange(len(self.users))], self.sites[i % len(self.sites)]
        if user.think_s and due is None:
            time.sleep(user.think_s)
        t0 = time.perf_counter() if due is None else due
        try:
            r = self.client.completions.create(
                model=self.model,
                prompt=site.prompt,
                max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature,
                stop=self.cfg.stop or None,
                user=user.user_id,
                seed=rng.randrange(2**31),
            )
        except Exception as e:  # noqa: BLE001  a served error is counted, the users keep typing
            self.tally.error(f"completion: {e!r}"[:300])
            return
        text, version = r.choices[0].text, int(r.model_extra["tidal"]["version"])
        event, kept = verdict(text, site.intended, user.min_chars)
        self.tally.add(version, event, bool(text), kept, r.id, (time.perf_counter() - t0) * 1000)
        if event is not None:
            with self._due_lock:
                heapq.heappush(self._due, (time.monotonic() + user.feedback_delay_s, i, r.id, event, kept))

    def _send_due(self, final: bool = False) -> None:
        while True:
            with self._due_lock:
                if not self._due or (not final and self._due[0][0] > time.monotonic()):
                    return
                _, _, rid, event, kept = heapq.heappop(self._due)
            body = {"request_id": rid, "event": event} | ({"accepted_chars": kept} if event == "partial" else {})
            try:
                self.http.post("/v1/feedback", json=body).raise_for_status()
                self.tally.feedback_ok(rid)
            except Exception as e:  # noqa: BLE001
                self.tally.error(f"feedback: {e!r}"[:300])

    def run(self) -> None:
        if self.cfg.daily is None:
            self._closed_loop()
        else:
            self._paced(self.cfg.daily)
        while self._due and not self.stop.is_set():  # let pending verdicts fall due
            time.sleep(0.1)
            self._send_due()
        self._send_due(final=True)
        self.http.close()

    def _paced(self, curve: DailyCurve) -> None:
        """Requests at the daily curve's rate (none sent while `quiet` is set)."""
        start, i = time.perf_counter(), 0
        with ThreadPoolExecutor(self.cfg.concurrency) as pool:
            for at in curve.arrivals():
                while (wait := start + at - time.perf_counter()) > 0 and not self.stop.is_set():
                    self._send_due()
                    self.stop.wait(min(wait, 0.05))
                if self.stop.is_set() or (self.max_requests is not None and i >= self.max_requests):
                    break
                if not self.quiet.is_set():
                    pool.submit(self.one, i, start + at)
                    i += 1
                    self.sent = i

    def _closed_loop(self) -> None:
        i = 0
        with ThreadPoolExecutor(self.cfg.concurrency) as pool:
            while not self.stop.is_set() and (self.max_requests is None or i < self.max_requests):
                if self.quiet.is_set():
                    self._send_due()
                    self.stop.wait(0.2)
                    continue
                n = (
                    self.cfg.concurrency * 4
                    if self.max_requests is None
                    else min(self.cfg.concurrency * 4, self.max_requests - i)
                )
                list(pool.map(self.one, range(i, i + n)))
                i += n
                self.sent = i
                self._send_due()
