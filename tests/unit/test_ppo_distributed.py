"""Data-parallel PPO (training/distributed.py) on the tiny policy: two gloo processes end with the weights of one
process over the same plan, with uneven shards, minibatches in which a process has no row, an early stop, each
process's rows in micro-batches, and the ptx code loss split unevenly; their checkpoint resumes in one process.
Plus the torchrun variables and the single-process identity."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from data_contracts.samples import RewardSample
from tests.unit.ppo_helpers import cfg, make_trainer, trainable_weights
from training import distributed
from training.distributed import Launch, LaunchEnvError, launch_env
from training.ppo_trainer import iteration_plan, minibatch_order

WORLD = 2
ROWS = 40  # training rows of every scenario (the `rows` fixture)
SCENARIOS = {
    # 9-row batches: shards of 5 and 4 rows; 3-row minibatches, some of them all on one process
    "uneven": dict(batch_size=9, minibatch_size=3, epochs=2, passes=1, max_iterations=3, entropy_coef=0.01),
    # every weight trained, one-row minibatches (one process always has none). Approx KL per step of one process:
    # iteration 0: 0, 2.3e-3, 2.6e-4, 1.4e-3, 1.0e-3 | 0.13; iteration 1: 0, 2.5e-6, 2.9e-4, 2.6e-4, 1.0e-3 | 1.2e-4,
    # 1.3e-2: each stops in its second epoch (of 3), at the first step > 1.5 * target_kl = 5.1e-3 (2x margins)
    "early_stop": dict(
        lora=False, batch_size=5, minibatch_size=1, epochs=3, passes=1, max_iterations=2, target_kl=3.4e-3, learning_rate=3e-4
    ),
    # each process's rows of a minibatch in one-row micro-batches (train.ppo.micro_batch_tokens); the one-process
    # reference takes each minibatch at once
    "micro": dict(batch_size=9, minibatch_size=3, epochs=2, passes=1, max_iterations=3, micro_batch_tokens=1),
    # the code loss of PPO-ptx: 3 windows a step, 2 on one process and 1 on the other
    "ptx": dict(batch_size=9, minibatch_size=3, epochs=2, passes=1, max_iterations=2, ptx_coef=1.0, ptx_batch=3, ptx_seq_len=32),
}
ATOL = 1e-5


def _train_rank(rank: int, init_file: str, champion_dir: Path, samples: list, out: Path) -> None:
    """One process of the data-parallel run: every scenario, then its weights, history and first checkpoint."""
    torch.set_num_threads(1)  # two processes on a shared CPU
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    try:
        for name, kw in SCENARIOS.items():
            c = cfg(**kw)
            plan = iteration_plan(ROWS, c)
            trainer = make_trainer(champion_dir, c)
            trainer.compute_reference(samples, rows=(r for batch in plan for r in batch))
            first: dict = {}

            def keep(it: int, metrics: dict, trainer=trainer, first=first) -> None:
                if it == 0:  # a copy, as the job's save_state writes it: the optimizer state is updated in place
                    first.update(copy.deepcopy(trainer.state_dict()))

            history = trainer.train(samples, plan, on_iteration=keep)
            torch.save({"weights": trainable_weights(trainer), "history": history, "state": first}, out / f"{name}-{rank}.pt")
    finally:
        distributed.close()


@pytest.fixture(scope="module")
def rows(samples) -> list[RewardSample]:
    """The first ROWS samples with completions cut to 1..4 tokens: processes hold different numbers of tokens, so
    a loss weighted by rows instead of tokens would not add up to one process's."""
    return [
        s.model_copy(
            update={
                "completion_token_ids": s.completion_token_ids[: 1 + i % 4],
                "behaviour_logprobs": s.behaviour_logprobs[: 1 + i % 4],
            }
        )
        for i, s in enumerate(samples[:ROWS])
    ]


