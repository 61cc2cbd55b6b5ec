"""Chaos 8: hostile input.

- The gateway's OpenAPI schema fuzzed with schemathesis (valid and invalid bodies, paths, headers; each
  case sent with the right credentials and with none): never a 5xx, the process never dies, no error
  body carries a key, the admin token or the signing secret, and nothing fuzzed changes the traffic split.
- Secrets in prompts never reach a dataset: prompts carrying an AWS key, a private key and an API token go
  through the gateway; the collect flow quarantines exactly those rows with their reason, and no dataset
  file holds them.
(Forged, replayed, late and cross-client feedback, unauthenticated or wrong-token admin calls and oversized
bodies are the cases of tests/integration/test_gateway.py, which report to this suite's report too.)
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest

from sim.audit import parquet_rows, wait_stored
from tidal.tokens import admin_token, secret

pytestmark = pytest.mark.slow


def test_fuzzed_gateway_never_answers_5xx_or_leaks_a_secret(settings, gateway, keys, platform, request, chaos_report):
    import schemathesis
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hypothesis_settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    examples = 150 if request.config.getoption("--long") else 20
    admin = admin_token(settings)
    signing = secret(settings.data_path, "request_id", settings.gateway.secret)
    never_shown = [keys["alice"], keys["bob"], admin, signing]
    routes_before = platform.routes_client().show().routes
    schema = schemathesis.openapi.from_url(gateway + "/openapi.json")
    statuses, failures, operations, skipped = Counter(), [], 0, []
    leaks = Counter()  # responses that showed a secret, by the secret's index in never_shown

    for result in schema.get_all_operations():
        op = result.ok()
        operations += 1
        auth = {"Authorization": f"Bearer {admin if op.path.startswith('/admin') else keys['bob']}"}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @hypothesis_settings(
                max_examples=examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
            )
            def fuzz(case):  # runs within this iteration (hypothesis calls it below), so the loop variables are current
                for headers in (auth, {}):  # noqa: B023
                    r = case.call(base_url=gateway, headers=headers, timeout=120)
                    statuses[r.status_code] += 1
                    leaked = [i for i, s in enumerate(never_shown) if s in r.text or s in str(r.headers)]
                    leaks.update(leaked)
                    if r.status_code >= 500 or leaked:
                        failures.append(
                            f"{op.method.upper()} {op.path} [{mode.value}] → {r.status_code} "  # noqa: B023
                            f"leaked={leaked}: {r.text[:200]}"
                        )

            try:
                fuzz()
            except Unsatisfiable:  # nothing in this operation can be made invalid (e.g. GET /health takes no input)
                assert mode == GenerationMode.NEGATIVE, f"{op.method.upper()} {op.path}: no valid case generated"
                skipped.append(f"{op.method.upper()} {op.path}")
    print("fuzz statuses:", dict(statuses), "no invalid case for:", skipped)
    assert failures == [], failures[:10]
    assert platform.running("gateway") is not None and httpx.get(gateway + "/health").status_code == 200
    assert platform.routes_client().show().routes == routes_before
    # the fuzzing went past authentication: bodies were parsed and refused (422/400/404/409), some accepted
    assert statuses[401] and sum(n for s, n in statuses.items() if s in (400, 404, 409, 413, 422)) > 0, statuses
    chaos_report.record(
        "8. hostile input: schema fuzzing",
        operations=operations,
        requests=sum(statuses.values()),
        server_errors=sum(n for s, n in statuses.items() if s >= 500),
        secrets_leaked=sum(leaks.values()),
        no_invalid_case_for=", ".join(skipped) or "none",
        statuses=" ".join(f"{s}×{n}" for s, n in sorted(statuses.items())),
    )


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _flood(gateway: str, n: int, seed: int) -> Counter:
    """n unauthenticated or wrongly authenticated requests to random paths, 8 at a time."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    shapes = ["/admin/{x}", "/admin/routes/{x}", "/admin/routes/{x}/canary", "/v1/{x}", "/{x}", "/v1/completions"]
    calls = [
        (
            rng.choice(["GET", "POST", "PUT"]),
            rng.choice(shapes).format(x=f"{rng.getrandbits(64):016x}"),
            {"Authorization": f"Bearer wrong-{rng.getrandbits(32):08x}"} if rng.random() < 0.5 else {},
        )
        for _ in range(n)
    ]

    def send(chunk) -> Counter:
        out = Counter()
        with httpx.Client(base_url=gateway, timeout=30) as client:
            for method, path, headers in chunk:
                out[client.request(method, path, headers=headers, json={}).status_code] += 1
        return out

    with ThreadPoolExecutor(8) as pool:
        return sum(pool.map(send, [calls[i::8] for i in range(8)]), Counter())


