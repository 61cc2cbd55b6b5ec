"""The gateway's route table: per model, one or two weighted arms, each a registry version.

`control` is the serving version; an optional `canary` takes a share of users. An arm may carry
bounded sampling overrides (temperature, top_p) for controlled exploration on a small share of
traffic; `RouteLimits` bounds them. Users are assigned by a keyed hash of (model, client, user), so a user
keeps their arm while the weights hold, and raising the canary weight only moves users into it.

The table is one JSON file (routes + the last `HISTORY_LIMIT` changes), replaced atomically on
every change. One process owns it (the gateway); readers in that process see whole snapshots.
"""

from __future__ import annotations

import hmac
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from data_contracts.records import Arm, SamplingParams
from tidal.clock import now_ms

log = logging.getLogger("tidal.routes")

HISTORY_LIMIT = 200
FILE_FORMAT = 1
WEIGHT_TOLERANCE = 1e-9
_HASH_SCALE = float(2**64)


class RouteError(ValueError):
    """A route change refused (limits, unknown model) or a route file that cannot be read."""


class CanaryGone(RouteError):
    """A release checked in for a canary that is no longer routed (an operator or the watchdog rolled it back)."""


class ArmSpec(BaseModel):
    """One arm: which version serves it, its traffic share, and optional sampling overrides."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: Arm = Field(description="'control' (the serving version) or 'canary' (the version under test).")
    version: int = Field(ge=1, description="Registry version this arm serves.")
    weight: float = Field(ge=0, le=1, description="Share of users assigned to this arm, in [0, 1].")
    temperature: float | None = Field(None, ge=0, description="Sampling temperature override; None = the client's.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass override; None = the client's.")

    @property
    def has_overrides(self) -> bool:
        return self.temperature is not None or self.top_p is not None

    def apply(self, sampling: SamplingParams) -> SamplingParams:
        """The client's sampling parameters with this arm's overrides applied (a copy)."""
        if not self.has_overrides:
            return sampling
        update = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
        return sampling.model_copy(update=update)


class ModelRoutes(BaseModel):
    """A model's arms (control first) and who last changed them, when and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="Registered model name.")
    arms: list[ArmSpec] = Field(description="1 or 2 arms with distinct names, a 'control' among them; weights sum to 1.")
    updated_ms: int = Field(ge=0, description="Unix epoch milliseconds of the change.")
    updated_by: str = Field(min_length=1, description="Who made the change (operator, flow or service name).")
    reason: str = Field("", description="Why the change was made.")
    watch_until_ms: int | None = Field(
        None,
        ge=0,
        description=(
            "While a release watches its canary: the Unix epoch ms by which it must check in again (RouteTable.watch); "
            "past it the gateway rolls the canary back, so a release that died or lost the gateway cannot leave users on "
            "a ramp nobody watches. None: nobody watches it (no canary, or one set by hand)."
        ),
    )

    @field_validator("arms")
    @classmethod
    def _check_arms(cls, arms: list[ArmSpec]) -> list[ArmSpec]:
        names = [a.name for a in arms]
        if not 1 <= len(arms) <= 2:
            raise ValueError(f"routes need 1 or 2 arms (a 'control', optionally a 'canary'), got {len(arms)}: {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}: expected one 'control' and at most one 'canary'")
        if "control" not in names:
            raise ValueError(f"a 'control' arm is required, got {names}")
        total = sum(a.weight for a in arms)
        if abs(total - 1.0) > WEIGHT_TOLERANCE:
            shares = ", ".join(f"{a.name}={a.weight!r}" for a in arms)
            raise ValueError(f"arm weights must sum to 1 (within {WEIGHT_TOLERANCE:g}), got {total:.12g} ({shares})")
        return sorted(arms, key=lambda a: a.name != "control")

    @model_validator(mode="after")
    def _check_watch(self) -> ModelRoutes:
        if self.watch_until_ms is not None and len(self.arms) != 2:
            raise ValueError("watch_until_ms is set but there is no canary arm: only a canary is watched; leave it unset")
        return self

    @property
    def control(self) -> ArmSpec:
        return self.arms[0]

    @property
    def canary(self) -> ArmSpec | None:
        return self.arms[1] if len(self.arms) == 2 else None


