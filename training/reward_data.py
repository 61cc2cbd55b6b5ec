"""A collected reward dataset, as the trainer reads it: checked against its manifest, split train/held-out.

The collect flow writes `datasets/model=M/<dataset-id>/part-0.parquet` and a manifest with the
data's sha256. The trainer refuses anything that does not match what the collect flow promised:
a missing manifest, a digest mismatch (a file changed or truncated after collection), a schema
other than REWARD_SAMPLE_SCHEMA, rows that fail RewardSample, or an empty dataset. The withheld completions
beside it (`withheld.parquet`) are checked the same way.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from data_contracts.corpus import unit_hash
from data_contracts.dataset import ManifestError, dataset_prefix, read_manifest, read_watermark
from data_contracts.manifest import DatasetManifest
from data_contracts.rewards import RewardRule
from data_contracts.samples import REWARD_SAMPLE_SCHEMA, WITHHELD_SCHEMA, RewardSample, WithheldSample, upgrade_samples
from tidal.store import ObjectStore


class DatasetError(ValueError):
    """The dataset cannot be trained on; the message says which dataset, what is wrong and what to do."""


@dataclass
class RewardDataset:
    dataset_id: str
    digest: str  # "sha256:<hex>" of the Parquet file, as in the manifest
    reward_rule: str  # "name@version"
    samples: list[RewardSample]
    # the Tab rule that computed the rewards, as the manifest recorded it; None for another plugin's rule (or none recorded)
    rule: RewardRule | None
    withheld: dict[int, int] = field(default_factory=dict)  # {version: completions its suggestion filter withheld}
    # The withheld completions themselves (withheld.parquet); None: the dataset predates the file, only counts remain
    withheld_samples: list[WithheldSample] | None = field(default_factory=list)


def latest_dataset_id(store: ObjectStore, model: str) -> str:
    """The dataset the model's last collection wrote (its watermark names it)."""
    wm = read_watermark(store, model)
    if wm is None or not wm.dataset_id:
        raise DatasetError(f"{model} has no collected dataset yet: run `tidal collect {model}` first, or pass --dataset")
    return wm.dataset_id


def load_dataset(store: ObjectStore, model: str, ds_id: str) -> RewardDataset:
    """Read and check one dataset version; raises DatasetError naming the problem."""
    manifest_key = f"{dataset_prefix(model, ds_id)}/manifest.json"
    if not store.exists(manifest_key):
        known = sorted({k.split("/")[2] for k in store.list(f"datasets/model={model}/")})
        raise DatasetError(f"dataset {ds_id} of {model} not found ({manifest_key} missing); datasets: {known or 'none'}")
    try:
        manifest = read_manifest(store, model, ds_id)
    except ManifestError as e:
        raise DatasetError(f"dataset {ds_id}: {e}") from None
    table = upgrade_samples(read_checked(store, manifest.data_key, manifest.digest, ds_id, "data"))
    want = {f.name: _type_name(f.type) for f in REWARD_SAMPLE_SCHEMA}
    got = {f.name: _type_name(f.type) for f in table.schema}
    if want != got:
        diff = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        detail = "; ".join(f"{n}: expected {want.get(n, 'absent')}, got {got.get(n, 'absent')}" for n in diff)
        hint = ""
        if {"temperature", "top_p"} & set(diff) and not {"temperature", "top_p"} & got.keys():
            hint = (
                "; it predates rows carrying their sampling temperature (and engines logging mu after it), so "
                "PPO cannot weigh its rows: train on a dataset collected since"
            )
        raise DatasetError(f"dataset {ds_id}: schema is not the RewardSample schema ({detail}){hint}")
    if table.num_rows == 0:
        raise DatasetError(f"dataset {ds_id} of {model} has no rows: collect more traffic with feedback before training")
    samples: list[RewardSample] = []
    for i, row in enumerate(table.to_pylist()):
        try:
            samples.append(RewardSample.model_validate(row))
        except ValidationError as e:
            raise DatasetError(
                f"dataset {ds_id}: row {i} is not a RewardSample: {e.errors()[0]['msg']} at {e.errors()[0]['loc']}"
            ) from None
    wrong = {s.model for s in samples} - {model}
    if wrong:
        raise DatasetError(f"dataset {ds_id} holds rows of other models {sorted(wrong)}; expected only {model}")
    rules = {s.reward_rule for s in samples}
    rule = None
    if (recorded := manifest.reward_rule.rule) is not None:
        # The Tab rule is rebuilt here: hindsight rows, split credit and stop credit value their cuts by it. A
        # plugin's rule is not loaded in the trainer (its package need not be installed there): rule stays None.
        recorded_id = f"{recorded.get('name')}@{recorded.get('version', 1)}"
        if recorded.get("plugin", "cursor-tab") == "cursor-tab":
            try:
                rule = RewardRule.model_validate({**recorded, "plugin": "cursor-tab"})
            except ValidationError as e:
                raise DatasetError(
                    f"dataset {ds_id}: the manifest's reward_rule.rule is not a RewardRule: "
                    f"{e.errors()[0]['msg']} at {e.errors()[0]['loc']}"
                ) from None
            recorded_id = rule.id
        if rules != {recorded_id}:
            raise DatasetError(f"dataset {ds_id}: rows were rewarded by {sorted(rules)}, the manifest names {recorded_id}")
    return RewardDataset(
        ds_id,
        manifest.digest,
        ",".join(sorted(rules)),
        samples,
        rule,
        manifest.withheld_by_version,
        load_withheld(store, manifest, ds_id),
    )


