"""Running the suites with Great Expectations and turning its failing row ids into quarantine reasons.

One ephemeral GE context per call (nothing persists between runs); with `docs_dir` it also builds
the Data Docs (suites + validation results) there, as static HTML.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from data_contracts import secrets

log = logging.getLogger("tidal.collect")
DOCS_SITE = "tidal"
RESULT_FORMAT = {"result_format": "COMPLETE", "unexpected_index_column_names": ["_row"], "return_unexpected_index_query": False}


class ContractError(RuntimeError):
    """A suite could not be evaluated (a missing column, a GE error) or a written dataset broke its contract."""


@dataclass
class ExpectationOutcome:
    expectation: str  # GE type, e.g. expect_column_values_to_be_between
    column: str
    reason: str
    success: bool
    unexpected: int


@dataclass
class Outcome:
    """Result of one suite on one frame: the reasons of each failing row (sorted, distinct)."""

    suite: str
    rows: int
    reasons: dict[int, list[str]] = field(default_factory=dict)
    expectations: list[ExpectationOutcome] = field(default_factory=list)
    success: bool = True

    def counts(self) -> Counter:
        """Rows per reason (a row failing several checks counts once under each)."""
        return Counter(r for rs in self.reasons.values() for r in rs)


def _row_reasons(meta: dict, item: dict, column: str) -> list[str]:
    if meta.get("reasons_from") == "secrets":
        return [secrets.reason(kind) for kind in str(item.get(column, "")).split(",") if kind]
    return [meta["reason"]]


def _docs_site(docs_dir: Path) -> dict:
    return {
        "class_name": "SiteBuilder",
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
    }


def validate_frames(checks: list[tuple[object, pd.DataFrame]], docs_dir: Path | None = None) -> dict[str, Outcome]:
    """Validate each (suite, frame) pair; returns {suite name: Outcome}. Frames need a `_row` column."""
    import great_expectations as gx  # heavy import, and only needed while validating
    from great_expectations.data_context.types.base import DataContextConfig, InMemoryStoreBackendDefaults, ProgressBarsConfig

    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),  # no stray temp directories
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False),
        data_docs_sites={DOCS_SITE: _docs_site(docs_dir)} if docs_dir is not None else {},
    )
    context = gx.get_context(project_config=config, mode="ephemeral")
    source = context.data_sources.add_pandas("collect")
    outcomes = {}
    for suite, frame in checks:
        name = suite.name
        batch = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=name, data=batch, suite=context.suites.add(suite))
        )
        actions = [gx.checkpoint.UpdateDataDocsAction(name="data_docs", site_names=[DOCS_SITE])] if docs_dir is not None else []
        checkpoint = context.checkpoints.add(
            gx.Checkpoint(
                name=f"collect-{name}", validation_definitions=[definition], actions=actions, result_format=RESULT_FORMAT
            )
        )
        result = next(iter(checkpoint.run(batch_parameters={"dataframe": frame}).run_results.values()))
        outcomes[name] = _outcome(name, frame, result)
    return outcomes


def _outcome(name: str, frame: pd.DataFrame, result) -> Outcome:
    out = Outcome(name, len(frame), success=bool(result.success))
    for r in result.results:
        cfg = r.expectation_config
        column = cfg.kwargs.get("column") or f"{cfg.kwargs.get('column_A')},{cfg.kwargs.get('column_B')}"
        raised = (r.exception_info or {}).get("raised_exception")
        if raised:
            raise ContractError(
                f"suite {name!r}: {cfg.type} on {column!r} could not run: {r.exception_info.get('exception_message')}"
            )
        items = r.result.get("unexpected_index_list") or []
        if not r.success and not items:
            raise ContractError(
                f"suite {name!r}: {cfg.type} on {column!r} failed without failing rows (a table-level check); result: {r.result}"
            )
        for item in items:
            row = int(item["_row"])
            out.reasons.setdefault(row, []).extend(_row_reasons(cfg.meta or {}, item, cfg.kwargs.get("column", "")))
        reason = (cfg.meta or {}).get("reason") or (cfg.meta or {}).get("reasons_from", "")
        out.expectations.append(ExpectationOutcome(cfg.type, column, reason, bool(r.success), len(items)))
    out.reasons = {row: sorted(set(rs)) for row, rs in out.reasons.items()}
    return out
