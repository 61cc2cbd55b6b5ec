"""Suite-wide: telemetry off, `gpu` tests skipped where no CUDA device is visible, and the one real
platform per session (tests/platform_fixtures.py) shared by the integration and chaos tests."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# session fixtures (started only when a test asks for them), the chaos report, the run's time budget
pytest_plugins = ["tests.platform_fixtures", "tests.chaos_report", "tests.budget"]


def _cuda_visible() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def pytest_addoption(parser):
    group = parser.getgroup("tidal")
    group.addoption(
        "--long",
        action="store_true",
        help="also run the tests marked `long` (the full chaos suite: minute-long outages, killed flows)",
    )
    group.addoption(
        "--chaos-report",
        default=None,
        metavar="PATH",
        help="where the chaos suite writes its markdown report (default .pytest_cache/chaos-report.md)",
    )


def pytest_collection_modifyitems(config, items):
    # Fast tests first, so a broken unit fails in the first minutes instead of after the platform's hour; the
    # sort is stable, so the tests that start real servers keep their file order (some build on what an earlier
    # one left); then those marked after_platform_tests, and last those that stop the platform.
    order = ("slow", "after_platform_tests", "stops_the_platform")  # each later than the one before
    items.sort(key=lambda item: max((i + 1 for i, m in enumerate(order) if m in item.keywords), default=0))
    skips = []
    if not _cuda_visible():
        skips.append(("gpu", pytest.mark.skip(reason="needs a CUDA device (none visible)")))
    if not config.getoption("--long"):
        skips.append(("long", pytest.mark.skip(reason="a full-length chaos scenario: run with --long")))
    for item in items:
        for marker, skip in skips:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A real S3-compatible server (moto_server, in memory) on a free loopback port, with dummy
    credentials in the environment. Each user creates its own bucket."""
    import sys
    import time
    from pathlib import Path

    import httpx

    from tidal.procs import free_port, stop_group

    server = Path(sys.executable).parent / "moto_server"
    if not server.exists():
        pytest.fail("moto_server is not installed: run ./run.sh setup")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_SESSION_TOKEN": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": "127.0.0.1,localhost",
        }.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(k, raising=False)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(tmp_path_factory.mktemp("moto") / "moto.log", "wb") as log:
            proc = subprocess.Popen(
                [str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                deadline = time.monotonic() + 30
                while True:
                    assert proc.poll() is None, f"moto_server exited with code {proc.returncode}"
                    try:
                        if httpx.get(url, timeout=1.0).status_code < 500:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline, "moto_server did not answer within 30 s"
                    time.sleep(0.05)
                yield url
            finally:
                stop_group(proc.pid, timeout=5)


def make_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=bucket)