class RouteLimits(BaseModel):
    """Bounds on arm sampling overrides, checked on every route change."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min_temperature: float = Field(0.0, ge=0, description="Lowest temperature an arm may override to.")
    max_temperature: float = Field(1.5, ge=0, description="Highest temperature an arm may override to.")
    min_top_p: float = Field(0.5, gt=0, le=1, description="Lowest top_p an arm may override to (the highest is 1).")
    max_override_weight: float = Field(0.2, ge=0, le=1, description="Largest traffic share of an arm with sampling overrides.")

    @model_validator(mode="after")
    def _check_order(self) -> RouteLimits:
        if self.min_temperature > self.max_temperature:
            raise ValueError(f"min_temperature {self.min_temperature} is above max_temperature {self.max_temperature}")
        return self

    def check(self, routes: ModelRoutes) -> None:
        """Raise RouteError naming the first arm and limit that `routes` breaks."""
        for arm in routes.arms:
            where = f"model {routes.model!r}, arm {arm.name!r} (v{arm.version})"
            t, p = arm.temperature, arm.top_p
            if t is not None and not self.min_temperature <= t <= self.max_temperature:
                raise RouteError(
                    f"{where}: temperature override {t} is outside the limits "
                    f"[min_temperature={self.min_temperature}, max_temperature={self.max_temperature}]"
                )
            if p is not None and not self.min_top_p <= p <= 1.0:
                raise RouteError(f"{where}: top_p override {p} is outside the limits [min_top_p={self.min_top_p}, 1]")
            if arm.has_overrides and arm.weight > self.max_override_weight:
                raise RouteError(
                    f"{where}: an arm with sampling overrides may carry at most "
                    f"max_override_weight={self.max_override_weight} of traffic, got weight {arm.weight}"
                )


class RouteChange(BaseModel):
    """One entry of the route history."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    time_ms: int = Field(description="Unix epoch milliseconds of the change.")
    model: str = Field(description="Model whose routes changed.")
    action: Literal["set", "set_weights", "rollback"] = Field(description="Which operation made the change.")
    by: str = Field(description="Who made the change.")
    reason: str = Field(description="Why the change was made.")
    arms: list[ArmSpec] = Field(description="The arms after the change.")
    previous: list[ArmSpec] | None = Field(description="The arms before the change; None = the model had no routes.")


class RouteTableReply(BaseModel):
    """GET /admin/routes: every model's routes and the last route changes (oldest first)."""

    routes: dict[str, ModelRoutes] = Field(default_factory=dict, description="Model -> its routes; absent = no routes.")
    history: list[RouteChange] = Field(default_factory=list, description="The last changes, oldest first.")

    def get(self, model: str) -> ModelRoutes | None:
        return self.routes.get(model)


class _TableFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = FILE_FORMAT
    routes: dict[str, ModelRoutes] = Field(default_factory=dict)
    history: list[RouteChange] = Field(default_factory=list)


class _Snapshot:
    """Routes and history as of one change; never mutated once published."""

    __slots__ = ("history", "routes")

    def __init__(self, routes: dict[str, ModelRoutes], history: tuple[RouteChange, ...]):
        self.routes, self.history = routes, history


