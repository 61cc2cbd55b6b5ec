"""PPO-ptx (training/ptx.py): the code windows it trains on, their split over processes, and that the loss keeps
the policy a code model while PPO moves it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from data_contracts import corpus
from tests.unit.ppo_helpers import cfg
from training.candidate import build_trainable
from training.policy import load_tokenizer
from training.ppo_trainer import PPOTrainer, iteration_plan
from training.pretrain import token_stream
from training.ptx import PtxLoss, ptx_stream


@pytest.fixture(scope="module")
def code(champion_dir) -> torch.Tensor:
    return token_stream(load_tokenizer(champion_dir), corpus.read_texts([corpus.stdlib_root() / "heapq.py"]))


def test_stream_holds_training_files_only_and_stops_at_the_byte_budget(champion_dir, tmp_path: Path, monkeypatch) -> None:
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_text(f"marker_{i:02d} = {i}\n" * 5)
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    train, heldout = corpus.split_files(corpus.source_files(tmp_path), tmp_path, 0.25)
    assert train and heldout
    tok = load_tokenizer(champion_dir)
    text = tok.decode(ptx_stream(tok, 0.25, 10**6))
    assert all(f"marker_{f.stem[1:]}" in text for f in train)
    assert not any(f"marker_{f.stem[1:]}" in text for f in heldout)  # the gate's and the users' files
    one_file = len((tmp_path / "m00.py").read_bytes())
    short = tok.decode(ptx_stream(tok, 0.25, 2 * one_file))
    assert short.count("marker_") == 10  # two files of five lines


def test_the_stream_reads_the_models_own_corpus_and_refuses_none(champion_dir, tmp_path: Path) -> None:
    from tidal.model_settings import CorpusSource

    for i in range(20):
        (tmp_path / f"n{i:02d}.txt").write_text(f"note_{i:02d}\n" * 3)
    (tmp_path / "other.py").write_text("python_marker = 1\n")
    tok = load_tokenizer(champion_dir)
    own = CorpusSource(source=str(tmp_path), pattern="*.txt")
    train, _ = corpus.corpus_split(own, 0.25)
    text = tok.decode(ptx_stream(tok, 0.25, 10**6, own))
    assert sorted(int(m) for m in re.findall(r"note_(\d\d)", text)[::3]) == sorted(int(f.stem[1:]) for f in train)
    assert "python_marker" not in text
    with pytest.raises(ValueError, match="no corpus .*set train.ppo.ptx_coef to 0"):
        ptx_stream(tok, 0.25, 10**6, CorpusSource(source="none"))


def test_windows_are_a_function_of_the_step_and_split_over_processes(champion_dir, code) -> None:
    ptx = PtxLoss(code, batch=4, seq_len=32, seed=0)
    x, y = ptx.windows(3, 1, 2)
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, PtxLoss(code, batch=4, seq_len=32, seed=0).windows(3, 1, 2)[0])  # a resumed run's draw
    assert not torch.equal(x, ptx.windows(3, 1, 3)[0]) and not torch.equal(x, ptx.windows(4, 1, 2)[0])
    model = build_trainable(champion_dir, champion_dir, cfg())
    whole = ptx.loss(model, 3, 1, 2)
    parts = [ptx.loss(model, 3, 1, 2, rank=r, world=3) for r in range(3)]
    assert float(whole) > 0
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-5)  # shares add up to the mean
    assert PtxLoss(code, batch=2, seq_len=32, seed=0).loss(model, 0, 0, 0, rank=2, world=3) is None
    with pytest.raises(ValueError, match="shorter than one window"):
        PtxLoss(code[:20], batch=2, seq_len=32, seed=0)


def test_trainer_needs_the_loss_and_the_coefficient_together(champion_dir, code) -> None:
    c = cfg(ptx_coef=0.5)
    model = build_trainable(champion_dir, champion_dir, c)
    with pytest.raises(ValueError, match="ptx_coef=0.5 needs a PtxLoss"):
        PPOTrainer(model, c, pad_token_id=0)
    with pytest.raises(ValueError, match="pass both or neither"):
        PPOTrainer(model, cfg(), pad_token_id=0, ptx=PtxLoss(code, 2, 32, 0))


@torch.no_grad()
def code_loss(trainer: PPOTrainer, probe: PtxLoss) -> float:
    trainer.model.eval()
    return float(sum(probe.loss(trainer.model, 1000 + i, 0, 0) for i in range(8)) / 8)


def test_ptx_keeps_the_code_loss_down_while_ppo_learns(champion_dir, samples, code) -> None:
    rows = samples[:128]
    probe = PtxLoss(code, batch=8, seq_len=64, seed=1)  # other draws than training's
    runs = {}
    for coef in (0.0, 1.0):
        c = cfg(ptx_coef=coef, ptx_seq_len=64)
        ptx = PtxLoss(code, c.ptx_batch, c.ptx_seq_len, c.seed) if coef else None
        trainer = PPOTrainer(build_trainable(champion_dir, champion_dir, c), c, pad_token_id=0, ptx=ptx)
        before = code_loss(trainer, probe)
        trainer.compute_reference(rows)
        history = trainer.train(rows, iteration_plan(len(rows), c))
        runs[coef] = (before, code_loss(trainer, probe), history)
    (b0, a0, h0), (b1, a1, h1) = runs[0.0], runs[1.0]
    assert b0 == pytest.approx(b1)  # the same champion
    assert a1 < a0  # with the code loss the policy stays the better code model
    assert a1 < b1 + 0.5 * (a0 - b0)  # and keeps most of the drift away
    assert "ppo/ptx_loss" not in h0[0] and all(h["ppo/ptx_loss"] > 0 for h in h1)
    assert h1[-1]["ppo/reward_mean"] == pytest.approx(h0[-1]["ppo/reward_mean"])  # same batches


def test_resume_with_ptx_reaches_the_same_weights(champion_dir, samples, code, tmp_path) -> None:
    c = cfg(passes=2, max_iterations=3, ptx_coef=1.0, ptx_seq_len=32)
    rows = samples[:128]
    plan = iteration_plan(len(rows), c)

    def trainer() -> PPOTrainer:
        return PPOTrainer(build_trainable(champion_dir, champion_dir, c), c, 0, ptx=PtxLoss(code, 4, 32, 0))

    straight = trainer()
    straight.compute_reference(rows)
    straight.train(rows, plan)
    first = trainer()
    first.compute_reference(rows)
    first.train(rows, plan[:2])
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed = trainer()
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    resumed.train(rows, plan, start=2)
    a = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, a[name]), name


class _Table(torch.nn.Module):
    """A bigram 'policy': the logits of the next token are one row per input token (the trainer's interface)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, x, mask):
        return self.w[x], None


def test_the_code_loss_given_the_line_continues_leaves_the_stop_probability_alone() -> None:
    data = torch.randint(0, 12, (400,), generator=torch.Generator().manual_seed(1))
    stops = [3, 7]
    data[::5] = 3  # the stop tokens occur as targets too
    plain, given = PtxLoss(data, 4, 16, 0), PtxLoss(data, 4, 16, 0, given_not=stops)
    table = _Table(12)
    before = (float(plain.loss(table, 0, 0, 0)), float(given.loss(table, 0, 0, 0)))
    with torch.no_grad():
        table.w[:, stops] += 5.0  # every prediction puts more mass on stopping
    after = (float(plain.loss(table, 0, 0, 0)), float(given.loss(table, 0, 0, 0)))
    assert after[0] != pytest.approx(before[0], abs=1e-3)  # the plain loss charges the stop probability
    assert after[1] == pytest.approx(before[1], abs=1e-5)  # the conditioned loss does not
    given.loss(table, 0, 0, 0).backward()
    assert float(table.w.grad[:, stops].abs().sum()) == 0.0 and float(table.w.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="ptx_given_continues=true shapes the code loss"):
        cfg(ptx_given_continues=True)