@pytest.fixture(scope="module")
def two_processes(champion_dir, rows, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data-parallel")
    # a failing process makes spawn stop the other and raise (no hang on a collective)
    mp.spawn(_train_rank, args=(str(out / "rendezvous"), champion_dir, rows, out), nprocs=WORLD, join=True)
    return out


def one_process(champion_dir, rows, name: str, state: dict | None = None):
    c = cfg(**{k: v for k, v in SCENARIOS[name].items() if k != "micro_batch_tokens"})  # whole minibatches
    plan = iteration_plan(ROWS, c)
    trainer = make_trainer(champion_dir, c)
    if state is None:
        trainer.compute_reference(rows, rows=(r for batch in plan for r in batch))
        history = trainer.train(rows, plan)
    else:
        trainer.load_state_dict(state)
        history = trainer.train(rows, plan, start=1)
    return trainable_weights(trainer), history


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=ATOL, rtol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_the_scenarios_have_uneven_shards_and_minibatches_without_rows() -> None:
    for name, kw in SCENARIOS.items():
        c = cfg(**kw)
        plan = iteration_plan(ROWS, c)
        assert all(len(batch) % WORLD for batch in plan), name  # shards of unequal size
        empty = [
            mb
            for it, batch in enumerate(plan)
            for e in range(c.epochs)
            for mb in minibatch_order(len(batch), c, it, e)
            if len(set((mb % WORLD).tolist())) < WORLD
        ]  # positions j go to process j % WORLD
        assert empty, f"{name}: no minibatch leaves a process without rows"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_processes_train_the_weights_of_one(two_processes, champion_dir, rows, name) -> None:
    ranks = [torch.load(two_processes / f"{name}-{r}.pt", weights_only=True) for r in range(WORLD)]
    for other in ranks[1:]:  # same start, same summed gradients: the very same weights in every process
        assert all(torch.equal(ranks[0]["weights"][n], w) for n, w in other["weights"].items())
    weights, history = one_process(champion_dir, rows, name)
    assert_close(ranks[0]["weights"], weights)
    start = make_trainer(champion_dir, cfg(**SCENARIOS[name]))
    assert any((weights[n] - w).abs().max() > 100 * ATOL for n, w in trainable_weights(start).items())  # it trained
    # metrics are the whole batch's, not one shard's
    for got, want in zip(ranks[0]["history"], history, strict=True):
        for k, v in want.items():
            if not k.startswith("charts/"):
                assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    if name == "early_stop":
        assert [(h["ppo/early_stopped"], h["ppo/epochs_done"]) for h in history] == [(1.0, 2.0), (1.0, 2.0)]


def test_a_checkpoint_of_two_processes_resumes_in_one(two_processes, champion_dir, rows) -> None:
    state = torch.load(two_processes / "uneven-0.pt", weights_only=True)["state"]
    plan = iteration_plan(ROWS, cfg(**SCENARIOS["uneven"]))
    assert set(state["ref_logprobs"]) == {r for batch in plan for r in batch}  # every process's rows
    resumed, _ = one_process(champion_dir, rows, "uneven", state=state)
    straight, _ = one_process(champion_dir, rows, "uneven")
    assert_close(resumed, straight)


def test_a_batch_smaller_than_the_processes_is_refused(champion_dir, samples) -> None:
    trainer = make_trainer(champion_dir, cfg(batch_size=1, minibatch_size=1))
    trainer.compute_reference(samples[:1])
    trainer.dp = distributed.DataParallel(rank=0, size=2)
    with pytest.raises(ValueError, match="a batch of 1 rows cannot be split over 2 processes: raise train.ppo.batch_size"):
        trainer.rollout(samples, [0])


# ---- torchrun's variables, and one process ------------------------------------------------------------

TORCHRUN = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_launch_env_reads_torchrun_and_names_what_is_wrong() -> None:
    assert launch_env({}) == Launch() and launch_env({"WORLD_SIZE": "1"}).main
    assert launch_env(TORCHRUN) == Launch(world=4, rank=2, local_rank=2) and not launch_env(TORCHRUN).main
    with pytest.raises(LaunchEnvError, match="WORLD_SIZE=2 but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set.*torchrun"):
        launch_env({"WORLD_SIZE": "2"})
    with pytest.raises(LaunchEnvError, match="not integers"):
        launch_env({**TORCHRUN, "RANK": "two"})
    with pytest.raises(LaunchEnvError, match="need 0 <= RANK < WORLD_SIZE"):
        launch_env({**TORCHRUN, "RANK": "4"})


def test_one_process_has_no_group_and_the_helpers_are_identities(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.init_from_env() == Launch() and not distributed.active()
    assert (distributed.world_size(), distributed.rank(), distributed.is_main()) == (1, 0, True)
    assert distributed.device() == torch.device("cpu")
    t = torch.tensor([1.0, 2.0])
    assert distributed.sum_all(t) is t and distributed.gather_dicts({1: t}) == {1: t} and distributed.broadcast("k") == "k"
    p = torch.nn.Parameter(torch.ones(2))
    assert distributed.sum_grads([p], t) is t and p.grad is None
    with distributed.main_first():
        distributed.barrier()
