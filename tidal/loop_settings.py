"""Settings of the loop as a whole: how the flywheel is scheduled, and what `tidal demo` runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from capacity.settings import CapacitySettings, ForecastSettings, LeaseSettings
from release.canary_config import CanaryConfig
from sim.daily_curve import DailyCurve
from sim.users import SimUsersConfig
from tidal.kube import unpinned
from tidal.model_settings import Margins, ServingCapacity
from tidal.section import Section, deep_merge
from tidal.strategy import UpdateStrategy, strategy_mismatch
from training.ppo_config import PPOConfig
from training.train_settings import GateConfig, SuggestionFilterSettings, TrainSettings


class FlywheelSettings(Section):
    loop: Literal["chained", "flywheel", "manual"] = Field(
        "chained",
        description=(
            "How the deployed loop runs. 'chained': collect on its cron schedule, train started by each new dataset, "
            "promote by each registered candidate (Prefect event triggers). 'flywheel': whole cycles on `schedule_cron` "
            "(collect's schedule and the triggers are off). 'manual': no schedule or trigger is active (`tidal demo` drives "
            "the cycles itself). Every deployment exists in each mode, for runs on demand."
        ),
    )
    schedule_cron: str = Field("0 */2 * * *", description="When the flywheel deployment runs a cycle in 'flywheel' mode (UTC).")
    work_pool: str | None = Field(
        None,
        description=(
            "None: `python -m flows.deployments` serves the deployments in its own process (the local runner `tidal up` "
            "starts). A name (e.g. 'tidal-kubernetes', infra/prefect/kubernetes-work-pool.json): it registers them on "
            "that work pool and exits, and the pool's workers run each flow run (a Kubernetes Job per run)."
        ),
    )
    runner_poll_s: float = Field(
        2.0,
        gt=0,
        description=(
            "Without work_pool: how often the local runner asks the Prefect server for flow runs that are due; a run "
            "started on demand (a demo cycle, a triggered train) waits half this on average before it starts. Prefect's "
            "own default is 10 s."
        ),
    )
    image: str = Field(
        "",
        description=(
            "With work_pool: the Tidal image flow runs use (repository:tag or @sha256 digest); untagged or 'latest' is "
            "refused, so a retried run gets the same code."
        ),
    )
    flows_service_account: str = Field(
        "tidal-flows",
        description=(
            "With work_pool: service account of collect, promote and flywheel runs (the chart's; its IAM role reads "
            "logs and writes datasets and quarantine)."
        ),
    )
    trainer_service_account: str = Field(
        "tidal-trainer",
        description=(
            "With work_pool: service account of train runs; it gets an API token, since the train flow creates the "
            "trainer's Job (infra/prefect/trainer-launcher-rbac.yaml)."
        ),
    )

    @model_validator(mode="after")
    def _pool_needs_an_image(self):
        if self.work_pool and not self.image:
            raise ValueError(
                f"flywheel.work_pool={self.work_pool!r} needs flywheel.image: the Tidal image its workers run (repository:tag)"
            )
        if self.work_pool and (problem := unpinned("flywheel.image", self.image)):
            raise ValueError(problem)
        return self


def _demo_canary() -> CanaryConfig:
    # Simulated traffic is ~10 requests/s on a laptop: larger, shorter steps than production's 5% → 25% → 50%,
    # and verdicts that arrive within seconds. An undecided step ends after 1,800 outcomes of both arms (3 minutes
    # of the static demo's traffic: ~900 per arm at 50%), however long they take: on the tide a step in the trough
    # (1.4-2.4 req/s measured) waits for the day's traffic rather than ending short of evidence (docs/learning.md,
    # item 41); 20 minutes (more than a demo day) is the clock's backstop.
    # That resolves large effects only: the first step must exclude a 0.3-sd regression (not production's 0.13),
    # and accepted characters per request (mean ~0.5, sd ~2 here: most requests keep nothing) are known to within
    # ~75% of control's mean at best, so the demo's margin is 0.75: a candidate must be shown to keep at least a
    # quarter of control's accepted characters. The share of slow requests is known to about ±1 point from ~900
    # outcomes (a fresh surge engine answers a few slowly), so its margin is 3 points, not 1. Production traffic
    # affords the defaults.
    return CanaryConfig(
        steps=[0.25, 0.5],
        min_samples=150,
        max_step_outcomes=1800,
        max_step_s=1200.0,
        feedback_wait_s=5.0,
        poll_s=3.0,
        unload_grace_s=10.0,
        mixture_sd=0.3,
        detect_regression_sd=0.3,
        margins=Margins(accepted_chars=0.75, slow_share=0.03),
    )


DEMO_DAY_S = 900.0  # fifteen minutes a simulated day: a cycle's training (~6 minutes on one core) fits in a trough


def _demo_day() -> DailyCurve:
    # 2 req/s in the trough, 8 at the peak, starting at 02:00 (in the trough): on average 5 req/s, so the first cycle's
    # 2,400 requests took ~8 minutes (at 1 to 4 req/s, 15.6). A 25% canary step in the trough saw too few outcomes
    # in 3 minutes (109; 64 at 1 to 4 req/s: both undecided, docs/learning.md item 41), hence the demo canary's bound
    # on outcomes rather than time (item 42).
    return DailyCurve(day_s=DEMO_DAY_S, peak_rps=8.0, peak_to_trough=4.0, peak_hour=14.0, start_hour=2.0)


def _demo_capacity() -> CapacitySettings:
    # Static by default: on 2 cores the tide about doubles the demo's time (docs/learning.md, items 41-42). Under
    # 'tidal', the tide of a compressed day: decisions every 2 s, a replica kept half an hour of the day (19 s) after
    # it is no longer needed, heartbeats every 2 s. The recent level alone forecasts (a quarter of an hour of the day): a
    # lookahead that covers a replica's start is hours of a compressed day, and with the previous day's term the
    # peak's replicas would stay all evening (bench/tidal.py measured it).
    return CapacitySettings(
        mode="static",
        tick_s=2.0,
        scale_down_after_s=DEMO_DAY_S / 48,
        lease=LeaseSettings(grace_s=60.0, heartbeat_s=2.0),
        forecast=ForecastSettings(day_s=DEMO_DAY_S, recent_s=DEMO_DAY_S / 96, yesterday_weight=0.0),
    )


def _demo_serving() -> ServingCapacity:
    # One CPU replica answers the demo's closed-loop users (4 in flight, 16 tokens) at ~10 req/s: 7 per replica
    # keeps one replica up to 5.6 req/s with the default 25% headroom, 56% of the demo's day, and two at its peak.
    return ServingCapacity(min_replicas=1, max_replicas=2, rps_per_replica=7.0)


def _demo_train() -> TrainSettings:
    # One pass over every logged row of the cycle (the users are quiet meanwhile, so the trainer has every core:
    # ~2-3 s an iteration instead of 15-19 s beside their traffic). The losses are the offline study's best
    # (docs/learning.md, items 21-26): exact stop/abstain credit from the verdicts (abstaining credited on at most
    # a quarter of a minibatch's requests), kept credit on the characters users kept, every weight trained with the
    # final norm (the logits' scale) at its own rate, and distillation from the champion at temperature 0.5 given
    # that the line continues instead of the code loss: it anchors the code model and lets the policy sharpen. The
    # gate scores bits/byte the same way, each model at its best temperature, so it charges a damaged code model,
    # not the stop decision or the sharpening. Full-weight candidates: the demo's models use a full-checkpoint
    # update strategy (DemoSettings.update_strategy).
    return TrainSettings(
        ppo=PPOConfig(
            lora=False,
            learning_rate=1e-4,
            final_norm_learning_rate=1e-2,
            critic_learning_rate=1e-2,
            batch_size=32,
            minibatch_size=8,
            epochs=2,
            passes=1,
            kl_coef=0.1,
            stop_credit_coef=2.0,
            abstain_budget=0.25,
            kept_credit_coef=4.0,
            sharpen_coef=1.0,
            sharpen_temperature=0.5,
        ),
        # The distillation sharpens the policy away from the champion on purpose, and per-token KL grows with it: a
        # first candidate trained on 1,977 rows, its best logit scale x0.65 against the champion's x1.09, measured 0.51
        # nats/token (docs/learning.md, item 39). The code model is guarded by bits/byte at each model's best
        # temperature; KL is kept as a trust region with room for the sharpening.
        gate=GateConfig(
            eval_bytes=20_000,
            bpb_tolerance=0.05,
            bpb_stop="\n",
            bpb_fit_temperature=True,
            max_heldout_rows=400,
            max_kl=0.75,
        ),
        # Each candidate withholds the suggestions whose first token it found least likely, within 3% of the kept
        # characters on the cycle's verdicts (docs/learning.md, "A suggestion filter").
        suggestion_filter=SuggestionFilterSettings(enabled=True),
        checkpoint_every=8,
    )


class DemoSettings(Section):
    cycles: int = Field(
        3,
        ge=1,
        description=(
            "Flywheel cycles `tidal demo` runs (continuing from the current champion). Three fit its 45-minute budget on 2 "
            "cores; in two measured runs of four, only the first cycle promoted (docs/learning.md, items 27-31)."
        ),
    )
    requests_per_cycle: int = Field(
        1200,
        ge=50,
        description=(
            "Simulated requests served since the last cycle collected before the next one collects (the users keep "
            "sending while a cycle runs, so after the first cycle there is rarely a wait)."
        ),
    )
    first_cycle_requests: int = Field(
        2400,
        ge=50,
        description=(
            "Simulated requests served before the model's first cycle collects (instead of requests_per_cycle). The first "
            "candidate learns from version 1's logs alone, while a later one trains on every row its champion logged, "
            "the traffic of the cycle before included; with 1,200 the first candidate was data-starved "
            "(docs/learning.md, item 39)."
        ),
    )
    eval_requests: int = Field(
        3000,
        ge=20,
        description=(
            "Held-out requests replayed per version at the end (the same requests for every version: paired "
            "differences). 3,000 resolve a doubling of a ~1% accept rate."
        ),
    )
    eval_concurrency: int = Field(
        16,
        ge=1,
        description=(
            "Held-out requests in flight at once during the replay (each is seeded, so the outcome does not depend on "
            "it; the engine batches them: ~3x the throughput of 4)."
        ),
    )
    quiet_while_training: bool = Field(
        True,
        description=(
            "Under demo.capacity.mode 'static' only: the users pause while a cycle trains, and the trainer gets every "
            "core (train.torch_threads unset), a trough made on demand. False: they keep typing, and the trainer gets "
            "the cores the fleet leaves free. Under 'tidal' the users follow `day` and never pause."
        ),
    )
    capacity: CapacitySettings = Field(
        default_factory=_demo_capacity,
        description=(
            "The capacity the demo runs on (replaces `capacity`, but for its host and port; forecast.day_s is the "
            "day's). 'static' (the default): the fleet keeps its replicas, the users pause while a cycle trains "
            "(quiet_while_training). 'tidal': the users follow `day`, the capacity scheduler sizes the cycled model "
            "between `serving`'s bounds and lends the rest of the pool to each cycle's trainer as a lease, revoked at "
            "the ramp (the run resumes on the next); on 2 cores it about doubles the demo (docs/learning.md, items 41-42)."
        ),
    )
    day: DailyCurve = Field(
        default_factory=_demo_day,
        description="The simulated users' day under demo.capacity.mode 'tidal' (unless demo.users.daily names one).",
    )
    serving: ServingCapacity = Field(
        default_factory=_demo_serving,
        description=(
            "Under 'tidal': the cycled model's capacity bounds (replace its models[].capacity; its `replicas` is moved "
            "into them). The fleet's other models keep the replicas they have (their minimum and maximum)."
        ),
    )
    update_strategy: UpdateStrategy | None = Field(
        "restart",
        description=(
            "How the model the demo cycles takes new versions (replaces its update_strategy while the demo runs; the "
            "other models keep theirs, so a fleet already serving it so is not restarted). Its "
            "training trains every weight (`demo.train.ppo.lora: false`), so it needs a full-checkpoint strategy: "
            "'restart' boots each candidate on a surge replica (CPU engines); 'reload' or 'nccl' on 2+ GPU replicas. "
            "None = each model's own (then the demo's lora setting must match it)."
        ),
    )
    users: SimUsersConfig = Field(default_factory=SimUsersConfig, description="The simulated users sending traffic.")
    canary: CanaryConfig = Field(
        default_factory=_demo_canary, description="Canary settings of the demo's cycles (replace `canary`)."
    )
    train: TrainSettings = Field(
        default_factory=_demo_train, description="Training settings of the demo's cycles (replace `train`)."
    )

    @model_validator(mode="before")
    @classmethod
    def _over_the_demo_defaults(cls, data):
        # A setting given for one of the demo's sections (TIDAL_DEMO__TRAIN__PPO__KL_COEF, a YAML key) changes that
        # one setting of it; without the merge, the sections' other settings would fall back to the
        # production defaults (e.g. PPO's full passes instead of the demo's 16 iterations).
        if isinstance(data, dict):
            defaults = (
                ("canary", _demo_canary),
                ("train", _demo_train),
                ("capacity", _demo_capacity),
                ("day", _demo_day),
                ("serving", _demo_serving),
            )
            for name, demo_default in defaults:
                if isinstance(data.get(name), dict):
                    data = {**data, name: deep_merge(demo_default().model_dump(), data[name])}
        return data

    @model_validator(mode="after")
    def _serving_bounds(self):
        hi = self.serving.max_replicas
        if hi is not None and hi < max(1, self.serving.min_replicas):
            raise ValueError(
                f"demo.serving.max_replicas={hi} is below demo.serving.min_replicas={self.serving.min_replicas}: "
                "raise max_replicas"
            )
        return self

    @model_validator(mode="after")
    def _strategy_serves_the_candidates(self):
        if self.update_strategy is not None and (problem := strategy_mismatch(self.update_strategy, self.train.ppo.lora)):
            raise ValueError(
                f"demo.update_strategy={self.update_strategy!r} with demo.train.ppo.lora="
                f"{str(self.train.ppo.lora).lower()}: {problem}"
            )
        return self
