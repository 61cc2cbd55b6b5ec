"""Model registry on MLflow: one registered model per served model, one version per checkpoint.

A version's weights live in the object store at `checkpoints/model=M/version=V/` (HF directory for
`full`, PEFT adapter for `lora`), with `probe.json` beside them. MLflow holds the lineage tags and
the aliases `champion` / `candidate` / `previous`.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tidal import lineage
from tidal.store import LocalStore, ObjectStore, download_dir

Kind = Literal["full", "lora"]


class RegistryError(LookupError):
    """Unknown model, version or alias; the message says what exists."""


class RegistryUnavailable(RegistryError):
    """The MLflow server did not answer (down, unreachable, or failing with 5xx) after the client's retries."""


def _unavailable(e: MlflowException) -> bool:
    # mlflow's REST client: "API request to <url> failed with exception <requests error>" (connection refused,
    # timeout, retries exhausted) or "... failed with error code 5xx"; other errors are answers (e.g. not found).
    msg = str(e)
    return msg.startswith("API request to") and ("failed with exception" in msg or "error code 5" in msg)


def _cause(msg: str) -> str:
    """The useful words of a requests/urllib3 failure (its full text repeats the URL and object reprs)."""
    for needle, said in (
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Name or service not known", "unknown host"),
        ("RemoteDisconnected", "connection dropped"),
    ):
        if needle in msg:
            return said
    return msg.split(" failed with ")[-1][:160]


class _GuardedClient:
    """MlflowClient whose calls raise RegistryUnavailable, naming the server and the fix, when MLflow is away:
    an outage must never read as 'no such model/alias' (that would re-bootstrap a model or reuse a version)."""

    def __init__(self, client: MlflowClient, uri: str):
        self._client, self._uri = client, uri

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except MlflowException as e:
                if _unavailable(e):
                    raise RegistryUnavailable(
                        f"MLflow at {self._uri} is unavailable ({_cause(str(e))}); start it with "
                        "`tidal up` (or fix mlflow.host/port), then retry"
                    ) from None
                raise

        return call


class CheckpointCorrupt(ValueError):
    """A checkpoint's files differ from the digest registered with its version (truncated, edited, swapped)."""


DIGEST_TAG = lineage.CHECKPOINT_DIGEST


def checkpoint_files(path: Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes} of a checkpoint directory (dotfiles are cache markers, not weights)."""
    out = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        out[f.relative_to(path).as_posix()] = h.hexdigest()
    return out


def checkpoint_digest(files: dict[str, str]) -> str:
    """One digest of the whole directory: every file's name and content."""
    return "sha256:" + hashlib.sha256("".join(f"{k}\t{v}\n" for k, v in sorted(files.items())).encode()).hexdigest()


def verify_checkpoint(info: VersionInfo, path: Path) -> None:
    """Raise CheckpointCorrupt unless the files at `path` are the ones registered with `info`.

    Versions registered before digests were recorded carry no digest tag and are not checked."""
    want = info.tags.get(DIGEST_TAG)
    if want is None:
        return
    files = checkpoint_files(path)
    got = checkpoint_digest(files)
    if got != want:
        raise CheckpointCorrupt(
            f"checkpoint of {info.served_name} at {path} does not match the digest registered with it ({want[:19]}… "
            f"registered, {got[:19]}… found over {len(files)} files: {sorted(files)[:6]}): a file was truncated, edited "
            "or replaced; restore it from the object store's versioned copy or publish the checkpoint again"
        )


def checkpoint_key(model: str, version: int) -> str:
    return f"checkpoints/model={model}/version={version}"


def registry_source(store: ObjectStore, key: str) -> str:
    """The version's `source` in MLflow: the S3 URI itself; for the local store `tidal://store/<key>`,
    since MLflow refuses file paths outside a run's artifact directory."""
    uri = store.uri(key)
    return uri if uri.startswith("s3://") else f"tidal://store/{key}"


@dataclass(frozen=True)
class VersionInfo:
    model: str
    version: int
    kind: Kind
    base_version: int  # the full checkpoint a LoRA applies to; itself for `full`
    source: str  # store URI of the checkpoint directory
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def served_name(self) -> str:
        return f"{self.model}@v{self.version}"

    # Lineage, typed (tidal/lineage.py names the tags).
    @property
    def parent_version(self) -> int | None:
        """The champion it was trained from; None for version 1 (or a version published without lineage)."""
        parent = self.tags.get(lineage.PARENT_VERSION)
        return int(parent) if parent not in (None, "none") else None

    @property
    def gate_passed(self) -> bool | None:
        """The offline gate's verdict; None when no gate ran."""
        return lineage.read_flag(self.tags.get(lineage.GATE_PASSED))

    @property
    def gate_reason(self) -> str | None:
        return self.tags.get(lineage.GATE_REASON)

    @property
    def train_run(self) -> str | None:
        return self.tags.get(lineage.TRAIN_RUN)

    @property
    def dataset_id(self) -> str | None:
        return self.tags.get(lineage.DATASET_ID)

    def release_event(self, event: str) -> dict | None:
        """The audit record of one release event, or None."""
        return lineage.read_json(self.tags.get(lineage.release_tag(event)))

    @property
    def key(self) -> str:
        return checkpoint_key(self.model, self.version)


