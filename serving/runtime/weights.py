"""Checkpoints into an engine pod (Tidal image, `python -m serving.runtime.weights`).

    fetch --into DIR --version JSON   the init container: the base checkpoint, before vLLM starts on it
    serve --into DIR --port N         the sidecar: adapters deployed later; the supervisor calls POST /fetch, then
                                      vLLM's /v1/load_lora_adapter with the path it answers

Both go through the supervisor's own CheckpointCache: files land in DIR/<checkpoint key> and match the digest
registered with the version, or the fetch fails (CheckpointCorrupt, the reason in the pod's status or the
supervisor's error). The store is the one of the mounted tidal.yaml; the pod's IAM role reads checkpoints only.
Fetched adapters stay in DIR until the pod goes (its emptyDir has fleet.kubernetes.models_size).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tidal.registry import CheckpointCache, VersionInfo

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tidal.store import ObjectStore

KEY_PREFIX = "checkpoints/"
MODEL_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")  # as ModelSettings.name


def version_from(data: dict) -> VersionInfo:
    """A VersionInfo from its JSON form; refuses other keys, and any key outside the checkpoints area."""
    names = {f.name for f in fields(VersionInfo)}
    if not isinstance(data, dict) or set(data) - names or not {"model", "version", "kind", "base_version", "source"} <= set(data):
        raise ValueError(f"a version is an object with keys {sorted(names)}, got {data!r:.200}")
    info = VersionInfo(**data)
    if not (
        isinstance(info.model, str)
        and MODEL_NAME.match(info.model)
        and isinstance(info.version, int)
        and info.version >= 1
        and info.kind in ("full", "lora")
        and info.key.startswith(KEY_PREFIX)
    ):
        raise ValueError(f"not a registered model version: {data!r:.200}")
    return info


def fetch(store: ObjectStore, info: VersionInfo, into: Path) -> Path:
    """The version's checkpoint under `into`, verified against its registered digest."""
    return CheckpointCache(store, into).local_dir(info)


def fetch_remote(url: str, info: VersionInfo, timeout: float = 1800.0) -> str:
    """Ask a pod's sidecar at `url` to fetch `info`; the path the pod's engine reads it from."""
    from serving.engine import EngineError

    try:
        r = httpx.post(f"{url}/fetch", json={"version": asdict(info)}, timeout=timeout)
    except httpx.HTTPError as e:
        raise EngineError(f"checkpoint fetcher at {url} unreachable: {e!r}") from e
    if not r.is_success:
        raise EngineError(f"checkpoint fetcher at {url} could not fetch {info.served_name} ({r.status_code}): {r.text[:300]}")
    return r.json()["path"]


def build_app(store: ObjectStore, into: Path) -> FastAPI:
    from fastapi import Body, FastAPI, HTTPException

    from tidal.registry import CheckpointCorrupt

    app, lock = FastAPI(title="Tidal engine checkpoint fetcher"), threading.Lock()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.post("/fetch")
    def fetch_one(version: dict = Body(..., embed=True)) -> dict:
        try:
            info = version_from(version)
            with lock:  # one download at a time: the same adapter asked twice is fetched once
                return {"path": str(fetch(store, info, into))}
        except CheckpointCorrupt as e:  # a ValueError too: first
            raise HTTPException(409, str(e)) from e
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        except FileNotFoundError as e:
            raise HTTPException(404, str(e)) from e

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.runtime.weights", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    one = sub.add_parser("fetch", help="fetch one version's checkpoint, verified, then exit")
    one.add_argument("--into", type=Path, required=True)
    one.add_argument("--version", required=True, help="the version as JSON (VersionInfo fields)")
    srv = sub.add_parser("serve", help="fetch versions on request (POST /fetch)")
    srv.add_argument("--into", type=Path, required=True)
    srv.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)

    from tidal.core_settings import SettingsRoot, load_root
    from tidal.store import open_store

    store = open_store(load_root(SettingsRoot))  # the object store's section is all it reads
    if args.cmd == "fetch":
        info = version_from(json.loads(args.version))
        path = fetch(store, info, args.into)
        print(f"{info.served_name}: {path} verified")
        return 0
    import uvicorn

    uvicorn.run(build_app(store, args.into), host="0.0.0.0", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
