"""Route table: sticky monotone assignment, validation messages, limits, persistence, history, threads."""

from __future__ import annotations

import hmac
import itertools
import json
import math
import os
import random
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from data_contracts.records import SamplingParams
from serving import routes as routes_mod
from serving.routes import (
    HISTORY_LIMIT,
    ArmSpec,
    CanaryGone,
    ModelRoutes,
    RouteError,
    RouteLimits,
    RouteTable,
    arm_key,
    assign,
    assignment_key,
    user_hash,
    user_hash_key,
)

KEY = arm_key(b"gateway-secret-0123456789abcdef")


def make_routes(
    canary_weight: float | None = None,
    model: str = "tab",
    control: int = 3,
    canary: int = 4,
    by: str = "tester",
    reason: str = "test",
    updated_ms: int = 1,
    **overrides,
) -> ModelRoutes:
    if canary_weight is None:
        arms = [ArmSpec(name="control", version=control, weight=1.0)]
    else:
        arms = [
            ArmSpec(name="control", version=control, weight=1.0 - canary_weight),
            ArmSpec(name="canary", version=canary, weight=canary_weight, **overrides),
        ]
    return ModelRoutes(model=model, arms=arms, updated_ms=updated_ms, updated_by=by, reason=reason)


def user_keys(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"user-{rng.getrandbits(64):016x}" for _ in range(n)]


def canary_users(r: ModelRoutes, keys: list[str]) -> set[str]:
    return {k for k in keys if assign(r, k, KEY).name == "canary"}


@pytest.fixture
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bulk-write tests: skip the disk flushes (atomicity comes from os.replace, tested elsewhere)."""
    monkeypatch.setattr(routes_mod.os, "fsync", lambda fd: None)


# ---- assignment ----------------------------------------------------------------------------------


def test_assign_is_deterministic_and_follows_the_documented_formula() -> None:
    r = make_routes(0.3)
    for key in user_keys(500):
        digest = hmac.digest(KEY, f"tab\0{key}".encode(), "sha256")
        u = int.from_bytes(digest[:8], "big") / 2**64
        expected = "canary" if u < 0.3 else "control"
        assert assign(r, key, KEY).name == expected
        assert assign(r, key, KEY) == assign(make_routes(0.3), key, KEY)


def test_every_user_stays_in_the_same_arm_on_repeated_calls() -> None:
    r = make_routes(0.5)
    keys = user_keys(2000, seed=1)
    first = [assign(r, k, KEY).name for k in keys]
    for _ in range(3):
        assert [assign(r, k, KEY).name for k in keys] == first


def test_canary_share_is_within_binomial_tolerance() -> None:
    n, w = 20_000, 0.1
    share = len(canary_users(make_routes(w), user_keys(n, seed=2))) / n
    assert abs(share - w) <= 4 * math.sqrt(w * (1 - w) / n), share


def test_ramping_the_canary_only_moves_users_into_it() -> None:
    keys = user_keys(20_000, seed=3)
    sets = [canary_users(make_routes(w), keys) for w in (0.0, 0.05, 0.25, 0.5, 1.0)]
    for smaller, larger in itertools.pairwise(sets):
        assert smaller <= larger
    assert not sets[0] and sets[-1] == set(keys)
    assert len(sets[1]) < len(sets[2]) < len(sets[3])


def test_assignment_depends_on_the_model() -> None:
    keys = user_keys(2000, seed=4)
    a, b = canary_users(make_routes(0.5, model="tab"), keys), canary_users(make_routes(0.5, model="chat"), keys)
    assert a != b


def test_the_arm_of_a_user_id_depends_on_the_secret_and_the_client() -> None:
    """Unkeyed, anyone could compute which user ids a canary gets and send traffic and feedback as those only;
    and one client's choice of user ids put the same ids of every client on the same arms."""
    r, n = make_routes(0.5), 2000
    keys = user_keys(n, seed=4)
    other_secret = {k for k in keys if assign(r, k, arm_key(b"another-secret-0123456789abcd")).name == "canary"}
    mine = canary_users(r, keys)
    alice = {k for k in keys if assign(r, assignment_key("alice", k), KEY).name == "canary"}
    bob = {k for k in keys if assign(r, assignment_key("bob", k), KEY).name == "canary"}
    for a, b in ((mine, other_secret), (alice, bob)):  # independent halves: ~n/4 in both, far from n/2
        assert abs(len(a & b) - n / 4) < 4 * (n * 0.25 * 0.75) ** 0.5, (len(a), len(b), len(a & b))
    assert assignment_key("alice", None) == "alice" and assignment_key("alice", "") == "alice"


