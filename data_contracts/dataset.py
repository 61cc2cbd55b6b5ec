"""Objects a collection run writes: quarantine, the dataset version with its manifest, the watermark.

    quarantine/model=M/<dataset-id>/{completions,feedback}.parquet   rows in stored schema + reason, source_key
    quarantine/model=M/<dataset-id>/files/<log key>                  log objects quarantined whole (schema)
    datasets/model=M/<dataset-id>/part-0.parquet                     RewardSample rows
    datasets/model=M/<dataset-id>/withheld.parquet                   WithheldSample rows (when any were withheld)
    datasets/model=M/<dataset-id>/manifest.json                      counts, digest, rule, sources, watermarks
    state/watermarks/model=M.json                                    written last, only after the dataset

The dataset id digests what determines the content (model, the watermark the run starts from, the
source partitions, the reward rule, the contract version), so a run that crashed before advancing the
watermark is redone under the same id and overwrites the same keys.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from data_contracts.ledger import Ledger
from data_contracts.logs import Batch
from data_contracts.manifest import CollectRecord, DatasetManifest
from data_contracts.scope import Watermark, watermark_key
from tidal.store import ObjectStore


def dataset_id(model: str, wm: Watermark, partitions: list[str], rule_id: str, contract_version: str) -> str:
    key = json.dumps([model, wm.completions_through_ms, wm.feedback_through_ms, sorted(partitions), rule_id, contract_version])
    return "ds-" + hashlib.sha256(key.encode()).hexdigest()[:20]


def dataset_prefix(model: str, ds_id: str) -> str:
    return f"datasets/model={model}/{ds_id}"


def quarantine_prefix(model: str, ds_id: str) -> str:
    return f"quarantine/model={model}/{ds_id}"


def data_docs_prefix(model: str, ds_id: str) -> str:
    """Where a collection's Great Expectations Data Docs site lives (index.html at its root)."""
    return f"reports/data_docs/model={model}/{ds_id}"


def latest_data_docs(store: ObjectStore, model: str) -> str | None:
    """The prefix of the Data Docs of the model's latest collection (None before its first)."""
    wm = read_watermark(store, model)
    if wm is None or not wm.dataset_id:
        return None
    prefix = data_docs_prefix(model, wm.dataset_id)
    return prefix if store.exists(f"{prefix}/index.html") else None


def read_watermark(store: ObjectStore, model: str) -> Watermark | None:
    key = watermark_key(model)
    if not store.exists(key):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        store.get_file(key, Path(tmp) / "wm.json")
        return Watermark.model_validate_json((Path(tmp) / "wm.json").read_text())


def write_watermark(store: ObjectStore, wm: Watermark) -> str:
    return put_bytes(store, watermark_key(wm.model), wm.model_dump_json(indent=2).encode())


def put_bytes(store: ObjectStore, key: str, data: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "object"
        path.write_bytes(data)
        store.put_file(path, key)
    return key


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def read_parquet(store: ObjectStore, key: str) -> pa.Table:
    with tempfile.TemporaryDirectory() as tmp:
        store.get_file(key, Path(tmp) / "t.parquet")
        return pq.read_table(Path(tmp) / "t.parquet")


def write_quarantine(store: ObjectStore, batch: Batch, ledgers: dict[str, Ledger], ds_id: str) -> dict[str, list[str] | str]:
    """Quarantined rows (with `reason`: every reason, comma-joined, and `source_key`) and whole files.
    Returns {kind: key} for row files written and {"files": [keys]} for copied objects."""
    prefix, written = quarantine_prefix(batch.model, ds_id), {}
    for kind, ledger in ledgers.items():
        if not ledger.quarantined:
            continue
        rows = sorted(ledger.quarantined)
        kind_rows = getattr(batch, kind)
        table = kind_rows.table.take(pa.array(rows, pa.int64()))
        table = table.append_column("reason", pa.array([",".join(ledger.quarantined[r]) for r in rows], pa.string()))
        table = table.append_column("source_key", pa.array([batch.files[kind_rows.source[r]] for r in rows], pa.string()))
        written[kind] = put_bytes(store, f"{prefix}/{kind}.parquet", parquet_bytes(table))
    copies = []
    with tempfile.TemporaryDirectory() as tmp:
        for bad in batch.bad_files:
            local = Path(tmp) / "object"
            store.get_file(bad.key, local)
            store.put_file(local, f"{prefix}/files/{bad.key}")
            copies.append(f"{prefix}/files/{bad.key}")
    if copies:
        written["files"] = copies
    return written


def write_dataset(
    store: ObjectStore, model: str, ds_id: str, samples: pa.Table, record: CollectRecord, withheld: pa.Table | None = None
) -> DatasetManifest:
    """Write the samples (and the withheld completions, if any), then the manifest with their digests; returns the
    manifest as written."""
    data = parquet_bytes(samples)
    prefix = dataset_prefix(model, ds_id)
    extra = {}
    if withheld is not None and withheld.num_rows:
        held = parquet_bytes(withheld)
        extra = {
            "withheld_key": f"{prefix}/withheld.parquet",
            "withheld_rows": withheld.num_rows,
            "withheld_digest": "sha256:" + hashlib.sha256(held).hexdigest(),
        }
        put_bytes(store, extra["withheld_key"], held)
    manifest = DatasetManifest.model_validate(
        {
            **record.model_dump(),
            "dataset_id": ds_id,
            "rows": samples.num_rows,
            "data_key": f"{prefix}/part-0.parquet",
            "data_uri": store.uri(f"{prefix}/part-0.parquet"),
            "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
            "schema": {n: str(t) for n, t in zip(samples.schema.names, samples.schema.types)},
            **extra,
        }
    )
    put_bytes(store, f"{prefix}/part-0.parquet", data)
    put_bytes(store, f"{prefix}/manifest.json", json.dumps(manifest.stored(), indent=2, sort_keys=True).encode())
    return manifest


class ManifestError(ValueError):
    """A stored manifest that is not a DatasetManifest (damaged, or written by another version of Tidal)."""


def read_manifest(store: ObjectStore, model: str, ds_id: str) -> DatasetManifest:
    key = f"{dataset_prefix(model, ds_id)}/manifest.json"
    with tempfile.TemporaryDirectory() as tmp:
        store.get_file(key, Path(tmp) / "m.json")
        text = (Path(tmp) / "m.json").read_text()
    try:
        return DatasetManifest.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        raise ManifestError(
            f"{key} is not a dataset manifest ({e.error_count()} problems; first: {first['msg']} at "
            f"{'.'.join(str(p) for p in first['loc'])}): re-run collect to write it again"
        ) from None
