"""A version's lineage tags read typed: the names live in tidal/lineage.py, the reading on VersionInfo."""

from __future__ import annotations

import json

from tidal import lineage
from tidal.registry import VersionInfo
from training.job_spec import GateCheck, GateReport


def version(tags: dict[str, str]) -> VersionInfo:
    return VersionInfo("tab", 3, "lora", 1, "file:///store/checkpoints/model=tab/version=3", tags)


def test_lineage_reads_typed_and_absent_tags_read_as_none() -> None:
    failed = GateReport(
        passed=False, checks=[GateCheck(name="kl", passed=False, value=0.9, limit=0.5, detail="0.9 > 0.5")], figures={"kl": 0.9}
    )
    v = version(
        {
            lineage.PARENT_VERSION: "2",
            lineage.TRAIN_RUN: "run-ab",
            lineage.DATASET_ID: "ds-1",
            **failed.tags(),
            lineage.release_tag("rolled_back"): json.dumps({"at_ms": 5, "reason": "reward fell"}),
        }
    )
    assert (v.parent_version, v.train_run, v.dataset_id, v.gate_passed) == (2, "run-ab", "ds-1", False)
    assert v.gate_reason == "kl: 0.9 > 0.5" and v.release_event("rolled_back") == {"at_ms": 5, "reason": "reward fell"}
    first = version({lineage.PARENT_VERSION: "none"})
    assert (first.parent_version, first.gate_passed, first.gate_reason, first.release_event("promoted")) == (
        None,
        None,
        None,
        None,
    )
    passed = GateReport(passed=True, checks=[], figures={})
    assert version(passed.tags()).gate_passed is True