def test_single_control_arm_gets_everyone() -> None:
    r = make_routes(None)
    assert {assign(r, k, KEY).name for k in user_keys(100)} == {"control"}


def test_user_hash_is_keyed_and_hides_the_raw_id() -> None:
    h = user_hash("alice@example.com", b"s" * 32)
    assert h == user_hash("alice@example.com", b"s" * 32)
    assert len(h) == 32 and int(h, 16) >= 0
    assert "alice" not in h
    assert h != user_hash("alice@example.com", b"t" * 32)
    assert h != user_hash("bob@example.com", b"s" * 32)
    with pytest.raises(ValueError, match="non-empty key"):
        user_hash("alice", b"")
    with pytest.raises(ValueError, match="non-empty secret"):
        user_hash_key(b"")


# ---- validation ----------------------------------------------------------------------------------


def arm(name: str = "control", version: int = 1, weight: float = 1.0, **kw) -> dict:
    return {"name": name, "version": version, "weight": weight, **kw}


@pytest.mark.parametrize(
    "arms, fragments",
    [
        ([arm(weight=0.7), arm("canary", 2, 0.2)], ["must sum to 1", "0.9", "control=0.7", "canary=0.2"]),
        ([arm(weight=0.5), arm(weight=0.5)], ["unique", "'control', 'control'", "one 'control'"]),
        ([arm("canary", 2, 1.0)], ["'control' arm is required", "['canary']"]),
        ([arm(version=0)], ["version", "greater than or equal to 1"]),
        ([], ["1 or 2 arms", "got 0"]),
        ([arm(weight=0.5), arm("canary", 2, 0.25), arm("canary", 3, 0.25)], ["1 or 2 arms", "got 3"]),
        ([arm("shadow")], ["name", "'control' or 'canary'"]),
        ([arm(weight=1.5)], ["weight", "less than or equal to 1"]),
        ([arm(weight=float("nan"))], ["weight", "finite"]),
        ([arm(colour="red")], ["colour", "Extra inputs are not permitted"]),
    ],
)
def test_invalid_routes_say_what_is_wrong(arms: list[dict], fragments: list[str]) -> None:
    with pytest.raises(ValidationError) as exc:
        ModelRoutes(model="tab", arms=arms, updated_ms=0, updated_by="t", reason="")
    for fragment in fragments:
        assert fragment in str(exc.value), (fragment, str(exc.value))


def test_weights_within_tolerance_are_accepted_and_control_comes_first() -> None:
    r = ModelRoutes(model="tab", arms=[arm("canary", 2, 0.1), arm(weight=0.9 + 5e-10)], updated_ms=0, updated_by="t")
    assert [a.name for a in r.arms] == ["control", "canary"]
    assert r.control.version == 1 and r.canary is not None and r.canary.version == 2


def test_arm_overrides_apply_to_sampling_params() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8)
    assert ArmSpec(name="control", version=1, weight=1).apply(params) is params
    tuned = ArmSpec(name="canary", version=1, weight=0.1, temperature=1.2).apply(params)
    assert (tuned.temperature, tuned.top_p, tuned.max_tokens) == (1.2, 0.9, 8)
    assert params.temperature == 0.7


@pytest.mark.parametrize(
    "overrides, weight, fragments",
    [
        ({"temperature": 1.6}, 0.1, ["temperature override 1.6", "max_temperature=1.5", "'canary'"]),
        ({"top_p": 0.4}, 0.1, ["top_p override 0.4", "min_top_p=0.5"]),
        ({"temperature": 1.0}, 0.25, ["max_override_weight=0.2", "got weight 0.25"]),
    ],
)
def test_limits_refuse_out_of_bounds_overrides(tmp_path: Path, overrides: dict, weight: float, fragments: list[str]) -> None:
    table = RouteTable(tmp_path / "routes.json", RouteLimits())
    with pytest.raises(RouteError) as exc:
        table.set(make_routes(weight, **overrides))
    for fragment in fragments:
        assert fragment in str(exc.value), (fragment, str(exc.value))
    assert table.get("tab") is None and table.history == []
    assert not (tmp_path / "routes.json").exists()


def test_overrides_within_limits_are_accepted(tmp_path: Path) -> None:
    table = RouteTable(tmp_path / "routes.json", RouteLimits())
    r = table.set(make_routes(0.2, temperature=1.5, top_p=0.5))
    assert table.get("tab") == r


def test_route_limits_are_checked_themselves() -> None:
    with pytest.raises(ValidationError, match="min_temperature"):
        RouteLimits(min_temperature=1.0, max_temperature=0.5)
    with pytest.raises(ValidationError, match="Extra inputs"):
        RouteLimits(max_temprature=2.0)


# ---- table: changes, persistence, history --------------------------------------------------------


