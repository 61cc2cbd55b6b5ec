"""bench/pipeline.py at a small size: both collections run over the same completions, the second with the new events,
judges' scores and conversations in the mix, and each reports what it measured."""

from __future__ import annotations

import json

from bench.pipeline import main


def test_the_benchmark_collects_with_and_without_the_new_events_side_by_side(capsys):
    result = main(["--rows", "2000", "--partitions", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result  # the final line is the result
    tab, mixed = result, result["with_new_events"]
    assert tab["completions"] == mixed["completions"] == 2000
    assert tab["reward_rule"] == "cursor-tab@1" and mixed["reward_rule"] == "feedback-blend@1"
    # on top of the verdicts: a score on 1 in 4, a thumbs on 1 in 3, an edit on 1 in 10, a judge's score on 1 in 6
    assert mixed["feedback"] > 1.8 * tab["feedback"]
    assert tab["pandas_agrees"] and mixed["pandas_agrees"] and tab["failing_rows"] > 0  # the generated defects
    # conversations: a second turn's verdict credits its first turn, which has no verdict of its own
    assert tab["credited_turns"] == 0 and mixed["credited_turns"] > 0
    assert mixed["samples"] > tab["samples"] and mixed["kept"] + mixed["filtered"] <= mixed["rows_in"]
    assert result["records_per_s_with_new_events"] == mixed["records_per_s"] > 0
