"""The trainer process: `python -m training.job train|gate SPEC`.

SPEC is the TrainJob JSON the flow wrote: a local path, or `store:<key>` for an object in the object store
(how a trainer in a Kubernetes pod, which cannot read the flow's disk, finds it; training/launch/).

    train   dataset -> PPO from the champion (resuming from the run's last checkpoint) -> candidate + result.json
    gate    candidate vs champion on held-out logged rows and held-out code -> gate.json

It never runs inside a serving process, and a crash (kill -9 included) loses at most checkpoint_every
iterations: the next attempt resumes from the last saved state and ends with the same weights.
Exit codes: 0 done, EXIT_BAD_INPUT (unusable dataset, settings or spec), EXIT_DIVERGED (non-finite
training), EXIT_PREEMPTED (SIGTERM: stopped after a checkpointed iteration, training/preemption.py); anything
else is a crash worth retrying.

Several processes: `torchrun --nproc-per-node N -m training.job train SPEC` (what the Kubernetes launcher runs
for trainer.kubernetes.gpus_per_node = N > 1) trains data parallel, one process per GPU (training/distributed.py,
training/ppo_trainer.py): each rolls out and trains on its shard of every batch, and all keep the same weights,
those one process would reach over the same plan (up to float rounding). Rank 0 alone logs to MLflow, writes
checkpoints, the candidate and result.json, and prints progress (other ranks print only their own errors,
naming their rank); the others then meet it at a final barrier and exit 0.
Checkpoints are the same as one process's, so an attempt resumes with any number of processes. `gate` runs in
rank 0 alone as one process (a forward pass per model); the other ranks exit 0 at once. Every rank reaches the
same verdict on bad input and divergence (all read the same data and see the same summed losses) and exits
with its code; a rank that fails alone exits non-zero and torchrun stops the others. torchrun itself exits 1
for any failed worker, so from several processes the flow sees a crash (retried), not the code above.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from data_contracts.samples import RewardSample
from data_contracts.suggestion_filter import describe
from tidal.clock import now_ms
from tidal.core_settings import SettingsRoot, load_root
from tidal.model_settings import CorpusSource
from tidal.registry import Registry
from tidal.store import ObjectStore, get_json, local_corpus, open_store, put_json, upload_dir
from training import distributed
from training.distributed import LaunchEnvError
from training.job_spec import EXIT_BAD_INPUT, EXIT_DIVERGED, TrainJob, TrainResult
from training.launch.base import STORE_REF
from training.preemption import EXIT_PREEMPTED, Preempted, StopRequest
from training.progress import Progress
from training.reward_data import DatasetError, RewardDataset, at_most, load_dataset, split
from training.run_files import Checkouts, latest_state_key, load_state

if TYPE_CHECKING:  # the trainer's modules load torch models; imported where the run needs them
    from training.hindsight import HindsightRows
    from training.partial_credit import CreditedRows
    from training.ppo_trainer import PPOTrainer


def core_settings() -> SettingsRoot:
    """What the trainer reads of this process's settings: where the object store is and the local cache. Everything
    that decides the result is in the spec (and its run key)."""
    return load_root(SettingsRoot)


def loss_terms(cfg, tokenizer, rule, corpus_heldout_fraction: float, corpus=None) -> dict:
    """The PPOTrainer's optional terms as `cfg` (a PPOConfig) asks for them: {"ptx", "stop", "kept", "sharpen"}, each None
    when its coefficient is 0. `rule` (the dataset's RewardRule) values the stop credit's cuts."""
    from training.kept_credit import KeptCredit
    from training.ptx import ptx_loss_for
    from training.sharpen import Sharpen
    from training.stop_credit import StopCredit

    return {
        "ptx": ptx_loss_for(cfg, tokenizer, corpus_heldout_fraction, corpus),
        "stop": StopCredit(tokenizer, rule, cfg.hindsight_stop, cfg.stop_credit_abstain, cfg.abstain_vs_best_cut)
        if cfg.stop_credit_coef > 0
        else None,
        "kept": KeptCredit(tokenizer) if cfg.kept_credit_coef > 0 else None,
        "sharpen": Sharpen(tokenizer, cfg.hindsight_stop) if cfg.sharpen_coef > 0 else None,
    }


def train(spec: TrainJob) -> None:
    """select rows -> build the trainer -> resume -> train -> publish the candidate, then result.json."""
    from training.policy import load_tokenizer
    from training.ppo_trainer import iteration_plan

    started, cfg, world = time.perf_counter(), spec.train.ppo, distributed.world_size()
    say = print if distributed.is_main() else _silent  # one voice: rank 0's
    core = core_settings()
    store, registry = open_store(core), Registry(spec.tracking_uri)
    if store.exists(f"{spec.prefix}/result.json"):
        say(f"{spec.run_key}: already finished; nothing to do", flush=True)
        return
    torch.set_num_threads(max(1, spec.torch_threads // world))  # the pod's cores, shared by its processes
    torch.manual_seed(cfg.seed)

    data = checked_dataset(store, spec)
    picked = pick_rows(spec, data)  # before any download: too few usable rows is bad input
    with distributed.main_first():  # rank 0 fills the node's checkpoint (and corpus) cache, then the others find it complete
        dirs = Checkouts(spec, store, registry, core.data_path / "cache")
        corpus = local_corpus(spec.corpus, core, core.data_path / "cache") if cfg.ptx_coef > 0 else spec.corpus
    tokenizer = load_tokenizer(dirs.base_dir)
    rows = shape_rows(spec, picked, data, tokenizer, say)
    plan = iteration_plan(len(rows.samples), cfg)
    if len(plan[0]) < world:  # every batch has min(batch_size, rows) rows
        raise LaunchEnvError(
            f"batches of {len(plan[0])} rows cannot be split over {world} processes: raise "
            f"train.ppo.batch_size to at least {world}, or start fewer (trainer.kubernetes.gpus_per_node)"
        )
    built = build_trainer(spec, dirs, tokenizer, data, corpus)
    start, state = resume(built, store, spec, rows.samples, plan, say)
    with StopRequest() as stop:  # SIGTERM from here on: stop after the iteration in progress, checkpointed
        progress = Progress(spec, store, built, len(plan), stop)
        history = built.trainer.train(rows.samples, plan, start, progress.after_iteration)  # every rank, in step
    publish(
        spec,
        store,
        dirs,
        built,
        rows,
        history,
        state,
        plan_len=len(plan),
        mlflow_s=progress.mlflow_s,
        train_s=time.perf_counter() - started,
    )


def checked_dataset(store: ObjectStore, spec: TrainJob) -> RewardDataset:
    data = load_dataset(store, spec.model, spec.dataset_id)
    if data.digest != spec.dataset_digest:
        raise DatasetError(
            f"dataset {spec.dataset_id} changed since the run was planned ({data.digest[:19]}… vs "
            f"{spec.dataset_digest[:19]}…); start a new run"
        )
    return data


@dataclass
class Rows:
    samples: list[RewardSample]  # served rows, then hindsight rows
    heldout: int  # rows kept out for the gate
    dropped: dict[str, int]  # training rows left out, by reason
    hindsight: HindsightRows  # the hindsight rows added from partial verdicts, and what was skipped
    credit: CreditedRows | None  # the partials split along their kept prefix (train.ppo.partial_credit)


@dataclass
class Picked:
    kept: list[RewardSample]  # the train side's usable rows, in dataset order
    heldout: int  # rows kept out for the gate
    dropped: dict[str, int]  # training rows left out, by reason


def pick_rows(spec: TrainJob, data: RewardDataset) -> Picked:
    """The dataset's train side, fresh enough for the champion; fewer than train.min_train_rows is bad input."""
    from training.rollout import select_samples

    train_rows, heldout = split(data.samples, spec.train.heldout_fraction)
    picked = select_samples(train_rows, spec.champion_version, spec.train.ppo.max_stale_versions)
    dropped = {"stale": picked.stale, "newer": picked.newer, "empty": picked.empty, "greedy": picked.greedy}
    if len(picked.kept) < spec.train.min_train_rows:
        raise DatasetError(
            f"dataset {spec.dataset_id}: {len(picked.kept)} usable training rows (of {len(data.samples)}; "
            f"held out {len(heldout)}, dropped {dropped}) < train.min_train_rows={spec.train.min_train_rows}: "
            "collect more traffic with feedback"
        )
    return Picked(picked.kept, len(heldout), dropped)


def shape_rows(spec: TrainJob, picked: Picked, data: RewardDataset, tokenizer, say: Callable) -> Rows:
    """The picked rows shaped by the partial-verdict rules (hindsight rows, split credit); a rule the dataset cannot
    value is bad input."""
    from training.partial_credit import partial_rows

    cfg = spec.train.ppo
    if cfg.tab_aids and data.rule is None:
        raise DatasetError(
            f"dataset {spec.dataset_id}: its manifest records no Tab reward rule ('cursor-tab'), which hindsight rows, "
            "split credit and stop credit need for their rewards; re-run collect under it, or set "
            "train.ppo.hindsight_partials=false, train.ppo.partial_credit=last_token and "
            "train.ppo.stop_credit_coef=0"
        )
    shaped = partial_rows(picked.kept, tokenizer, data.rule, cfg)
    hindsight, credit = shaped.hindsight, shaped.credit
    if cfg.hindsight_partials:
        say(
            f"{spec.run_key}: {len(hindsight.samples)} hindsight rows from partial verdicts"
            + (f" (skipped {hindsight.skipped})" if hindsight.skipped else ""),
            flush=True,
        )
    if credit is not None:
        say(
            f"{spec.run_key}: {credit.credited} partials credited along their kept prefix ({credit.kept_tokens} "
            "tokens kept)" + (f" (skipped {credit.skipped})" if credit.skipped else ""),
            flush=True,
        )
    return Rows(shaped.samples, picked.heldout, picked.dropped, hindsight, credit)


@dataclass
class Built:
    """The PPO trainer and how its state is saved and its candidate written, for one backend."""

    trainer: PPOTrainer
    megatron: bool  # tensor-parallel shards (training/megatron/): state and candidate are collectives

    def state(self) -> dict:
        """The trainer's state; Megatron: every tensor-parallel rank's, in rank order (a collective)."""
        if self.megatron:
            from training.megatron.parallel import gather_tensor_parallel

            return {"tp_shards": gather_tensor_parallel(self.trainer.state_dict())}
        return self.trainer.state_dict()

    def load(self, state: dict, key: str, tensor_parallel: int) -> None:
        if not self.megatron:
            self.trainer.load_state_dict(state)
            return
        from training.megatron.parallel import tensor_parallel_rank

        shards = state.get("tp_shards") or []
        if len(shards) != tensor_parallel:
            raise LaunchEnvError(
                f"checkpoint {key} holds {len(shards) or 'no'} tensor-parallel shards, this run "
                f"has tensor_parallel={tensor_parallel}: resume with the same layout"
            )
        self.trainer.load_state_dict(shards[tensor_parallel_rank()])


def build_trainer(spec: TrainJob, dirs: Checkouts, tokenizer, data: RewardDataset, corpus: CorpusSource) -> Built:
    """The champion's policy (LoRA or full, with a fresh critic) on this process's device, in a PPOTrainer; `corpus`
    is the model's, as files here (the code loss's text)."""
    from training.candidate import build_trainable
    from training.ppo_trainer import PPOTrainer
    from training.tokenizer import padding_id

    cfg = spec.train.ppo
    if cfg.backend == "megatron":  # tensor-parallel shards; the processes of one shard position split the batches
        from training.megatron import parallel
        from training.megatron.parallel import data_parallel
        from training.megatron.trainable import build_megatron_trainable

        model = build_megatron_trainable(dirs.champion_dir, dirs.base_dir, cfg).to(parallel.device())
        return Built(PPOTrainer(model, cfg, padding_id(tokenizer), dp=data_parallel()), megatron=True)
    model = build_trainable(dirs.champion_dir, dirs.base_dir, cfg).to(distributed.device(cfg.device))
    return Built(
        PPOTrainer(
            model, cfg, padding_id(tokenizer), **loss_terms(cfg, tokenizer, data.rule, spec.corpus_heldout_fraction, corpus)
        ),
        megatron=False,
    )


def resume(
    built: Built, store: ObjectStore, spec: TrainJob, samples: list[RewardSample], plan: list, say: Callable
) -> tuple[int, dict | None]:
    """(first iteration to run, the state resumed from): after the run's last checkpoint, else from the start with
    the reference policy's log-probs computed."""
    key = distributed.broadcast(latest_state_key(store, spec.prefix))  # rank 0's pick: all resume from one state
    if key is None:
        built.trainer.compute_reference(samples, rows=(r for batch in plan for r in batch))
        return 0, None
    state = load_state(store, key)
    built.load(state, key, spec.train.ppo.tensor_parallel)
    say(f"{spec.run_key}: resuming after iteration {state['iteration']} of {len(plan)}", flush=True)
    return state["iteration"] + 1, state


def publish(
    spec: TrainJob,
    store: ObjectStore,
    dirs: Checkouts,
    built: Built,
    rows: Rows,
    history: list[dict],
    state: dict | None,
    plan_len: int,
    mlflow_s: float,
    train_s: float,
) -> None:
    """The candidate's files under the run's prefix, then result.json, written last: the run is complete."""
    from training.candidate import candidate_kind, save_candidate

    built.trainer.model.to("cpu")  # the candidate's files load on any machine (critic.pt included)
    with tempfile.TemporaryDirectory() as tmp:
        if built.megatron:
            from training.megatron.trainable import save_megatron_candidate as save
        else:
            save = save_candidate
        if built.megatron or distributed.is_main():  # Megatron gathers its shards into one HF checkpoint: every rank joins
            out = save(built.trainer.model, dirs.champion_dir, dirs.base_dir, Path(tmp) / "candidate", spec.run_key)
        if not distributed.is_main():
            return
        upload_dir(store, out, f"{spec.prefix}/candidate")
    result = TrainResult(
        iterations=plan_len,
        resumed_from=None if state is None else state["iteration"],
        train_rows=len(rows.samples),
        heldout_rows=rows.heldout,
        dropped=rows.dropped,
        final=history[-1] if history else (state or {}).get("final", {}),
        hindsight_rows=len(rows.hindsight.samples),
        hindsight_skipped=rows.hindsight.skipped,
        credited_partials=rows.credit.credited if rows.credit else 0,
        tokens_per_s=sum(h["charts/tokens_per_s"] for h in history) / max(len(history), 1),
        kind=candidate_kind(spec.train.ppo),
        mlflow_s=round(mlflow_s, 3),
        train_s=round(train_s, 1),
    )
    put_json(store, f"{spec.prefix}/result.json", result.model_dump())


def _silent(*args, **kwargs) -> None:
    """print() of ranks other than 0."""


def gate(spec: TrainJob) -> None:
    from data_contracts import corpus
    from training.candidate import CRITIC_FILE
    from training.offline_gate import evaluate
    from training.policy import load_policy, load_tokenizer
    from training.value_head import ValueHead

    core = core_settings()
    torch.set_num_threads(spec.torch_threads)
    store, registry = open_store(core), Registry(spec.tracking_uri)
    data = load_dataset(store, spec.model, spec.dataset_id)
    _, heldout = split(data.samples, spec.train.heldout_fraction)
    heldout = at_most(heldout, spec.train.gate.max_heldout_rows)
    dirs = Checkouts(spec, store, registry, core.data_path / "cache")
    cand_dir = dirs.candidate_dir()
    champion = load_policy(dirs.champion_dir, base_path=dirs.base_dir)
    candidate = load_policy(cand_dir, base_path=dirs.base_dir)
    critic = ValueHead(int(champion.config.hidden_size))
    critic.load_state_dict(torch.load(cand_dir / CRITIC_FILE, weights_only=True))
    code_split = corpus.corpus_split(local_corpus(spec.corpus, core, core.data_path / "cache"), spec.corpus_heldout_fraction)
    code = None if code_split is None else corpus.read_texts(code_split[1])
    tokenizer = load_tokenizer(dirs.base_dir)
    report = evaluate(candidate, champion, critic, tokenizer, heldout, code, spec.train.gate, corpus.corpus_name(spec.corpus))
    if spec.train.suggestion_filter.enabled and report.passed:  # fitted on every judged row: the verdicts are about the text
        from training.suggestion_filter import fit_for
        from training.tokenizer import padding_id

        fitted = fit_for(candidate, data.samples, padding_id(tokenizer), spec.train.suggestion_filter, data)
        print(f"suggestion filter: {describe(fitted)}", flush=True)
        report = report.model_copy(update={"suggestion_filter": fitted})
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = now_ms()
    MlflowClient(spec.tracking_uri).log_batch(
        spec.mlflow_run_id, metrics=[Metric(f"gate/{k}", v, now, 0) for k, v in report.figures.items()]
    )
    put_json(store, f"{spec.prefix}/gate.json", report.model_dump())
    print(("gate passed" if report.passed else f"gate FAILED: {report.reason}"), flush=True)


class SpecError(ValueError):
    """The spec is missing or not a TrainJob: the same spec would fail the same way."""


def read_spec(ref: str) -> TrainJob:
    """The run's spec from a local path or, as `store:<key>`, from the object store of this process's settings."""
    from pydantic import ValidationError

    if ref.startswith(STORE_REF):
        key, store = ref.removeprefix(STORE_REF), open_store(core_settings())
        if not store.exists(key):
            raise SpecError(
                f"no spec {key!r} in the object store {store.url}: the flow uploads it before starting the "
                "trainer; check that this pod's store settings (tidal.yaml) match the flow's"
            )
        data = get_json(store, key)
    else:
        path = Path(ref)
        if not path.is_file():
            raise SpecError(f"spec file {ref} not found (a local path, or store:<key> for the object store)")
        data = path.read_text()
    try:
        return TrainJob.model_validate_json(data) if isinstance(data, str) else TrainJob.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"spec {ref} is not a valid TrainJob (written by another version of Tidal?):\n{e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.job", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["train", "gate"])
    parser.add_argument("spec", help="TrainJob JSON written by the train flow: a path, or store:<key>")
    args = parser.parse_args(argv)
    try:
        launch = distributed.launch_env()  # set by torchrun; world 1 without it
    except LaunchEnvError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if args.command == "gate" and not launch.main:
        return 0  # the gate runs in rank 0 alone
    if args.command == "train":
        try:
            distributed.init_from_env()  # every rank, before anything that may fail on one rank only
        except LaunchEnvError as e:  # e.g. more processes than GPUs: rank-specific, so every rank says it
            print(f"error: rank {launch.rank}: {e}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
    code = _run(args.command, args.spec, launch)
    if code == 0:
        distributed.barrier()  # ranks > 0 wait here until rank 0 has written the candidate and result.json
    distributed.close()
    return code


def _run(command: str, spec_ref: str, launch: distributed.Launch) -> int:
    """The command's exit code. Every rank prints its own error: usually all ranks fail alike (same spec, data,
    summed losses), but one that failed alone must say why; ranks > 0 name themselves."""
    from training.ppo_trainer import TrainingDiverged

    def error(e: Exception, code: int) -> int:
        print(f"error: {'' if launch.main else f'rank {launch.rank}: '}{e}", file=sys.stderr, flush=True)
        return code

    try:
        spec = read_spec(spec_ref)
    except SpecError as e:
        return error(e, EXIT_BAD_INPUT)
    try:
        (train if command == "train" else gate)(spec)
    except (DatasetError, LaunchEnvError) as e:
        return error(e, EXIT_BAD_INPUT)
    except TrainingDiverged as e:
        return error(e, EXIT_DIVERGED)
    except Preempted:
        return EXIT_PREEMPTED  # its line is printed (rank 0); the next attempt resumes from the checkpoint
    return 0


if __name__ == "__main__":
    sys.exit(main())
