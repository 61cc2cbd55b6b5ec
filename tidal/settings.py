"""The settings root: every component's sections composed into one `TidalSettings`, and the rules across them.

Each section is declared by the component it configures (the core's in `tidal/core_settings.py`, serving's in
`serving/settings.py`, training's in `training/train_settings.py`, ...); this module only composes them and checks
what no one component can. It sits above the components: the CLI, the demo and the flows load it; a component's
own process loads its own root (`serving.settings.load_serving_settings`). See `tidal/core_settings.py` for where
settings are read from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from capacity.settings import CapacitySettings, capacity_problems
from data_contracts.records import feedback_group
from release.canary_config import CanaryConfig
from release.webhook_settings import RegistryWebhookSettings
from serving.settings import ServingSettings
from tidal.core_settings import load_root
from tidal.loop_settings import DemoSettings, FlywheelSettings
from tidal.model_settings import CANARY_METRICS
from tidal.prometheus import PrometheusSettings
from training.train_settings import BootstrapSettings, LaunchSettings, TrainSettings

if TYPE_CHECKING:
    from data_contracts.reward_rules import BaseRewardRule
    from training.ppo_config import PPOConfig


class TidalSettings(ServingSettings):
    """Every section of tidal.yaml; unknown keys are refused."""

    model_config = SettingsConfigDict(extra="forbid")

    bootstrap: BootstrapSettings = Field(default_factory=BootstrapSettings)
    train: TrainSettings = Field(default_factory=TrainSettings, description="Training plane: PPO, checkpoints, offline gate.")
    trainer: LaunchSettings = Field(
        default_factory=LaunchSettings, description="Where the trainer process runs: a local subprocess or a Kubernetes Job."
    )
    canary: CanaryConfig = Field(
        default_factory=CanaryConfig, description="Release plane: canary ramp, sequential test, guardrails."
    )
    flywheel: FlywheelSettings = Field(default_factory=FlywheelSettings, description="How the deployed loop is scheduled.")
    registry_webhook: RegistryWebhookSettings = Field(
        default_factory=RegistryWebhookSettings,
        description="Releases started by alias moves in the MLflow registry (release/registry_webhook.py).",
    )
    capacity: CapacitySettings = Field(
        default_factory=CapacitySettings,
        description="Serving's off-peak capacity lent to training (`mode: tidal`), or a static split (capacity/).",
    )
    prometheus: PrometheusSettings = Field(
        default_factory=PrometheusSettings, description="The local Prometheus of `tidal up --with-prometheus`."
    )
    demo: DemoSettings = Field(
        default_factory=DemoSettings, description="What `tidal demo` runs: cycles, simulated users, its canary and training."
    )

    @model_validator(mode="after")
    def _check_training(self) -> TidalSettings:
        if self.trainer.launcher == "kubernetes":  # the trainer reads datasets, checkpoints and writes training/
            stores = {area: self.store.routes.get(area, self.store.url) for area in ("datasets", "checkpoints", "training")}
            problems = self.trainer.kubernetes.problems(stores, self.mlflow.server_host)
            if problems:
                raise ValueError("trainer.launcher 'kubernetes':" + "".join(f"\n    - {p}" for p in problems))
        # every trainer process holds one tensor-parallel shard; the processes must fill whole shard groups
        processes = (
            self.trainer.local_processes if self.trainer.launcher == "local" else max(1, self.trainer.kubernetes.gpus_per_node)
        )
        tp = self.train.ppo.tensor_parallel
        if processes % tp:
            where = "trainer.local_processes" if self.trainer.launcher == "local" else "trainer.kubernetes.gpus_per_node"
            raise ValueError(
                f"train.ppo.tensor_parallel={tp} needs a multiple of {tp} trainer processes, but {where}="
                f"{processes}: set {where} to {tp} (or a multiple)"
            )
        return self

    @model_validator(mode="after")
    def _check_planes_agree(self) -> TidalSettings:
        """Settings of two planes that describe one thing must agree; each refusal names both and the fix."""
        problems = []
        collect_len, engine_len = self.collect.max_model_len, self.engine.max_model_len
        if collect_len < engine_len:  # the contract would quarantine rows the engines served, as too_many_tokens
            problems.append(
                f"collect.max_model_len={collect_len} is below engine.max_model_len={engine_len}: completions the "
                f"engines serve between {collect_len} and {engine_len} tokens would be quarantined as too long; set "
                f"collect.max_model_len to {engine_len}"
            )
        lora_models = [m.name for m in self.models if m.update_strategy == "lora"]
        demo_lora = self.demo.update_strategy == "lora" or (self.demo.update_strategy is None and lora_models)
        for section, ppo, served in (("train", self.train.ppo, lora_models), ("demo.train", self.demo.train.ppo, demo_lora)):
            if served and ppo.lora and ppo.lora_rank > self.engine.max_lora_rank:  # vLLM refuses the adapter at load
                problems.append(
                    f"{section}.ppo.lora_rank={ppo.lora_rank} is above engine.max_lora_rank={self.engine.max_lora_rank}: "
                    f"the engines could not load the adapters it trains; set engine.max_lora_rank to {ppo.lora_rank} or "
                    f"lower {section}.ppo.lora_rank"
                )
        for m in self.models:
            for section, ppo in (("train", self.train.ppo), ("demo.train", self.demo.train.ppo)):
                if m.corpus.source == "none" and ppo.ptx_coef > 0:  # the code loss would have no text to learn from
                    problems.append(
                        f"model {m.name} has no corpus (models[].corpus.source: none) but {section}.ppo.ptx_coef="
                        f"{ppo.ptx_coef} mixes a code loss on it into training; set {section}.ppo.ptx_coef to 0, or name "
                        "the model's text in corpus.source"
                    )
        problems += capacity_problems(self.capacity, self.models)
        problems += self._rule_problems()
        if problems:
            raise ValueError("settings disagree:" + "".join(f"\n    - {p}" for p in problems))
        return self

    def _rule_problems(self) -> list[str]:
        """Each model's reward rule must read an event the model takes (its judge's scores count), a judge on the fleet
        must be a model of it, and train's Tab-only training aids need a Tab rule."""
        problems = []
        names = {m.name for m in self.models}
        for unknown in sorted(set(self.collect.reward_rules) - names):
            problems.append(f"collect.reward_rules names {unknown!r}, which is no model ({sorted(names)}); fix the name")
        for m in self.models:
            rule = self.collect.rule_for(m.name)
            taken = {feedback_group(e) for e in m.feedback.events} | ({"judge"} if m.judge is not None else set())
            needs = CANARY_METRICS[self.canary.primary][1]
            if m.canary is None and needs is not None and needs not in m.feedback.events:
                problems.append(
                    f"canary.primary={self.canary.primary!r} needs the '{needs}' event, which model {m.name} does not "
                    f"take (models[].feedback.events={m.feedback.events}): set models[].canary for it, or another primary"
                )
            if m.judge is not None and m.judge.endpoint == "fleet" and m.judge.model not in names:
                problems.append(
                    f"model {m.name}'s judge {m.judge.id} is a model on the fleet, {m.judge.model!r}, which is no model "
                    f"({sorted(names)}): name one in models[].judge.model, or give the judge's endpoint URL"
                )
            if not taken & set(rule.reads):
                problems.append(
                    f"model {m.name}'s reward rule {rule.id} (plugin {rule.plugin}) reads {list(rule.reads)} feedback but "
                    f"the model takes only {m.feedback.events} (models[].feedback.events): no completion could be "
                    "rewarded; add an event the rule reads, or choose another rule"
                )
            # the demo's training is checked when the demo starts (tidal/demo.py: demo_profile), not here
            if problem := tab_aids_problem(m.name, rule, "train", self.train.ppo):
                problems.append(problem)
        return problems


def tab_aids_problem(model: str, rule: BaseRewardRule, section: str, ppo: PPOConfig) -> str | None:
    """Why `section`.ppo cannot train `model` under `rule`, or None (PPOConfig.tab_aids: the trainer refuses the
    same combination on a dataset, training/job.py)."""
    if rule.plugin == "cursor-tab" or not ppo.tab_aids:
        return None
    return (
        f"model {model}'s reward rule {rule.id} is not the Tab rule (plugin {rule.plugin}), but {section}.ppo asks for "
        f"hindsight rows, split credit or stop credit, which value partial suggestions by it; set "
        f"{section}.ppo.hindsight_partials=false, partial_credit=last_token and stop_credit_coef=0, or reward the model "
        "with plugin cursor-tab"
    )


def load_settings(**overrides) -> TidalSettings:
    """Read every section once at start-up; a bad value raises SettingsError naming field and fix."""
    return load_root(TidalSettings, **overrides)
