"""The dataset manifest (datasets/model=M/<dataset-id>/manifest.json): what a collection run wrote, and read back
as itself. The collect flow writes it, the trainer checks its digest and reward rule, reports render it.

    CollectRecord     what the run knows before the data is written: sources, watermarks, counts, rule, summary
    DatasetManifest   that, plus what writing the data fixed: its key, URI, rows, schema and sha256 digest
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from data_contracts.scope import Watermark


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class RowCounts(Record):
    """in = kept + quarantined + filtered, checked when the run counts them (pipeline.reconcile)."""

    in_: int = Field(alias="in", description="Rows read.")
    kept: int = Field(description="Rows that passed every check.")
    quarantined: int = Field(description="Rows set aside with their reasons (quarantine/...).")
    filtered: int = Field(description="Rows left out by rule (stale versions, duplicates, ...), by reason.")


class KindCounts(RowCounts):
    quarantined_by_reason: dict[str, int] = Field(description="A row with several reasons counts under each.")
    filtered_by_reason: dict[str, int]


class Counts(Record):
    completions: KindCounts
    feedback: KindCounts
    total: RowCounts


class RuleRef(Record):
    id: str = Field(description="The reward rule's id (name@version).")
    rule: dict | None = Field(None, description="The rule itself (its fields as JSON); None in manifests older than it.")
    plugin: str | None = Field(None, description="Its entry point in `tidal.reward_rules`; None in manifests older than it.")
    package: str | None = Field(
        None, description="'<distribution> <version>' that provided the plugin ('' if not installed as one); None: older."
    )


class BadFile(Record):
    key: str
    kind: str
    rows: int
    detail: str


class Versions(Record):
    known: list[int] = Field(description="Versions registered when the run started.")
    champion: int | None = Field(description="The champion then.")
    max_stale_versions: int


class HistogramBin(Record):
    from_: float = Field(alias="from")
    to: float
    rows: int


class VersionArm(Record):
    version: int
    arm: str
    rows: int
    verdicts: int
    accept_rate: float | None
    mean_reward: float


class RewardSummary(Record):
    """Reward distribution and accept rate by (version, arm) of the samples written."""

    rows: int
    events: dict[str, int]
    reward_mean: float | None
    reward_histogram: list[HistogramBin]
    by_version_arm: list[VersionArm]


class CollectRecord(Record):
    model: str
    contract_version: str
    created_ms: int = Field(description="The run's as-of time (ms).")
    reward_rule: RuleRef
    collect_settings: dict = Field(description="The collect settings in force (reward rules aside).")
    source_partitions: list[str]
    source_files: list[str]
    schema_quarantined_files: list[BadFile] = Field(description="Log objects quarantined whole.")
    watermark_before: Watermark
    watermark_after: Watermark
    late_arrivals: dict[str, int] = Field(description="Rows per kind stored after their hour was collected.")
    counts: Counts
    reconciled: bool
    scrubbed: dict[str, int] = Field(description="Redactions by kind.")
    quarantine: dict[str, str | list[str]] = Field(description="{kind: key} of quarantined rows, {'files': [keys]}.")
    versions: Versions
    summary: RewardSummary
    withheld_by_version: dict[int, int] = Field(
        default_factory=dict,
        description=(
            "Completions the served version's suggestion filter withheld, by version: filtered as 'withheld' (no "
            "verdict can be about a text the user never saw), counted here as requests that version answered."
        ),
    )

    judged: dict[str, int] = Field(
        default_factory=dict, description="Judge id → the judge's score rows the run attached (counted under feedback)."
    )
    rescored_from: str | None = Field(
        None, description="The dataset whose logs this one re-scored under another rule (data_contracts/rescore.py)."
    )
    rescored_from_rule: RuleRef | None = Field(None, description="That dataset's rule.")
    releases: list[str] = Field(
        default_factory=list,
        description=(
            "Releases of quarantined rows this run took (released/model=M/<id>/, `tidal quarantine release`): their "
            "rows count in `counts` like log rows, with the one reason each release waived dropped."
        ),
    )


class DatasetManifest(CollectRecord):
    dataset_id: str
    rows: int = Field(description="Samples in the data file.")
    data_key: str = Field(description="Object key of the data file (part-0.parquet).")
    data_uri: str
    digest: str = Field(description="sha256:<hex> of the data file's bytes, checked again by the trainer.")
    schema_: dict[str, str] = Field(alias="schema", description="Column -> Arrow type of the data file.")
    withheld_key: str | None = Field(
        None,
        description=(
            "Object key of withheld.parquet: the completions the serving versions' suggestion filters withheld "
            "(WithheldSample rows), which the next candidate's filter is fitted on. None: nothing was withheld, or the "
            "dataset predates the file (then only withheld_by_version counts them)."
        ),
    )
    withheld_rows: int = Field(0, ge=0, description="Rows of withheld.parquet.")
    withheld_digest: str | None = Field(None, description="sha256:<hex> of withheld.parquet's bytes, checked by the trainer.")

    def stored(self) -> dict:
        """The stored form (JSON keys as written: 'in', 'from', 'schema')."""
        return self.model_dump(mode="json", by_alias=True)