def test_missing_file_is_an_empty_table(tmp_path: Path) -> None:
    table = RouteTable(tmp_path / "nested" / "routes.json", RouteLimits())
    assert table.all() == {} and table.history == [] and table.get("tab") is None


def test_routes_and_history_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    table = RouteTable(path, RouteLimits())
    table.set(make_routes(None, by="bootstrap", reason="first version"))
    table.set_weights("tab", 4, 0.05, by="alice", reason="canary v4")
    table.set(make_routes(0.1, model="chat", control=7, canary=8, temperature=1.1))
    again = RouteTable(path, RouteLimits())
    assert again.all() == table.all()
    assert again.history == table.history
    assert [(c.model, c.action, c.by) for c in again.history] == [
        ("tab", "set", "bootstrap"),
        ("tab", "set_weights", "alice"),
        ("chat", "set", "tester"),
    ]
    assert again.get("chat").canary.temperature == 1.1
    assert [p.name for p in path.parent.iterdir()] == ["routes.json"]  # no temp files left behind


def test_set_weights_builds_arms_from_the_current_control(tmp_path: Path) -> None:
    table = RouteTable(tmp_path / "routes.json", RouteLimits())
    with pytest.raises(RouteError, match="no routes for model 'tab'"):
        table.set_weights("tab", 4, 0.1, by="alice", reason="x")
    table.set(make_routes(None, control=3))
    r = table.set_weights("tab", 5, 0.25, by="alice", reason="ramp")
    assert [(a.name, a.version, a.weight) for a in r.arms] == [("control", 3, 0.75), ("canary", 5, 0.25)]
    assert (r.updated_by, r.reason) == ("alice", "ramp") and r.updated_ms > 1_600_000_000_000
    with pytest.raises(RouteError, match="max_override_weight"):
        table.set_weights("tab", 5, 0.3, by="alice", reason="too much exploration", temperature=1.2)
    assert table.get("tab") == r


def test_rollback_sends_everyone_to_control_in_one_change(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    table = RouteTable(path, RouteLimits())
    table.set(make_routes(0.2, control=3, canary=4, temperature=1.2))
    r = table.rollback("tab", by="oncall", reason="canary reward dropped")
    assert [(a.name, a.version, a.weight, a.has_overrides) for a in r.arms] == [("control", 3, 1.0, False)]
    last = table.history[-1]
    assert len(table.history) == 2
    assert (last.action, last.by, last.reason) == ("rollback", "oncall", "canary reward dropped")
    assert [a.version for a in last.previous] == [3, 4] and last.arms == r.arms
    assert RouteTable(path, RouteLimits()).get("tab") == r
    with pytest.raises(RouteError, match="no routes for model 'chat'"):
        table.rollback("chat", by="oncall", reason="x")


def test_a_watched_canary_is_rolled_back_once_its_release_misses_a_check_in(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    table = RouteTable(path, RouteLimits())
    table.set(make_routes(None, control=3))
    set_at = table.set_weights("tab", 4, 0.05, by="promote", reason="step 1", watch_s=10).watch_until_ms
    assert set_at is not None and abs(set_at - (routes_mod.now_ms() + 10_000)) < 1_000
    assert table.expire_watches(set_at) == []  # not yet late
    renewed = table.watch("tab", 4, 60).watch_until_ms
    assert renewed > set_at + 40_000 and len(table.history) == 2  # a check-in is no route change
    assert RouteTable(path, RouteLimits()).get("tab").watch_until_ms == renewed  # a restarted gateway keeps it
    assert table.expire_watches(renewed) == []
    [rolled] = table.expire_watches(renewed + 1)
    assert [(a.name, a.version, a.weight) for a in rolled.arms] == [("control", 3, 1.0)] and rolled.watch_until_ms is None
    assert rolled.updated_by == "watchdog" and "did not check in" in rolled.reason
    assert table.history[-1].action == "rollback" and table.expire_watches(renewed + 10**6) == []
    with pytest.raises(CanaryGone, match=r"no canary of tab@v4 is routed \(last change by watchdog"):
        table.watch("tab", 4, 60)


def test_an_unwatched_canary_is_never_expired_and_a_watch_needs_a_canary(tmp_path: Path) -> None:
    table = RouteTable(tmp_path / "routes.json", RouteLimits())
    table.set(make_routes(None, control=3))
    table.set_weights("tab", 4, 0.05, by="alice", reason="by hand")
    assert table.expire_watches(routes_mod.now_ms() + 10**9) == []
    with pytest.raises(CanaryGone, match="tab@v5"):
        table.watch("tab", 5, 60)  # another version's release
    with pytest.raises(CanaryGone, match="chat@v4"):
        table.watch("chat", 4, 60)
    with pytest.raises(ValidationError, match="only a canary is watched"):
        ModelRoutes(
            model="tab", arms=[ArmSpec(name="control", version=3, weight=1.0)], updated_ms=0, updated_by="t", watch_until_ms=5
        )


def test_history_is_bounded(tmp_path: Path, no_fsync: None) -> None:
    path = tmp_path / "routes.json"
    table = RouteTable(path, RouteLimits())
    for i in range(HISTORY_LIMIT + 5):
        table.set(make_routes(None, control=i + 1, updated_ms=i))
    assert len(table.history) == HISTORY_LIMIT
    assert table.history[0].arms[0].version == 6 and table.history[-1].arms[0].version == HISTORY_LIMIT + 5
    assert len(json.loads(path.read_text())["history"]) == HISTORY_LIMIT


def test_leftover_temp_file_from_a_crash_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    RouteTable(path, RouteLimits()).set(make_routes(0.1))
    (tmp_path / ".routes.json.abc123.tmp").write_text('{"format": 1, "routes": {"tab": {"mod')  # died mid-write
    table = RouteTable(path, RouteLimits())
    assert table.get("tab") == make_routes(0.1)
    table.set(make_routes(0.2))
    assert RouteTable(path, RouteLimits()).get("tab").canary.weight == 0.2


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "not valid JSON"),  # truncated copy of a real table
        (b"", "not valid JSON"),
        (b'{"format": 1, "routes": {"tab": {"model": "tab"}}}', "does not hold a valid route table"),
        (b'{"format": 9}', "does not hold a valid route table"),
        (b'{"format": 1, "routes": {"chat": ' + make_routes(None).model_dump_json().encode() + b"}}", "holds routes for 'tab'"),
    ],
)
def test_corrupt_file_gives_a_clear_error_and_is_left_alone(tmp_path: Path, content: bytes | None, fragment: str) -> None:
    path = tmp_path / "routes.json"
    if content is None:
        RouteTable(path, RouteLimits()).set(make_routes(0.1))
        content = path.read_bytes()[:40]
    path.write_bytes(content)
    with pytest.raises(RouteError) as exc:
        RouteTable(path, RouteLimits())
    assert str(path) in str(exc.value) and fragment in str(exc.value), str(exc.value)
    assert path.read_bytes() == content