def test_an_unauthenticated_flood_leaves_the_gateways_memory_bounded(gateway, platform, chaos_report):
    """Request metrics were labelled with the raw path: every 401 on a new random path added a metric series that
    lived as long as the process, so anyone who could reach the gateway could grow its memory without bound."""
    pid = platform.running("gateway").pid
    warm = _flood(gateway, 2000, seed=1)  # allocator and connection pools settle
    rss_1, series_1 = _rss_mb(pid), len(httpx.get(gateway + "/metrics").text.splitlines())
    flood = _flood(gateway, 8000, seed=2)
    rss_2, series_2 = _rss_mb(pid), len(httpx.get(gateway + "/metrics").text.splitlines())
    statuses = warm + flood
    chaos_report.record(
        "12. unauthenticated flood on random paths",
        requests=sum(statuses.values()),
        statuses=" ".join(f"{s}×{n}" for s, n in sorted(statuses.items())),
        rss_mb_after_warmup=round(rss_1, 1),
        rss_mb_after_8000_more=round(rss_2, 1),
        metric_lines=f"{series_1} → {series_2}",
    )
    assert not [s for s in statuses if s >= 500] and statuses[401] > 0, statuses
    assert series_2 == series_1  # no series per path
    assert rss_2 - rss_1 < 10, (rss_1, rss_2)  # 8000 distinct paths held nothing (a series each was ~1-2 kB)
    assert httpx.get(gateway + "/health").status_code == 200


SECRETS = {
    "secret:aws_access_key": "aws = 'AKIAIOSFODNN7EXAMPLE'\n",
    "secret:private_key": "KEY = '''-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----'''\n",
    "secret:api_key": "token = 'sk-proj0123456789abcdefghijklmnop'\n",
}


def test_secrets_in_prompts_never_reach_a_dataset(settings, gateway, keys, checkpoints, chaos_report):
    """Through `tabfull` (no other test collects it), so the `tab` watermark stays the integration tests'."""
    from flows.collect import collect

    store = checkpoints.store
    sent = {}
    for reason, text in SECRETS.items():
        r = httpx.post(
            gateway + "/v1/completions",
            timeout=120,
            headers={"Authorization": f"Bearer {keys['alice']}"},
            json={"model": "tabfull", "prompt": text + "def f():\n    return", "max_tokens": 2, "user": "leaky"},
        )
        assert r.status_code == 200, r.text
        sent[r.json()["id"]] = reason
    clean = [
        httpx.post(
            gateway + "/v1/completions",
            timeout=120,
            headers={"Authorization": f"Bearer {keys['alice']}"},
            json={"model": "tabfull", "prompt": "def g(x):\n    return", "max_tokens": 2, "user": f"u{i}"},
        ).json()["id"]
        for i in range(3)
    ]
    for rid in [*sent, *clean]:  # every row has a verdict: only its secret can keep it out of the dataset
        r = httpx.post(
            gateway + "/v1/feedback",
            headers={"Authorization": f"Bearer {keys['alice']}"},
            timeout=30,
            json={"request_id": rid, "event": "rejected"},
        )
        assert r.status_code == 200, r.text
    wait_stored(store, "completions", set(sent) | set(clean), 90)
    wait_stored(store, "feedback", set(sent) | set(clean), 90)
    time.sleep(3)  # past the collect flow's upload grace: the open hour is read up to now - grace

    ds_id = collect(model="tabfull", include_open_hour=True)
    assert ds_id
    quarantined = parquet_rows(store, f"quarantine/model=tabfull/{ds_id}/")
    by_id = {r["request_id"]: r for r in quarantined if r.get("request_id") in sent}
    assert set(by_id) == set(sent), set(sent) - set(by_id)
    for rid, reason in sent.items():
        assert reason in str(by_id[rid].get("reasons") or by_id[rid].get("reason")), by_id[rid]
    dataset = parquet_rows(store, f"datasets/model=tabfull/{ds_id}/")
    text = str(dataset)
    for needle in ("AKIAIOSFODNN7EXAMPLE", "BEGIN RSA PRIVATE KEY", "sk-proj0123456789"):
        assert needle not in text
    assert not {r.get("request_id") for r in dataset} & set(sent)
    assert set(clean) <= {r.get("request_id") for r in dataset}  # the clean rows beside them were kept
    chaos_report.record(
        "8. hostile input: secrets in prompts",
        prompts_with_secrets=len(sent),
        quarantined_with_reason=len(by_id),
        clean_prompts=len(clean),
        dataset_rows=len(dataset),
        secrets_in_dataset=0,
    )
