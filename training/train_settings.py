"""Settings of the training plane: the `train` section (what a run computes), the `trainer` section (where
the trainer process runs) and the `bootstrap` section (how version 1 is made)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tidal.kube import GPU_RESOURCE, QUANTITY, Toleration, gpu_toleration, quantity_bytes, unpinned
from tidal.section import Section
from training.policy_config import PolicyConfig
from training.ppo_config import PPOConfig
from training.pretrain_config import PretrainConfig


class GateConfig(Section):
    max_kl: float = Field(
        0.5, gt=0, description="Largest mean per-token KL(candidate || champion), nats, on held-out logged completions."
    )
    ope_tolerance: float = Field(
        0.05, ge=0, description="The candidate's importance-weighted reward estimate may sit this far below the champion's."
    )
    min_ess: float = Field(
        10.0,
        ge=1,
        description="Below this effective sample size the reward estimate is reported as inconclusive and does not block.",
    )
    bpb_tolerance: float = Field(0.05, ge=0, description="Allowed increase of held-out code bits/byte over the champion.")
    eval_bytes: int = Field(30_000, ge=1000, description="Held-out code bytes scored for bits/byte (both models, same bytes).")
    seq_len: int = Field(256, ge=16, description="Window length of the bits/byte evaluation.")
    bpb_stop: str | None = Field(
        None,
        min_length=1,
        description=(
            "A stop string (the users' line break, '\\n'): bits/byte is scored given that the next token holds no such "
            "string (tokens holding it are masked out of each prediction and not scored as targets). Tab training moves "
            "the stop decision on purpose; this way the gate charges the code model, not that decision. None scores every "
            "token."
        ),
    )
    bpb_fit_temperature: bool = Field(
        False,
        description=(
            "Score each model's bits/byte at its best temperature (its logits times the scale in 0.5-4 that scores "
            "least, training/pretrain.py fitted_bits_per_byte), so a candidate that is only sharper than the champion "
            "(what sharpen_coef and kept credit teach) is not charged for it; a worse code model scores worse at every "
            "temperature and is still refused."
        ),
    )
    min_heldout_rows: int = Field(
        4, ge=1, description="Fewer held-out logged rows than this fails the gate: too little evidence."
    )
    max_heldout_rows: int | None = Field(
        None,
        ge=1,
        description=(
            "Score KL and the reward estimate on at most this many held-out rows (a uniform subset, the same in every "
            "run over a dataset); None = all of them. Bounds the gate's time as datasets grow."
        ),
    )


class SuggestionFilterSettings(Section):
    """Fitting each candidate's suggestion filter (data_contracts/suggestion_filter.py) in the offline gate."""

    enabled: bool = Field(
        False,
        description=(
            "Fit a threshold on the candidate's log-prob of each logged completion's first token, registered with the "
            "version: the gateway withholds that version's completions below it. Off: the candidate shows every completion."
        ),
    )
    max_chars_loss: float = Field(
        0.03,
        ge=0,
        lt=1,
        description="Largest share of the logged verdicts' kept characters the threshold may withhold.",
    )
    max_withheld: float = Field(
        0.4, gt=0, lt=1, description="Largest share of the logged completions the threshold may withhold."
    )
    min_kept_rows: int = Field(
        20,
        ge=1,
        description="Fewer logged completions with kept characters than this: no threshold (too little evidence), said so.",
    )


class TrainSettings(Section):
    ppo: PPOConfig = Field(default_factory=PPOConfig, description="PPO hyper-parameters (logged with every run).")
    gate: GateConfig = Field(default_factory=GateConfig, description="Offline gate a candidate passes before any traffic.")
    suggestion_filter: SuggestionFilterSettings = Field(
        default_factory=SuggestionFilterSettings, description="The candidate's suggestion filter, fitted by the offline gate."
    )
    heldout_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description=("Share of a dataset's rows (by a hash of the request id) kept out of training for the offline gate."),
    )
    min_train_rows: int = Field(16, ge=1, description="Fewer usable training rows than this fails the run before it starts.")
    checkpoint_every: int = Field(5, ge=1, description="Save the training state to the object store every this many iterations.")
    retries: int = Field(
        2, ge=0, description="Times the train flow restarts a crashed trainer process (each resumes from its last checkpoint)."
    )
    retry_delay_s: float = Field(2.0, ge=0, description="Wait before restarting a crashed trainer.")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "torch.set_num_threads in the trainer. None = the cores the local CPU fleet leaves free (at least 1): more "
            "threads than free cores makes every training step tens of times slower while replicas run."
        ),
    )


