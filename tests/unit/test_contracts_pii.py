"""Secrets and personal data: detection per kind, redaction, and the per-model `scrub` policy."""

from __future__ import annotations

import pyarrow as pa

from data_contracts import secrets
from data_contracts.collect_settings import CollectSettings
from tests.collect_harness import collect_once
from tests.unit.test_contracts_data import HOUR, T0, FixedVersions, completion, feedback, put_logs
from tidal.store import LocalStore

PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----"


def byte_encoder(text: str) -> list[int]:
    """A real byte-level tokenization (ids = UTF-8 bytes), standing in for the model's tokenizer."""
    return list(text.encode())


def test_detection_and_redaction_per_kind():
    texts = [
        "key = 'AKIAABCDEFGHIJKLMNOP'",
        PEM,
        "token sk-abcdefghijklmnopqrstuvwx",
        "mail bob@example.org",
        "x @ w.T + 1",
        None,
        "",
    ]
    assert secrets.detect(pa.array(texts)).to_pylist() == ["aws_access_key", "private_key", "api_key", "email", "", "", ""]
    text, counts = secrets.redact(f"a {PEM} b, mail bob@example.org and ann@example.org")
    assert text == "a [REDACTED:private_key] b, mail [REDACTED:email] and [REDACTED:email]"
    assert counts == {"private_key": 1, "email": 2}


def _store(tmp_path):
    store = LocalStore(tmp_path)
    leaky = completion(T0 + 1000, prompt="# ask jane@example.com\nkey = 'AKIAABCDEFGHIJKLMNOP'\n")
    leaky_out = completion(T0 + 2000, text="AKIAABCDEFGHIJKLMNOP")
    clean = completion(T0 + 3000)
    put_logs(store, "completions", [leaky, leaky_out, clean])
    put_logs(store, "feedback", [feedback(c, "accepted") for c in (leaky, leaky_out, clean)])
    return store, leaky, leaky_out, clean


def test_scrub_redacts_and_re_encodes_the_prompt_and_counts_it(tmp_path):
    store, leaky, leaky_out, clean = _store(tmp_path)
    cfg = CollectSettings(pii_policies={"tab": "scrub"})
    res = collect_once(store, FixedVersions([1], 1), "tab", cfg, T0 + 2 * HOUR, encoder=byte_encoder)
    samples = {r["request_id"]: r for r in res.samples.to_pylist()}
    assert set(samples) == {leaky["request_id"], clean["request_id"]}
    assert (
        bytes(samples[leaky["request_id"]]["prompt_token_ids"]).decode()
        == "# ask [REDACTED:email]\nkey = '[REDACTED:aws_access_key]'\n"
    )
    assert samples[clean["request_id"]]["prompt_token_ids"] == clean["prompt_token_ids"]
    assert res.manifest.stored()["scrubbed"] == {"aws_access_key": 1, "email": 1}
    # a secret in the completion cannot be scrubbed: its tokens and log-probs are the sample
    assert res.manifest.stored()["counts"]["completions"]["quarantined_by_reason"] == {"secret:aws_access_key": 1}


def test_quarantine_policy_and_scrub_without_a_tokenizer_both_quarantine(tmp_path):
    store, leaky, _, clean = _store(tmp_path)
    for cfg, encoder in ((CollectSettings(), byte_encoder), (CollectSettings(pii_policy="scrub"), None)):
        res = collect_once(LocalStore(tmp_path), FixedVersions([1], 1), "tab", cfg, T0 + 2 * HOUR, encoder=encoder)
        assert res.samples["request_id"].to_pylist() == [clean["request_id"]]
        assert (
            res.manifest.stored()["counts"]["completions"]["quarantined_by_reason"]
            == {"pii:email": 1, "secret:aws_access_key": 2}
            and res.manifest.stored()["scrubbed"] == {}
        )
        store.root.joinpath("state/watermarks/model=tab.json").unlink()  # run the same logs again