class Registry:
    def __init__(self, tracking_uri: str):
        self.client = _GuardedClient(MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri), tracking_uri)

    def _ensure_model(self, model: str) -> None:
        try:
            self.client.get_registered_model(model)
        except MlflowException:
            self.client.create_registered_model(model, tags={lineage.MANAGED: "true"})

    def versions(self, model: str) -> list[int]:
        return sorted(int(v.version) for v in self.client.search_model_versions(f"name='{model}'"))

    def next_version(self, model: str) -> int:
        return max(self.versions(model), default=0) + 1

    def register(
        self,
        model: str,
        version: int,
        kind: Kind,
        base_version: int,
        source: str,
        tags: dict[str, str],
        run_id: str | None = None,
    ) -> VersionInfo:
        """Register the checkpoint uploaded for `version` (from next_version); fails if another writer took it."""
        self._ensure_model(model)
        all_tags = {**tags, lineage.KIND: kind, lineage.BASE_VERSION: str(base_version)}
        mv = self.client.create_model_version(model, source=source, run_id=run_id, tags=all_tags)
        if int(mv.version) != version:
            self.client.delete_model_version(model, mv.version)
            raise RegistryError(
                f"{model}: expected to register version {version}, registry assigned {mv.version} (concurrent registration?)"
            )
        return self.get(model, version)

    def get(self, model: str, version: int) -> VersionInfo:
        try:
            mv = self.client.get_model_version(model, str(version))
        except MlflowException:
            known = self.versions(model)
            raise RegistryError(f"{model} has no version {version}; registered versions: {known or 'none'}") from None
        kind = mv.tags.get(lineage.KIND, "full")
        return VersionInfo(
            model, int(mv.version), kind, int(mv.tags.get(lineage.BASE_VERSION, mv.version)), mv.source, dict(mv.tags)
        )

    def by_alias(self, model: str, alias: str) -> VersionInfo | None:
        version = self.aliases(model).get(alias)
        return None if version is None else self.get(model, version)

    def aliases(self, model: str) -> dict[str, int]:
        # search_model_versions returns empty aliases; the registered model has them.
        try:
            return {a: int(v) for a, v in self.client.get_registered_model(model).aliases.items()}
        except MlflowException:
            return {}

    def set_alias(self, model: str, alias: str, version: int) -> None:
        """Tidal's own alias move, marked on the version first so that the registry webhook's receiver can tell it
        from an operator's (release/registry_webhook.py)."""
        self.get(model, version)
        self.client.set_model_version_tag(model, str(version), lineage.ALIAS_MARK + alias, str(int(time.time() * 1000)))
        self.client.set_registered_model_alias(model, alias, str(version))

    def own_alias_move(self, info: VersionInfo, alias: str, at_ms: int) -> bool:
        """Whether the move of `alias` to `info` announced at at_ms was Tidal's: its mark is consumed either way, and
        counts when the announcement comes from a minute before (clock skew) to ten minutes after it: a mark no
        delivery consumed (the receiver was down) must not hide a later move by hand."""
        key = lineage.ALIAS_MARK + alias
        mark = info.tags.get(key)
        if mark is None:
            return False
        self.client.delete_model_version_tag(info.model, str(info.version), key)
        return -60_000 <= at_ms - int(mark) <= 600_000

    def find_by_tag(self, model: str, key: str, value: str) -> VersionInfo | None:
        """The newest version whose tag `key` equals `value`, or None."""
        for version in reversed(self.versions(model)):
            info = self.get(model, version)
            if info.tags.get(key) == value:
                return info
        return None

    def set_tags(self, model: str, version: int, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_model_version_tag(model, str(version), k, v)

    def resolve(self, model: str, ref: str | int) -> VersionInfo:
        """`3`, `v3`, `@champion` or `champion` → VersionInfo."""
        text = str(ref)
        if text.lstrip("v").isdigit():
            return self.get(model, int(text.lstrip("v")))
        info = self.by_alias(model, text.lstrip("@"))
        if info is None:
            raise RegistryError(f"{model} has no alias {text!r}; aliases: {self.aliases(model) or 'none'}")
        return info


class CheckpointCache:
    """Local directories of checkpoints: the store's own files when it is local, else a download cache.
    Every directory handed out matches its version's registered digest (CheckpointCorrupt otherwise)."""

    def __init__(self, store: ObjectStore, cache_dir: Path):
        self.store, self.cache_dir = store, cache_dir

    def local_dir(self, info: VersionInfo) -> Path:
        if isinstance(self.store, LocalStore):
            path = self.store.root / info.key
            if not (path / "probe.json").is_file():
                raise FileNotFoundError(f"checkpoint of {info.served_name} missing or incomplete at {path} (no probe.json)")
            verify_checkpoint(info, path)  # every time: these are the store's own files
            return path
        path = download_dir(self.store, info.key, self.cache_dir / info.key)
        # A download is checked once: later calls (every boot and deploy) skip re-hashing what passed.
        marker, want = path / ".verified", info.tags.get(DIGEST_TAG, "")
        if not (want and marker.is_file() and marker.read_text() == want):
            verify_checkpoint(info, path)
            if want:
                marker.write_text(want)
        return path


def code_revision(root: Path) -> str:
    """The git commit the code under `root` is at, for a version's lineage tags ("unknown" outside a checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def publish(
    registry: Registry,
    store: ObjectStore,
    model: str,
    local_dir: Path,
    kind: Kind,
    base_version: int | None,
    tags: dict[str, str],
    run_id: str | None = None,
) -> VersionInfo:
    """Upload a checkpoint directory (with its probe.json) and register it as the model's next version.

    `base_version` None means "this version itself" (a full checkpoint is its own base).
    """
    from tidal.store import upload_dir

    if not (local_dir / "probe.json").is_file():
        raise FileNotFoundError(f"{local_dir} has no probe.json: every version needs its served-weight probe")
    digest = checkpoint_digest(checkpoint_files(local_dir))  # of what is uploaded: loaders check it (verify_checkpoint)
    version = registry.next_version(model)
    key = checkpoint_key(model, version)
    upload_dir(store, local_dir, key)
    return registry.register(
        model, version, kind, base_version or version, registry_source(store, key), {**tags, DIGEST_TAG: digest}, run_id
    )
