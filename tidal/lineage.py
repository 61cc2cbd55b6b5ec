"""Lineage tags of a registered version (MLflow model-version tags, and the run tags that mirror them): every
name in one place. `tidal.registry.VersionInfo` reads them typed; writers use these names, never a literal.
"""

from __future__ import annotations

import json

KIND = "tidal.kind"  # 'full' or 'lora'
BASE_VERSION = "tidal.base_version"  # the full checkpoint a LoRA applies to; the version itself for `full`
CHECKPOINT_DIGEST = "tidal.checkpoint.digest"  # sha256 over the checkpoint's files (tidal/registry.py)
ORIGIN = "tidal.origin"  # 'bootstrap', 'ppo', 'import', or who else published it
SOURCE = "tidal.source"  # an imported checkpoint's directory or s3:// prefix
SOURCE_DIGEST = "tidal.source_digest"  # sha256 over the imported files as found there (without Tidal's probe.json)
ARCHITECTURE = "tidal.architecture"  # an imported checkpoint's config.architectures[0]
PROBE_DTYPE = "tidal.probe_dtype"  # the engine dtype an imported version's probe was recorded at
PARENT_VERSION = "tidal.parent_version"  # the champion it was trained from; 'none' for version 1
TRAIN_RUN = "tidal.train_run"  # the training run's key (training/job_spec.py run_key)
MLFLOW_RUN = "tidal.mlflow_run"  # the MLflow run of that training
DATASET_ID = "tidal.dataset_id"
DATASET_DIGEST = "tidal.dataset_digest"
REWARD_RULE = "tidal.reward_rule"  # the dataset's reward rule id
REWARD_RULE_PLUGIN = "tidal.reward_rule.plugin"  # its plugin and the package that provided it: 'feedback-blend (tidal-rl 0.1.0)'
RESCORED_FROM = "tidal.rescored_from"  # a re-scored dataset's source dataset id (data_contracts/rescore.py)
RESCORED_FROM_RULE = "tidal.rescored_from.rule"  # that source's reward rule id
CONTRACT_VERSION = "tidal.contract_version"  # of the data contracts that built the dataset
CODE_REVISION = "tidal.code_revision"
HPARAMS = "tidal.hparams"  # the PPO configuration, as JSON
TRAIN_ROWS = "tidal.train_rows"
PARAMS = "tidal.params"  # parameter count (version 1)
HELDOUT_BITS_PER_BYTE = "tidal.heldout_bits_per_byte"  # version 1's pretraining result
GATE_PREFIX = "tidal.gate."  # one tag per offline-gate check, 'pass: ...' or 'FAIL: ...'
GATE_PASSED = "tidal.gate.passed"  # 'true' or 'false'
GATE_REASON = "tidal.gate.reason"  # the failing checks, when it failed
GATE_FIGURE_PREFIX = "tidal.gate.figure."
SUGGESTION_FILTER = "tidal.suggestion_filter"  # the version's suggestion filter, JSON (data_contracts/suggestion_filter.py)
RELEASE_PREFIX = "tidal.release."  # an audit record per release event, JSON (release/operations.py audit)
RELEASE_FAILED_CHECK = "tidal.release.failed_check"  # the guardrail or test that rolled a canary back
MANAGED = "tidal.managed"  # on a registered model this platform created
# set by an operator before moving an alias in the registry UI (release/registry_webhook.py)
GATE_OVERRIDE = "tidal.gate_override"  # who lets a version that did not pass its gate be released, and why
IMMEDIATE = "tidal.rollout_immediate"  # a hand-set champion is served at once, without the probe on every replica
ALIAS_MARK = "tidal.alias_mark."  # + alias: when Tidal itself last moved that alias here (ms), consumed by the receiver


def release_tag(event: str) -> str:
    """The audit tag of one release event ('promoted', 'rolled_back', 'reconciled', 'approved', ...)."""
    return RELEASE_PREFIX + event


def flag(value: bool) -> str:
    """A boolean as tags store it."""
    return str(value).lower()


def read_flag(value: str | None) -> bool | None:
    """'true' / 'false' as a bool; None when the tag is absent."""
    return None if value is None else value == "true"


def read_json(value: str | None) -> dict | None:
    return None if value is None else json.loads(value)


def rule_plugin_tag(plugin: str | None, package: str | None) -> str:
    """The REWARD_RULE_PLUGIN value of a dataset's rule ('unrecorded' for datasets older than the field)."""
    if plugin is None:
        return "unrecorded"
    return f"{plugin} ({package})" if package else plugin


def rescore_tags(source_id: str | None, source_rule) -> dict[str, str]:
    """RESCORED_FROM and RESCORED_FROM_RULE of a re-scored dataset's run or candidate ({} for a collection from the
    watermark). source_rule: the source's RuleRef (anything with an `id`), or None."""
    if source_id is None:
        return {}
    return {RESCORED_FROM: source_id, RESCORED_FROM_RULE: source_rule.id if source_rule is not None else "unrecorded"}
