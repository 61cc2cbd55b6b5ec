"""What the train flow hands the trainer process, and the exit codes it reads back.

Kept free of torch: the flow imports this module, the trainer (training/job.py) is only ever run as
its own process (`python -m training.job train|gate SPEC.json`; a Kubernetes Job later).

Store layout of one training run (its key digests everything that determines the result, so a retried
or re-submitted run finds its own checkpoints and never trains twice):

    training/model=M/<run-key>/state/iter-000004.pt    PPO state every checkpoint_every iterations
    training/model=M/<run-key>/candidate/...           served weights, probe.json, critic.pt
    training/model=M/<run-key>/result.json             written last: the run finished
    training/model=M/<run-key>/gate.json               the offline gate's report
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, Field

from data_contracts.suggestion_filter import SuggestionFilter
from tidal import lineage
from tidal.model_settings import CorpusSource
from training.train_settings import TrainSettings

EXIT_BAD_INPUT = 2  # dataset or configuration unusable: retrying cannot help
EXIT_DIVERGED = 3  # non-finite loss or weights: retrying replays the same divergence
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after a checkpoint (training/preemption.py); run again to resume


class TrainJob(BaseModel):
    model: str = Field(description="Registered model name.")
    run_key: str = Field(description="Digest of model, dataset, champion and settings: names the run everywhere.")
    dataset_id: str = Field(description="Reward dataset trained on (datasets/model=M/<id>/).")
    dataset_digest: str = Field(description="Its manifest's sha256, checked again by the trainer.")
    champion_version: int = Field(description="Version the policy starts from; also the KL reference.")
    tracking_uri: str = Field(description="MLflow server the trainer logs metrics to.")
    mlflow_run_id: str = Field(description="MLflow run of this training run (created by the flow, reused by retries).")
    train: TrainSettings = Field(description="The training settings in force.")
    corpus_heldout_fraction: float = Field(
        gt=0,
        lt=1,
        description=(
            "bootstrap.heldout_fraction: the share of the code corpus version 1 never saw (data_contracts/corpus.py). The "
            "pretraining-mix loss reads only the other files, the gate's held-out code only these."
        ),
    )
    corpus: CorpusSource = Field(
        default_factory=CorpusSource, description="The model's corpus (models[].corpus): the code loss's and the gate's text."
    )
    torch_threads: int = Field(ge=1, description="torch.set_num_threads of the trainer (train.torch_threads, or derived).")
    pushgateway_url: str | None = Field(
        None, description="prometheus.pushgateway_url: where the trainer pushes its progress (None: it pushes nothing)."
    )

    @property
    def prefix(self) -> str:
        return f"training/model={self.model}/{self.run_key}"


def run_key(
    model: str,
    dataset_digest: str,
    champion_version: int,
    train: TrainSettings,
    corpus_heldout_fraction: float,
    corpus: CorpusSource | None = None,
) -> str:
    """Same inputs, same key: a resubmitted run resumes (or returns) instead of training again. Every field of the
    spec that changes what the trainer computes is here; the operational ones (retries, threads) are not."""
    operational = {"retries", "retry_delay_s", "torch_threads"}
    if train.suggestion_filter == type(train.suggestion_filter)():  # fitted by the gate; the default keeps earlier keys
        operational.add("suggestion_filter")
    settings = train.model_dump(mode="json", exclude=operational)
    parts = [model, dataset_digest, champion_version, settings, corpus_heldout_fraction]
    if corpus is not None and corpus != CorpusSource():  # the default keeps the keys runs had before corpora were settings
        parts.append(corpus.model_dump(mode="json"))
    blob = json.dumps(parts, sort_keys=True)
    return "run-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


class TrainResult(BaseModel):
    iterations: int = Field(description="PPO iterations in the plan (all done).")
    resumed_from: int | None = Field(description="Iteration the last process resumed after (None: ran from the start).")
    train_rows: int = Field(description="Rows trained on: served rows after the stale/empty filter, plus hindsight rows.")
    heldout_rows: int = Field(description="Rows kept out for the gate.")
    dropped: dict[str, int] = Field(description="Training rows left out, by reason (stale, newer, empty).")
    final: dict[str, float] = Field(description="Metrics of the last iteration.")
    tokens_per_s: float = Field(description="Mean charts/tokens_per_s over the iterations of the last process.")
    kind: str = Field(description="'lora' or 'full': how the candidate is served.")
    hindsight_rows: int = Field(0, description="Hindsight rows added from partial verdicts (part of train_rows).")
    hindsight_skipped: dict[str, int] = Field(default_factory=dict, description="Partials without a hindsight row, by reason.")
    credited_partials: int = Field(0, description="Partials whose reward was split along the kept prefix (partial_credit).")
    train_s: float = Field(
        0.0,
        description=(
            "Wall seconds of the process that finished the run, from its start to its result (a resumed run counts "
            "its last attempt only)."
        ),
    )
    mlflow_s: float = Field(
        0.0,
        description=(
            "Wall seconds the last process spent in MLflow calls (its per-iteration metric batches); bench/cycle.py "
            "counts them as orchestration time."
        ),
    )


class GateCheck(BaseModel):
    name: str
    passed: bool
    value: float | None
    limit: float | None
    detail: str


class GateReport(BaseModel):
    passed: bool
    checks: list[GateCheck]
    figures: dict[str, float]
    suggestion_filter: SuggestionFilter | None = Field(
        None, description="The candidate's suggestion filter, fitted on the dataset (train.suggestion_filter); None: off."
    )

    @property
    def reason(self) -> str:
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.passed)

    def tags(self) -> dict[str, str]:
        """MLflow version tags: one per check plus the verdict and, when failed, the reason."""
        tags = {lineage.GATE_PASSED: lineage.flag(self.passed)}
        for c in self.checks:
            tags[lineage.GATE_PREFIX + c.name] = ("pass" if c.passed else "FAIL") + f": {c.detail}"
        tags.update({lineage.GATE_FIGURE_PREFIX + k: f"{v:.6g}" for k, v in self.figures.items()})
        if not self.passed:
            tags[lineage.GATE_REASON] = self.reason
        if self.suggestion_filter is not None:
            tags[lineage.SUGGESTION_FILTER] = self.suggestion_filter.model_dump_json()
        return tags