class RouteTable:
    """All models' routes, persisted in one JSON file; changes are validated, written, then published.

    Readers (`get`, `all`, `history`) take no lock: each reads one published snapshot. Writers are
    serialized by a lock; a change that fails validation or cannot be written changes nothing.
    """

    def __init__(self, path: Path, limits: RouteLimits | None = None, on_change: Callable[[RouteChange], None] | None = None):
        self.path = Path(path)
        self.limits = limits or RouteLimits()
        self.on_change = on_change  # told of every change once it is written (the gateway counts them)
        self._lock = threading.RLock()
        self._snap = self._load()

    def weights(self) -> list[tuple[str, str, int, float]]:
        """(model, arm, version, weight) of every routed arm (the gateway's route-weight gauge)."""
        return [(m, a.name, a.version, a.weight) for m, r in self._snap.routes.items() for a in r.arms]

    # ---- reads ---------------------------------------------------------------------------------

    def get(self, model: str) -> ModelRoutes | None:
        return self._snap.routes.get(model)

    def all(self) -> dict[str, ModelRoutes]:
        return dict(self._snap.routes)

    @property
    def history(self) -> list[RouteChange]:
        """The last HISTORY_LIMIT changes, oldest first."""
        return list(self._snap.history)

    # ---- changes -------------------------------------------------------------------------------

    def set(self, routes: ModelRoutes) -> ModelRoutes:
        """Replace `routes.model`'s routes; who/when/why come from `routes` itself."""
        return self._apply(routes, "set")

    def set_weights(
        self,
        model: str,
        canary_version: int,
        canary_weight: float,
        by: str,
        reason: str,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        watch_s: float | None = None,
    ) -> ModelRoutes:
        """Control keeps its version at 1 - canary_weight; the canary serves `canary_version`. watch_s: the
        release watching it must check in (`watch`) within this many seconds, or the canary is rolled back."""
        with self._lock:
            current = self._require(model)
            arms = [
                ArmSpec(name="control", version=current.control.version, weight=1.0 - canary_weight),
                ArmSpec(name="canary", version=canary_version, weight=canary_weight, temperature=temperature, top_p=top_p),
            ]
            t = now_ms()
            routes = ModelRoutes(
                model=model,
                arms=arms,
                updated_ms=t,
                updated_by=by,
                reason=reason,
                watch_until_ms=None if watch_s is None else t + int(watch_s * 1000),
            )
            return self._apply(routes, "set_weights")

    def watch(self, model: str, canary_version: int, watch_s: float) -> ModelRoutes:
        """The release watching `canary_version` checks in: its deadline moves to now + watch_s (written, so a
        restarted gateway keeps it; not a route change, so not in the history). CanaryGone when that canary is
        no longer routed: the release must stop."""
        with self._lock:
            current = self.get(model)
            canary = current.canary if current is not None else None
            if canary is None or canary.version != canary_version:
                last = f" (last change by {current.updated_by}: {current.reason})" if current is not None else ""
                raise CanaryGone(f"no canary of {model}@v{canary_version} is routed{last}; the release must stop")
            routes = current.model_copy(update={"watch_until_ms": now_ms() + int(watch_s * 1000)})
            old = self._snap
            new = _Snapshot({**old.routes, model: routes}, old.history)
            self._write(new)
            self._snap = new
            return routes

    def expire_watches(self, at_ms: int | None = None) -> list[ModelRoutes]:
        """Roll back every canary whose release missed its deadline (its run was killed, crashed or cannot reach
        the gateway): all traffic back to control. Returns the new routes of each model rolled back."""
        at_ms = now_ms() if at_ms is None else at_ms
        out = []
        with self._lock:
            for model, r in self.all().items():
                if r.watch_until_ms is not None and at_ms > r.watch_until_ms:
                    late_s = (at_ms - r.watch_until_ms) / 1000
                    why = (
                        f"release watchdog: the release watching canary v{r.canary.version} did not check in "
                        f"(deadline passed {late_s:.1f} s ago; its run died or lost the gateway)"
                    )
                    out.append(self.rollback(model, by="watchdog", reason=why))
        return out

    def rollback(self, model: str, by: str, reason: str) -> ModelRoutes:
        """All traffic to the control version, without overrides, in one change."""
        with self._lock:
            current = self._require(model)
            arms = [ArmSpec(name="control", version=current.control.version, weight=1.0)]
            routes = ModelRoutes(model=model, arms=arms, updated_ms=now_ms(), updated_by=by, reason=reason)
            return self._apply(routes, "rollback")

    def _require(self, model: str) -> ModelRoutes:
        current = self.get(model)
        if current is None:
            known = sorted(self._snap.routes)
            raise RouteError(f"no routes for model {model!r} (routed models: {known}); set() its control arm first")
        return current

    def _apply(self, routes: ModelRoutes, action: str) -> ModelRoutes:
        self.limits.check(routes)
        with self._lock:
            old = self._snap
            previous = old.routes.get(routes.model)
            change = RouteChange(
                time_ms=routes.updated_ms,
                model=routes.model,
                action=action,
                by=routes.updated_by,
                reason=routes.reason,
                arms=routes.arms,
                previous=previous.arms if previous else None,
            )
            new = _Snapshot({**old.routes, routes.model: routes}, (*old.history, change)[-HISTORY_LIMIT:])
            self._write(new)
            self._snap = new  # one reference swap: readers see the old or the new snapshot, whole
        if self.on_change is not None:
            self.on_change(change)
        log.info(
            "routes %s by %s (%s): %s",
            routes.model,
            routes.updated_by,
            routes.reason,
            ", ".join(f"{a.name}=v{a.version}@{a.weight:g}" for a in routes.arms),
        )
        return routes

    # ---- persistence ---------------------------------------------------------------------------

    def _load(self) -> _Snapshot:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return _Snapshot({}, ())
        except OSError as e:
            raise RouteError(f"cannot read route table {self.path}: {e}") from e
        try:
            data = _TableFile.model_validate_json(raw)
        except ValidationError as e:
            kind = "is not valid JSON (truncated?)" if _is_json_error(e) else "does not hold a valid route table"
            raise RouteError(
                f"route table {self.path} {kind}: {_first_error(e)}; "
                f"restore it from a backup or fix it (it is not overwritten while unreadable)"
            ) from e
        for model, routes in data.routes.items():
            if model != routes.model:
                raise RouteError(f"route table {self.path}: entry {model!r} holds routes for {routes.model!r}")
            try:
                self.limits.check(routes)
            except RouteError as e:  # written under older limits: keep serving, refuse new breaking changes
                log.warning("route table %s: %s (loaded as is; the next change must be within limits)", self.path, e)
        return _Snapshot(dict(data.routes), tuple(data.history[-HISTORY_LIMIT:]))

    def _write(self, snap: _Snapshot) -> None:
        data = _TableFile(routes=snap.routes, history=list(snap.history))
        payload = data.model_dump_json(indent=1).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(self.path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_json_error(e: ValidationError) -> bool:
    return any(err["type"] == "json_invalid" for err in e.errors())


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    return f"{loc}: {err['msg']}" if loc else err["msg"]


_ARM_LABEL = b"tidal/arm-assignment/v1"


def arm_key(secret: bytes) -> bytes:
    """The key of arm assignment, derived from the gateway secret with a label of its own. Unkeyed, anyone could
    compute offline which user ids land in a canary and send traffic and feedback as those users only."""
    if not secret:
        raise ValueError("arm_key needs a non-empty secret")
    return hmac.digest(secret, _ARM_LABEL, "sha256")


def assignment_key(client_id: str, user: str | None) -> str:
    """Who is assigned an arm: the client's user (keyed by the client too, so one client's user ids say nothing
    about another's arms), or the client itself when it names no user."""
    return f"{client_id}\0{user}" if user else client_id


def assign(routes: ModelRoutes, user_key: str, key: bytes) -> ArmSpec:
    """The arm of `user_key`: canary iff u < canary.weight, u = first 8 bytes of HMAC-SHA256(key, model NUL
    user_key) / 2**64, key = arm_key(gateway secret).

    Sticky (same arm while the weights hold) and monotone (raising the canary weight only moves users in).
    """
    arms = routes.arms
    if len(arms) == 1:
        return arms[0]
    u = int.from_bytes(hmac.digest(key, f"{routes.model}\0{user_key}".encode(), "sha256")[:8], "big") / _HASH_SCALE
    return arms[1] if u < arms[1].weight else arms[0]


_USER_HASH_LABEL = b"tidal/user-hash/v1"


def user_hash_key(secret: bytes) -> bytes:
    """The key of user hashes, derived from the gateway secret with a label of its own. Keyed by the secret
    itself, a client sending the user id "tidal/request-id/v1" had the request-id signing key's first half logged
    as its user hash (serving/request_ids.py derives that key the same way)."""
    if not secret:
        raise ValueError("user_hash needs a non-empty secret (an unkeyed hash of a user id is reversible by guessing)")
    return hmac.digest(secret, _USER_HASH_LABEL, "sha256")


def user_hash(user_key: str, key: bytes) -> str:
    """Keyed hash of a user/session id for logs: HMAC-SHA256 under `user_hash_key(secret)`, first 16 bytes, hex."""
    if not key:
        raise ValueError("user_hash needs a non-empty key (an unkeyed hash of a user id is reversible by guessing)")
    return hmac.digest(key, user_key.encode(), "sha256")[:16].hex()
