"""training/run_metrics.py against a real Pushgateway (Debian's prometheus-pushgateway, on a free loopback port):
a trainer's iterations replace its model's progress group, each attempt's outcome keeps its own group, a push that
cannot reach the Pushgateway is reported once (no credential in the line) and training goes on; and the local
Prometheus configuration scrapes what was pushed with its labels kept."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidal.procs import free_port
from tidal.prometheus import PrometheusSettings, config, local_pushgateway
from tidal.section import SettingsError
from training import run_metrics
from training.job_spec import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PREEMPTED
from training.run_metrics import RunProgress, outcome_of, push_outcome


def start_pushgateway(port: int) -> subprocess.Popen:
    binary = shutil.which("prometheus-pushgateway")
    assert binary, "prometheus-pushgateway not found: `./run.sh setup` installs Debian's prometheus-pushgateway package"
    proc = subprocess.Popen(
        [binary, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the Pushgateway did not become ready in 20 s")


@pytest.fixture
def pushgateway():
    port = free_port()
    proc = start_pushgateway(port)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def pushed(url: str) -> dict[tuple[str, tuple], float]:
    """What a scrape of the Pushgateway reads: (metric, sorted labels) → value, Tidal's training metrics only."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("tidal_train_")
    }


def test_iterations_replace_the_models_progress_and_outcomes_keep_their_own_groups(pushgateway) -> None:
    first = RunProgress(pushgateway, "tab", "run-a", iterations=4)
    assert first.after_iteration(0, {"ppo/reward_mean": 0.25, "ppo/approx_kl": 0.01, "ppo/unshown": 7.0}, 30.0) is None
    assert first.after_iteration(1, {"ppo/reward_mean": 0.5, "ppo/approx_kl": 0.02}, 15.0) is None
    got = pushed(pushgateway)
    run_a = (("instance", ""), ("job", "tidal-training"), ("model", "tab"), ("run", "run-a"))
    assert got[("tidal_train_iteration", run_a)] == 2 and got[("tidal_train_iterations", run_a)] == 4
    assert got[("tidal_train_reward_mean", run_a)] == 0.5 and got[("tidal_train_seconds_left", run_a)] == 15.0
    assert abs(got[("tidal_train_last_iteration_timestamp_seconds", run_a)] - time.time()) < 60

    RunProgress(pushgateway, "tab", "run-b", iterations=3).after_iteration(0, {"ppo/reward_mean": 0.1}, 9.0)
    runs = {dict(labels)["run"] for (name, labels) in pushed(pushgateway) if name == "tidal_train_iteration"}
    assert runs == {"run-b"}  # the model's group holds its latest run only

    assert push_outcome(pushgateway, "tab", "run-b", "crashed", 12.0, now=1000.0) is None
    assert push_outcome(pushgateway, "tab", "run-b", "finished", 30.0, now=2000.0) is None
    ends = {dict(k[1])["outcome"]: v for k, v in pushed(pushgateway).items() if k[0] == "tidal_train_run_end_timestamp_seconds"}
    assert ends == {"crashed": 1000.0, "finished": 2000.0}
    with pytest.raises(ValueError, match="unknown training outcome 'oom'"):
        push_outcome(pushgateway, "tab", "run-b", "oom", 1.0)


def test_an_unreachable_pushgateway_is_reported_once_and_training_goes_on() -> None:
    port = free_port()
    url = f"http://tidal:s3cret@127.0.0.1:{port}"
    progress = RunProgress(url, "tab", "run-c", iterations=5)
    t0 = time.monotonic()
    line = progress.after_iteration(0, {"ppo/reward_mean": 0.3}, 10.0)
    assert time.monotonic() - t0 < run_metrics.PUSH_TIMEOUT_S + 1
    assert line and f"127.0.0.1:{port}" in line and "training goes on" in line and "s3cret" not in line
    assert progress.after_iteration(1, {}, 5.0) is None  # still failing: said once
    proc = start_pushgateway(port)
    try:
        assert progress.after_iteration(2, {}, 2.0) == f"metrics: pushing to 127.0.0.1:{port} again"
        assert (
            pushed(f"http://127.0.0.1:{port}")[
                ("tidal_train_iteration", (("instance", ""), ("job", "tidal-training"), ("model", "tab"), ("run", "run-c")))
            ]
            == 3
        )
    finally:
        proc.terminate()
        proc.wait(10)
    error = push_outcome(url, "tab", "run-c", "finished", 1.0)
    assert error and "s3cret" not in error


def test_exit_codes_name_the_attempts_outcome() -> None:
    assert [outcome_of(c) for c in (0, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PREEMPTED, 1, -9)] == [
        "finished",
        "bad_input",
        "diverged",
        "preempted",
        "crashed",
        "crashed",
    ]


def test_prometheus_scrapes_the_pushgateway_with_the_pushed_labels() -> None:
    local = PrometheusSettings(pushgateway_url="http://127.0.0.1:9091")
    jobs = {j["job_name"]: j for j in config(local, "127.0.0.1:8000", "127.0.0.1:8001")["scrape_configs"]}
    assert jobs["tidal-training"] == {
        "job_name": "tidal-training",
        "honor_labels": True,
        "scheme": "http",
        "metrics_path": "/metrics",
        "static_configs": [{"targets": ["127.0.0.1:9091"]}],
    }
    assert local_pushgateway(local) == ("127.0.0.1", 9091)
    cluster = PrometheusSettings(pushgateway_url="https://push.example.com/pg/")
    job = {j["job_name"]: j for j in config(cluster, "g:1", "f:2")["scrape_configs"]}["tidal-training"]
    assert (job["scheme"], job["metrics_path"], job["static_configs"]) == (
        "https",
        "/pg/metrics",
        [{"targets": ["push.example.com"]}],
    )
    assert local_pushgateway(cluster) is None  # the cluster's: `tidal up` starts none
    guarded = PrometheusSettings(pushgateway_url="https://ci:p%40ss@push.example.com")
    job = {j["job_name"]: j for j in config(guarded, "g:1", "f:2")["scrape_configs"]}["tidal-training"]
    assert job["basic_auth"] == {"username": "ci", "password": "p@ss"} and job["static_configs"][0]["targets"] == [
        "push.example.com"
    ]
    assert "tidal-training" not in {j["job_name"] for j in config(PrometheusSettings(), "g:1", "f:2")["scrape_configs"]}
    plain = {j["job_name"] for j in config(PrometheusSettings(), "g:1", "f:2")["scrape_configs"]}
    tidal = {j["job_name"]: j for j in config(PrometheusSettings(), "g:1", "f:2", capacity="c:3")["scrape_configs"]}
    assert "tidal-capacity" not in plain and tidal["tidal-capacity"]["static_configs"] == [{"targets": ["c:3"]}]
    with pytest.raises(SettingsError, match="serves at the root"):
        local_pushgateway(PrometheusSettings(pushgateway_url="http://127.0.0.1:9091/pg"))
    with pytest.raises(ValueError, match="pushgateway_url"):
        PrometheusSettings(pushgateway_url="127.0.0.1:9091")  # no scheme
