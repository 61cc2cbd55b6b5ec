"""What the training tests share (tests/integration/test_ppo_train.py, test_tidal_scheduling.py): completions and
verdicts through the gateway, a dataset collected from them, steady traffic, the trainer's processes and what the
trainers pushed to the Pushgateway."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from data_contracts import corpus
from training.probe import probe_prompts


def single_line(text: str) -> bool:
    """The users of this test accept a suggestion that stays on its line and reject one that runs over."""
    return "\n" not in text


def complete(gateway: str, key: str, prompt: str, user: str) -> dict:
    r = httpx.post(
        gateway + "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        json={"model": "tab", "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "user": user},
    )
    r.raise_for_status()
    return r.json()


def feedback(gateway: str, key: str, request_id: str, event: str) -> None:
    r = httpx.post(
        gateway + "/v1/feedback",
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
        json={"request_id": request_id, "event": event},
    )
    assert r.status_code == 200, r.text


def tidal(settings, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TIDAL_CONFIG": os.environ["TIDAL_CONFIG"], **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, timeout=900, env=full_env, check=False
    )


def make_dataset(settings, gateway, keys, n: int, seed: int) -> str:
    from flows.collect import (
        collect,  # after the platform is up: Prefect reads its API URL on import
    )

    root = corpus.stdlib_root()
    _, heldout = corpus.split_stdlib(settings.bootstrap.heldout_fraction, root)
    prompts = probe_prompts(corpus.read_texts(heldout[:200]), n=n, prompt_chars=150, seed=seed)

    def one(i: int) -> None:
        answer = complete(gateway, keys["alice"], prompts[i], f"train-user-{seed}-{i}")
        text = answer["choices"][0]["text"]
        if text:
            feedback(gateway, keys["alice"], answer["id"], "accepted" if single_line(text) else "rejected")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(len(prompts))))
    time.sleep(3)  # segment age + upload interval of the sandbox log sink
    return collect(model="tab", include_open_hour=True)


class Traffic(threading.Thread):
    """Completions at a steady pace until stopped (one user, a request every quarter second: serving stays in use
    while the trainer keeps a core); counts answers and errors."""

    def __init__(self, gateway: str, key: str):
        super().__init__(daemon=True)
        self.gateway, self.key, self.ok, self.errors, self.stop = gateway, key, 0, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                complete(self.gateway, self.key, "def main():\n    ", "during-training")
                self.ok += 1
            except Exception as e:  # noqa: BLE001  counted, asserted on below
                self.errors.append(repr(e))
            time.sleep(0.25)


def pushed_training(pushgateway: str, model: str) -> dict[tuple[str, str, str], float]:
    """The model's training figures on the Pushgateway: (metric, run, outcome or '') → value."""
    text = httpx.get(f"{pushgateway}/metrics", timeout=10).text
    return {
        (s.name, s.labels["run"], s.labels.get("outcome", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("tidal_train_") and s.labels.get("model") == model
    }


def run_iterations(log: str) -> int:
    """The iterations the run planned, from the trainer's last `iteration i/N (...)` line."""
    last = [line for line in log.splitlines() if line.startswith("iteration ")][-1]
    return int(last.split()[1].split("/")[1])


def trainer_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "training.job" in cmd and "train" in cmd:
            out.append(p)
    return out
