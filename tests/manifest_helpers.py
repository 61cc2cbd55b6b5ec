"""A minimal collect record, for tests that write a dataset without running a collection."""

from __future__ import annotations

from data_contracts.manifest import CollectRecord


def collect_record(model: str = "tab", reward_rule: dict | None = None) -> CollectRecord:
    """Every count zero, no sources; `reward_rule` as stored ({"id", "rule"}), by default an id alone."""
    zero = {"in": 0, "kept": 0, "quarantined": 0, "filtered": 0}
    kind = {**zero, "quarantined_by_reason": {}, "filtered_by_reason": {}}
    watermark = {"model": model, "completions_through_ms": 0, "feedback_through_ms": 0}
    return CollectRecord.model_validate(
        {
            "model": model,
            "contract_version": "1",
            "created_ms": 0,
            "reward_rule": reward_rule or {"id": "cursor-tab@1"},
            "collect_settings": {},
            "source_partitions": [],
            "source_files": [],
            "schema_quarantined_files": [],
            "watermark_before": watermark,
            "watermark_after": watermark,
            "late_arrivals": {"completions": 0, "feedback": 0},
            "counts": {"completions": kind, "feedback": kind, "total": zero},
            "reconciled": True,
            "scrubbed": {},
            "quarantine": {},
            "versions": {"known": [1], "champion": 1, "max_stale_versions": 1},
            "summary": {"rows": 0, "events": {}, "reward_mean": None, "reward_histogram": [], "by_version_arm": []},
        }
    )
