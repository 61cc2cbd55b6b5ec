"""bench/cycle.py's accounting: which seconds of a cycle count as orchestration, each counted once."""

from __future__ import annotations

import pytest

from bench import cycle


def test_merged_joins_overlapping_and_touching_intervals_and_drops_empty_ones():
    assert cycle.merged([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6.5), (9, 9)]) == [(0, 4), (5, 7)]
    assert cycle.length([(0, 2), (1, 3), (10, 11)]) == 4


def test_complement_is_the_window_less_the_intervals():
    assert cycle.complement([(2, 3), (5, 12)], (0, 10)) == [(0, 2), (3, 5)]
    assert cycle.complement([], (0, 10)) == [(0, 10)]
    assert cycle.complement([(-5, 20)], (0, 10)) == []


def test_overhead_counts_gaps_calls_and_contract_tasks_once():
    # a 100 s cycle: tasks cover [0, 40] and [50, 95]; the gaps [40, 50] and [95, 100] are Prefect's (15 s)
    tasks = {"load_logs": [(0, 20)], "validate_logs": [(20, 40)], "run_trainer": [(50, 95)]}
    prefect_calls = [(45, 46), (60, 61)]  # one in a gap (already counted), one inside the trainer task
    mlflow_calls = [(10, 12), (30, 31)]  # the second inside the validation task (counted once in the union)
    parts = cycle.overhead((0, 100), tasks, prefect_calls, mlflow_calls, trainer_mlflow_s=2.5)
    assert parts["prefect"] == 16.0  # 15 s of gaps + 1 s of calls inside tasks
    assert parts["mlflow"] == 5.5  # 3 s in this process + 2.5 s in the trainer's
    assert parts["contracts"] == 20.0
    assert parts["union"] == 16.0 + 2.0 + 20.0 + 2.5  # (30, 31) is inside the validation task


def test_overhead_of_a_cycle_that_is_all_work_is_its_trainer_calls_only():
    parts = cycle.overhead((0, 10), {"run_trainer": [(0, 10)]}, [], [], trainer_mlflow_s=0.0)
    assert parts == {"prefect": 0.0, "mlflow": 0.0, "contracts": 0.0, "union": 0.0}


@pytest.mark.parametrize(
    "value, expected", [("2026-12-01T03:00:00.500000Z", 1796094000.5), ("2026-12-01T03:00:00+00:00", 1796094000.0), (None, None)]
)
def test_prefect_timestamps_parse_to_epoch_seconds(value, expected):
    assert cycle.ts(value) == expected
