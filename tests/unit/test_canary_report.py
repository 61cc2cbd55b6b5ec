"""The canary's step table: one record per step-ending look, with each metric's interval and margin, stored as
JSON (infinite bounds as null) and printed by the demo."""

from __future__ import annotations

import json

from release.canary_config import CanaryConfig
from release.canary_records import ArmHealth
from release.policy import Ramp
from release.report import CanaryRecord, canary_key, canary_record, step_table
from tests.unit.test_canary_stats import outcomes


def test_a_ramps_step_table_round_trips_and_prints() -> None:
    cfg = CanaryConfig(min_samples=200, max_step_s=600, detect_regression_sd=0.5)
    ramp, control = Ramp(cfg, now_s=0.0), outcomes("control", 2000)
    health = {"control": ArmHealth(2000), "canary": ArmHealth(600)}
    ramp.observe(control + outcomes("canary", 10), health, 5.0)  # too few: bounds not known yet
    ramp.observe(control + outcomes("canary", 200), health, 20.0)  # advance
    ramp.observe(control + outcomes("canary", 250), health, 25.0)  # waits: the last look of an unfinished ramp
    record = canary_record("tab", 1, 2, ramp.looks)
    assert [(s.step, s.action) for s in record.steps] == [(1, "advance"), (2, "wait")]
    stored = CanaryRecord.model_validate(json.loads(json.dumps(record.model_dump(mode="json"))))
    assert stored == record
    first = {m.metric: m for m in stored.steps[0].metrics}
    assert set(first) == {"reward", "accepted", "accepted_chars", "error_rate", "slow_share"}
    assert first["reward"].low < first["reward"].delta < first["reward"].high
    assert first["reward"].margin > 0 and first["accepted_chars"].margin == 0.05 * first["accepted_chars"].control
    assert stored.steps[0].n_canary == 200 and stored.steps[0].reason.startswith(
        "reward and accepted_chars not worse than control"
    )
    early = canary_record("tab", 1, 2, ramp.looks[:1])
    # 10 canary outcomes: not tested yet, infinite bounds stored as null (error rate is tested on the request counts)
    assert {m.metric for m in early.steps[0].metrics if m.low is None} == {"reward", "accepted", "accepted_chars", "slow_share"}
    text = step_table(stored, indent="  ")
    assert text.splitlines()[0].startswith("  step 1 at 5%: advance after 20 s (2000 control / 200 canary outcomes")
    # each step's outcomes of both arms (what canary.max_step_outcomes bounds): step 2 began at 2,200 of them
    assert [s.step_n for s in stored.steps] == [2200, 50] and "50 canary of 50 this step" in text, text
    # a record stored before the field reads back without it, and prints as it did
    before = {k: v for k, v in stored.steps[0].model_dump(mode="json").items() if k != "step_n"}
    old = CanaryRecord.model_validate({**record.model_dump(mode="json"), "steps": [before]})
    assert old.steps[0].step_n is None
    assert "200 canary this step)" in step_table(old)
    assert "reward" in text and "margin" in text and "not tested yet" in step_table(early)
    assert canary_key("tab", 2) == "releases/model=tab/v2/canary.json"