def read_checked(store: ObjectStore, key: str, digest: str, ds_id: str, what: str) -> pa.Table:
    """One of the dataset's Parquet files, refused unless its bytes match the manifest's sha256 `digest`."""
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "file.parquet"
        try:
            store.get_file(key, local)
        except (KeyError, FileNotFoundError, OSError) as e:
            raise DatasetError(f"dataset {ds_id}: its {what} file is missing ({e})") from None
        got = "sha256:" + hashlib.sha256(local.read_bytes()).hexdigest()
        if got != digest:
            raise DatasetError(
                f"dataset {ds_id}: {what} digest {got[:19]}… does not match the manifest's "
                f"{digest[:19]}…; the file changed after collection, re-run collect"
            )
        try:
            return pq.read_table(local)
        except Exception as e:  # noqa: BLE001  pyarrow raises several types for a damaged file
            raise DatasetError(f"dataset {ds_id}: unreadable Parquet ({e})") from None


def load_withheld(store: ObjectStore, manifest: DatasetManifest, ds_id: str) -> list[WithheldSample] | None:
    """The dataset's withheld completions, checked against the manifest's digest and WITHHELD_SCHEMA; [] when none
    were withheld, None when the dataset predates withheld.parquet (its manifest only counts them)."""
    if manifest.withheld_key is None:
        return None if manifest.withheld_by_version else []
    table = read_checked(store, manifest.withheld_key, str(manifest.withheld_digest), ds_id, "withheld.parquet")
    want = {f.name: _type_name(f.type) for f in WITHHELD_SCHEMA}
    got = {f.name: _type_name(f.type) for f in table.schema}
    if want != got:
        raise DatasetError(f"dataset {ds_id}: withheld.parquet has columns {got}; expected the WithheldSample schema {want}")
    try:
        return [WithheldSample.model_validate(row) for row in table.to_pylist()]
    except ValidationError as e:
        raise DatasetError(
            f"dataset {ds_id}: a row of withheld.parquet is not a WithheldSample: {e.errors()[0]['msg']} at "
            f"{e.errors()[0]['loc']}"
        ) from None


def _type_name(t: pa.DataType) -> str:
    """A type as text, lists by their item type only (Parquet renames a list's item field 'element')."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_type_name(t.value_type)}>"
    return str(t)


def row_score(request_id: str) -> float:
    """A row's place in [0, 1): a hash of its request id, the same in every run."""
    return unit_hash(request_id)


def is_heldout(request_id: str, fraction: float) -> bool:
    """Stable per row: a hash of the request id, so a row's side never changes between runs."""
    return row_score(request_id) < fraction


def at_most(samples: list[RewardSample], n: int | None) -> list[RewardSample]:
    """Up to `n` of the samples (None: all): those of lowest row_score, a uniform subset that is the same in
    every run over the same rows; kept in dataset order."""
    if n is None or len(samples) <= n:
        return samples
    keep = set(sorted(range(len(samples)), key=lambda i: row_score(samples[i].request_id))[:n])
    return [s for i, s in enumerate(samples) if i in keep]


def split(samples: list[RewardSample], heldout_fraction: float) -> tuple[list[RewardSample], list[RewardSample]]:
    """(train, held-out) rows, in dataset order."""
    train = [s for s in samples if not is_heldout(s.request_id, heldout_fraction)]
    heldout = [s for s in samples if is_heldout(s.request_id, heldout_fraction)]
    return train, heldout