def test_failed_write_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "routes.json"
    table = RouteTable(path, RouteLimits())
    before = table.set(make_routes(0.1))
    on_disk = path.read_bytes()

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(routes_mod.os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        table.set(make_routes(0.2))
    assert table.get("tab") == before and len(table.history) == 1
    assert path.read_bytes() == on_disk
    assert [p.name for p in tmp_path.iterdir()] == ["routes.json"]


def test_routes_loaded_outside_tightened_limits_still_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "routes.json"
    RouteTable(path, RouteLimits()).set(make_routes(0.2, temperature=1.4))
    table = RouteTable(path, RouteLimits(max_temperature=1.0))
    assert table.get("tab").canary.temperature == 1.4
    assert "max_temperature=1.0" in caplog.text
    assert table.rollback("tab", by="oncall", reason="tightened").canary is None


def test_concurrent_changes_never_publish_an_invalid_snapshot(tmp_path: Path, no_fsync: None) -> None:
    path = tmp_path / "routes.json"
    table = RouteTable(path, RouteLimits())
    table.set(make_routes(None))
    writers, per_writer = 4, 25
    stop = threading.Event()
    problems: list[str] = []
    reads = [0, 0]

    def write(i: int) -> None:
        for j in range(per_writer):
            k = i * per_writer + j
            # the canary version encodes its weight: a half-applied change would break the pairing
            table.set(make_routes((k % 20) / 100, canary=k + 1, by=f"writer-{i}", updated_ms=k))

    def read(n: int) -> None:
        while not stop.is_set():
            reads[n] += 1
            r = table.get("tab")
            total = sum(a.weight for a in r.arms)
            if abs(total - 1) > 1e-9 or r.arms[0].name != "control":
                problems.append(f"invalid snapshot {r}")
            if r.canary is not None and r.canary.weight != ((r.canary.version - 1) % 20) / 100:
                problems.append(f"mixed snapshot {r}")
            time.sleep(0.0002)  # let the writers have the GIL

    readers = [threading.Thread(target=read, args=(n,)) for n in range(2)]
    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in readers + threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert problems == [] and min(reads) > 10
    assert len(table.history) == 1 + writers * per_writer
    assert table.history[-1].arms == table.get("tab").arms
    again = RouteTable(path, RouteLimits())
    assert again.get("tab") == table.get("tab") and again.history == table.history
    assert os.listdir(tmp_path) == ["routes.json"]