# ---- where the trainer process runs (the `trainer` section) ----------------------------------------
# Kept out of TrainSettings on purpose: TrainSettings is digested into the run key and copied into every
# trainer spec, and where a run executes changes neither its result nor what the trainer needs to know
# (and `env` may carry values that have no place in a spec file in the object store).


class KubernetesJobSettings(Section):
    """The batch/v1 Job that runs `python -m training.job` (training/launch/k8s_manifest.py renders it). Defaults
    match infra/: the chart's ConfigMap and service accounts, the training node group's label and taint."""

    namespace: str = Field("tidal", description="Namespace of the trainer Jobs (the chart's release namespace).")
    image: str = Field(
        "",
        description=(
            "The Tidal image (repository:tag or @sha256 digest), the same the chart runs; required with launcher "
            "'kubernetes'. An untagged or 'latest' image is refused: a retried run must get the same code."
        ),
    )
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of the trainer container."
    )
    service_account: str = Field(
        "tidal-trainer",
        description=(
            "Service account of the trainer pod: its IAM role (IRSA) reads datasets and reads/writes checkpoints and training/."
        ),
    )
    priority_class: str | None = Field(
        "tidal-training",
        description=(
            "priorityClassName of the trainer pod: below serving's (the chart's priorityClasses), so that serving pods "
            "that need its node preempt it; it then checkpoints and its Job starts a new pod that resumes "
            "(podFailurePolicy). None: the cluster's default priority."
        ),
    )
    gpus_per_node: int = Field(
        1,
        ge=0,
        le=16,
        description=(
            f"{GPU_RESOURCE} requested (and limited) per pod; 0 = a CPU-only pod. Above 1 the container runs "
            "`torchrun --nproc-per-node N -m training.job`: N processes, one per GPU, train data parallel, each on "
            "its shard of every batch (train.ppo.batch_size must be at least N), to the weights one process would "
            "reach; the pod's CPU threads are shared among them. The gate runs in one of them."
        ),
    )
    cpu_request: float = Field(4.0, gt=0, description="CPU cores requested.")
    cpu_limit: float = Field(
        8.0, gt=0, description="CPU cores limit; also the trainer's torch threads unless train.torch_threads is set."
    )
    memory_request: str = Field("32Gi", pattern=QUANTITY, description="Memory requested (Kubernetes quantity).")
    memory_limit: str = Field(
        "64Gi",
        pattern=QUANTITY,
        description=("Memory limit (Kubernetes quantity); past it the pod is OOM-killed (a crash: retried, resumes)."),
    )
    shm_size: str = Field(
        "8Gi", pattern=QUANTITY, description="Size of /dev/shm (memory-backed; counts against the memory limit)."
    )
    scratch_size: str = Field(
        "100Gi",
        pattern=QUANTITY,
        description=("Size limit of each scratch volume: data_dir (the checkpoint cache) and /tmp (a candidate before upload)."),
    )
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"tidal.dev/pool": "training"},
        description=("Node labels the pod must match; the default is infra/terraform's training node group."),
    )
    tolerations: list[Toleration] = Field(
        default_factory=gpu_toleration,
        description=("Taints the pod tolerates; the default tolerates the GPU node groups' nvidia.com/gpu=true:NoSchedule."),
    )
    settings_configmap: str = Field(
        "tidal-settings",
        description=(
            "ConfigMap holding tidal.yaml (the chart's), mounted at /etc/tidal: the trainer's store, MLflow and data_dir."
        ),
    )
    data_dir: str = Field(
        "/var/lib/tidal", description="Mount point of the scratch volume; must equal data_dir in that tidal.yaml."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the trainer container.")
    env_from_secrets: list[str] = Field(
        default_factory=list, description="Secrets whose keys become environment variables (envFrom)."
    )
    run_as_user: int = Field(10001, ge=1, description="Non-root uid (and gid) of the container, as in the chart.")
    active_deadline_s: int = Field(
        86400,
        ge=60,
        description=(
            "Kubernetes stops the Job after this long, pending time included (no GPU node, image not pulled): a crash, retried."
        ),
    )
    ttl_seconds_after_finished: int = Field(
        3600,
        ge=0,
        description=(
            "Kubernetes deletes a finished Job after this long; the launcher deletes it at once, this cleans up after a lost flow."
        ),
    )
    poll_s: float = Field(10.0, gt=0, description="How often the launcher reads the Job's status.")
    kube_context: str | None = Field(
        None, description=("kubeconfig context when the flow runs outside the cluster; inside a pod its service account is used.")
    )

    @model_validator(mode="after")
    def _requests_within_limits(self):
        if self.cpu_request > self.cpu_limit:
            raise ValueError(f"cpu_request {self.cpu_request} > cpu_limit {self.cpu_limit}: raise cpu_limit or lower cpu_request")
        if quantity_bytes(self.memory_request) > quantity_bytes(self.memory_limit):
            raise ValueError(f"memory_request {self.memory_request} > memory_limit {self.memory_limit}: raise memory_limit")
        return self

    def problems(self, stores: dict[str, str], mlflow_host: str) -> list[str]:
        """What stops a pod from running the trainer, each with its fix. `stores`: area -> store URL it uses."""
        out = []
        if not self.image:
            out.append("set trainer.kubernetes.image to the Tidal image (repository:tag) pushed where the nodes pull from")
        elif problem := unpinned("trainer.kubernetes.image", self.image):
            out.append(problem)
        local = sorted(f"{area} ({url or 'local disk'})" for area, url in stores.items() if not url.startswith("s3://"))
        if local:
            out.append(
                f"the trainer pod cannot read this machine's disk, but store areas {', '.join(local)} are local: "
                "set store.url (or store.routes) to s3://bucket/prefix"
            )
        if mlflow_host in ("127.0.0.1", "localhost", "::1", "0.0.0.0") or mlflow_host.startswith("127."):
            out.append(
                f"MLflow's host {mlflow_host!r} (mlflow.url or mlflow.host) is this machine's loopback, which a pod cannot reach: use the MLflow "
                "service's cluster address (e.g. tidal-mlflow.tidal.svc.cluster.local)"
            )
        return out


class LaunchSettings(Section):
    launcher: Literal["local", "kubernetes"] = Field(
        "local",
        description=(
            "Where `python -m training.job` runs: 'local' = a subprocess of the flow, 'kubernetes' = a batch/v1 Job "
            "(needs trainer.kubernetes.image, an s3:// store and an MLflow the pods reach; checked at start-up)."
        ),
    )
    kubernetes: KubernetesJobSettings = Field(
        default_factory=KubernetesJobSettings, description=("The trainer Job, with launcher 'kubernetes'.")
    )
    local_processes: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "With launcher 'local': trainer processes on this machine. Above 1 the flow runs `torchrun --standalone "
            "--nproc-per-node N -m training.job` (data parallel, or the Megatron backend's tensor-parallel shards: a "
            "multiple of train.ppo.tensor_parallel), one GPU each where CUDA exists, else gloo on the CPU."
        ),
    )


class BootstrapSettings(Section):
    """How version 1 is made: its tokenizer, architecture, pretraining and served-weight probe."""

    vocab_size: int = Field(1024, ge=300, description="Byte-level BPE vocabulary size of the base tokenizer.")
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description="Share of stdlib files (by path hash) never trained on.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Base policy architecture.")
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig, description="Pretraining budget and optimiser.")
    probe_prompts: int = Field(4, ge=1, description="Prompts in each version's served-weight probe.")
    probe_tokens: int = Field(8, ge=1, description="Greedy tokens per probe prompt.")

    @model_validator(mode="after")
    def _windows_fit_the_context(self):
        context = self.policy.max_position_embeddings
        if self.pretrain.seq_len > context:
            raise ValueError(
                f"bootstrap.pretrain.seq_len={self.pretrain.seq_len} exceeds bootstrap.policy.max_position_embeddings="
                f"{context}: the policy has no position for the rest of each window; lower seq_len or raise the context"
            )
        return self
