"""Object store: a local directory by default, S3 (boto3) by configuration. Keys are POSIX paths."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

if TYPE_CHECKING:
    from tidal.core_settings import SettingsRoot
    from tidal.model_settings import CorpusSource


class ObjectStore(Protocol):
    url: str

    def put_file(self, local: Path, key: str) -> None: ...
    def get_file(self, key: str, local: Path) -> None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> list[str]: ...
    def list_modified(self, prefix: str) -> dict[str, int]: ...  # key → last modified, Unix ms (the store's clock)
    def uri(self, key: str) -> str: ...


class LocalStore:
    def __init__(self, root: Path):
        self.root = root
        self.url = root.as_uri()
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if not p.is_relative_to(self.root.resolve()):
            raise ValueError(f"object key {key!r} escapes the store root")
        return p

    def put_file(self, local: Path, key: str) -> None:
        dst = self._path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.copyfile(local, tmp)
        tmp.replace(dst)  # readers never see a half-written object

    def get_file(self, key: str, local: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise FileNotFoundError(f"no object {key!r} in {self.url}")
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, local)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))

    def list_modified(self, prefix: str) -> dict[str, int]:
        """key → when the object was last written (put_file replaces it whole, so that is its upload), Unix ms."""
        out = {}
        for key in self.list(prefix):
            try:
                out[key] = self._path(key).stat().st_mtime_ns // 1_000_000
            except FileNotFoundError:  # replaced or removed meanwhile
                continue
        return out

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()


class S3Store:
    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None, region: str):
        import boto3  # the local default needs no AWS SDK session

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, local: Path, key: str) -> None:
        self.client.upload_file(str(local), self.bucket, self._key(key))

    def get_file(self, key: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self.client.download_file(self.bucket, self._key(key), str(local))

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if e.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def list(self, prefix: str) -> list[str]:
        keys, strip = [], len(self.prefix) + 1 if self.prefix else 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
            keys += [o["Key"][strip:] for o in page.get("Contents", [])]
        return sorted(keys)

    def list_modified(self, prefix: str) -> dict[str, int]:
        """key → LastModified, Unix ms (S3 keeps whole seconds)."""
        out, strip = {}, len(self.prefix) + 1 if self.prefix else 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
            out.update({o["Key"][strip:]: int(o["LastModified"].timestamp() * 1000) for o in page.get("Contents", [])})
        return dict(sorted(out.items()))

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"


class RoutedStore:
    """Keys of some top-level areas (`logs/...`, `checkpoints/...`) live in stores of their own, with the
    same keys there: one bucket, and one IAM grant, per kind of data (store.routes)."""

    def __init__(self, default: ObjectStore, routes: dict[str, ObjectStore]):
        self.default, self.routes = default, routes
        self.url = default.url

    def _for(self, key: str) -> ObjectStore:
        return self.routes.get(key.split("/", 1)[0], self.default)

    def put_file(self, local: Path, key: str) -> None:
        self._for(key).put_file(local, key)

    def get_file(self, key: str, local: Path) -> None:
        self._for(key).get_file(key, local)

    def exists(self, key: str) -> bool:
        return self._for(key).exists(key)

    def list(self, prefix: str) -> list[str]:
        if "/" in prefix:  # within one area
            return self._for(prefix).list(prefix)
        # a prefix of area names: every store that may hold such keys, each listing only its own areas
        found = {k for k in self.default.list(prefix) if k.split("/", 1)[0] not in self.routes}
        for area, store in self.routes.items():
            if area.startswith(prefix) or prefix.startswith(area):
                found |= {k for k in store.list(prefix) if k.split("/", 1)[0] == area}
        return sorted(found)

    def list_modified(self, prefix: str) -> dict[str, int]:
        if "/" not in prefix:
            raise ValueError(f"list_modified needs a prefix within one area (like 'logs/...'), got {prefix!r}")
        return self._for(prefix).list_modified(prefix)

    def uri(self, key: str) -> str:
        return self._for(key).uri(key)


def open_store(settings: SettingsRoot) -> ObjectStore:
    default = open_url(settings.store_url, settings, "store.url")
    if not settings.store.routes:
        return default
    return RoutedStore(
        default, {area: open_url(url, settings, f"store.routes.{area}") for area, url in settings.store.routes.items()}
    )


def open_url(url: str, settings: SettingsRoot, setting: str) -> ObjectStore:
    """One store root, named in errors by the `setting` it came from: file:///dir, a directory, or s3://bucket/prefix."""
    if "://" not in url:  # a plain directory
        url = Path(url).expanduser().resolve().as_uri()
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalStore(Path(url2pathname(parsed.path)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{setting} {url!r} names no bucket; expected s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path, settings.store.s3_endpoint_url, settings.store.s3_region)
    raise ValueError(f"{setting} {url!r}: expected '' (local disk), file:///dir or s3://bucket/prefix")


def upload_dir(store: ObjectStore, local: Path, prefix: str) -> list[str]:
    keys = []
    for p in sorted(local.rglob("*")):
        if p.is_file():
            key = f"{prefix.rstrip('/')}/{p.relative_to(local).as_posix()}"
            store.put_file(p, key)
            keys.append(key)
    return keys


def download_dir(store: ObjectStore, prefix: str, local: Path) -> Path:
    """Copy every object under prefix into local (a cache: complete copies are marked and reused)."""
    done = local / ".complete"
    if done.exists():
        return local
    keys = store.list(prefix.rstrip("/") + "/")
    if not keys:
        raise FileNotFoundError(f"no objects under {prefix!r} in {store.url}")
    root = local.resolve()
    for key in keys:
        dest = (local / key[len(prefix.rstrip("/")) + 1 :]).resolve()
        if not dest.is_relative_to(root):  # an S3 key may hold '..' segments
            raise ValueError(f"object key {key!r} under {prefix!r} would be written outside {local}")
        store.get_file(key, dest)
    done.touch()
    return local


def local_corpus(corpus: CorpusSource, settings: SettingsRoot, cache: Path) -> CorpusSource:
    """The corpus as files here: one under an s3:// prefix copied into `cache` (a folder per listing of its objects'
    names and last-modified times, which S3 keeps to the second: a corpus changed since is copied afresh, an
    unchanged one once) and named by the copy, whose relative paths split train/held-out as the prefix's keys would;
    any other source as it is."""
    if not corpus.source.startswith("s3://"):
        return corpus
    parsed = urlparse(corpus.source)
    bucket, prefix = open_url(f"s3://{parsed.netloc}", settings, "models[].corpus.source"), parsed.path.strip("/")
    listing = bucket.list_modified(prefix + "/")
    if not listing:
        raise FileNotFoundError(
            f"models[].corpus: no object under {corpus.source!r}; upload the model's text there, or point "
            "corpus.source elsewhere (or set it to 'none' and train.ppo.ptx_coef to 0)"
        )
    digest = hashlib.sha256(json.dumps(sorted(listing.items())).encode()).hexdigest()[:16]
    local = download_dir(bucket, prefix, cache / "corpus" / digest)
    return corpus.model_copy(update={"source": str(local)})


def put_json(store: ObjectStore, key: str, data: dict) -> None:
    """Write `data` as one JSON object (whole: LocalStore renames into place, an S3 put is atomic)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "obj.json"
        path.write_text(json.dumps(data, indent=2, sort_keys=True))
        store.put_file(path, key)


def get_json(store: ObjectStore, key: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store.get_file(key, Path(tmp) / "obj.json")
        return json.loads((Path(tmp) / "obj.json").read_text())
