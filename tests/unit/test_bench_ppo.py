"""bench/ppo.py and bench/ppo_sides.py: their cheap, deterministic parts: the batch file, token counting, windows, step timing.

Nothing here installs TRL or runs a trainer.
"""

from __future__ import annotations

import pytest

from bench import ppo, ppo_sides


def _batch(B: int = 3, P: int = 5, T: int = 2) -> ppo_sides.Batch:
    return ppo_sides.Batch(
        prompt_ids=[[i * 10 + j + 1 for j in range(P)] for i in range(B)],
        completion_ids=[[900 + i, 901 + i][:T] + [7] * max(0, T - 2) for i in range(B)],
        rewards=[1.0, -1.0, 0.5][:B] + [0.0] * max(0, B - 3),
        behaviour_logprobs=[[-2.0] * T for _ in range(B)],
    )


def test_batch_file_round_trips(tmp_path):
    batch = _batch()
    assert ppo_sides.Batch.load(batch.save(tmp_path / "batch.json")) == batch


def test_tokens_count_prompt_and_completion_of_every_sample():
    assert _batch(B=3, P=5, T=2).shape == (3, 5, 2)
    assert ppo.batch_tokens(_batch(B=3, P=5, T=2)) == 3 * (5 + 2)
    assert ppo.batch_tokens(_batch(B=64, P=200, T=32)) == 64 * 232 == 14848
    assert ppo.tokens_per_s(14848, 2.0) == 7424.0


@pytest.mark.parametrize(
    "change",
    [
        dict(rewards=[1.0]),  # fewer rewards than samples
        dict(prompt_ids=[[1, 2], [1, 2, 3], [4, 5]]),  # ragged prompts
        dict(behaviour_logprobs=[[-1.0], [-1.0], [-1.0]]),  # one mu for two completion tokens
    ],
)
def test_batch_rejects_inconsistent_columns(change):
    fields = {**_batch().__dict__, **change}
    with pytest.raises(ValueError):
        ppo_sides.Batch(**fields)


def test_code_windows_are_disjoint_ordered_and_deterministic():
    streams = [list(range(10)), list(range(100, 107))]
    assert ppo.code_windows(streams, 3, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [100, 101, 102, 103]]
    with pytest.raises(ValueError, match="only 3 windows"):
        ppo.code_windows(streams, 4, 4)


def test_step_spans_from_start_and_end_marks():
    assert ppo_sides.spans([10.0, 12.0, 14.0], [11.5, 14.0, 14.25]) == [1.5, 2.0, 0.25]
    assert ppo_sides.spans([], []) == []
    with pytest.raises(ValueError):
        ppo_sides.spans([1.0], [])


def test_lora_targets_match_the_project_default():
    from training.ppo_config import LORA_TARGETS, PPOConfig

    assert list(ppo_sides.LORA_TARGETS) == LORA_TARGETS
    shared = PPOConfig(**ppo_sides.SHARED)  # every shared setting is a Tidal PPOConfig field
    assert shared.batch_size % shared.minibatch_size == 0


def test_trl_env_pins_the_project_versions():
    reqs = ppo.pinned_requirements()
    assert reqs[0] == "trl==1.12.0"
    assert {r.split("==")[0] for r in reqs[1:]} == set(ppo.PINNED)
    assert all("==" in r and r.split("==")[1] for r in reqs)


def test_lockstep_takes_turns_and_alternates_who_goes_first():
    calls: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def step(self) -> None:
            calls.append(self.name)

    ppo.run_lockstep([Fake("tidal"), Fake("trl")], steps=2)  # warm-up + 2 timed rounds
    assert calls == ["tidal", "trl", "trl", "tidal", "tidal", "trl"]


def test_paired_ratio_is_the_median_of_per_round_ratios():
    # round 2 is slowed 20x on both sides by other work: it does not move the result
    assert ppo.paired_ratio([2.0, 40.0, 2.5], [4.0, 100.0, 5.0]) == 2.0
    with pytest.raises(ValueError):
        ppo.paired_ratio([1.0], [1.0, 2.0])
