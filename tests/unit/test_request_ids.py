"""Signed request ids: round trip, and every kind of forged or broken id refused with its own reason."""

from __future__ import annotations

import base64

import pytest

from serving.request_ids import MAX_LENGTH, InvalidRequestId, RequestIdSigner

SECRET = b"gateway-secret-0123456789abcdef"
T = 1_700_000_000_123


@pytest.fixture
def signer() -> RequestIdSigner:
    return RequestIdSigner(SECRET)


def reason(signer: RequestIdSigner, request_id) -> str:
    with pytest.raises(InvalidRequestId) as exc:
        signer.verify(request_id)
    assert exc.value.reason in str(exc.value)
    return exc.value.reason


def swap_char(text: str, i: int) -> str:
    return text[:i] + ("B" if text[i] != "B" else "C") + text[i + 1 :]


def test_round_trip(signer: RequestIdSigner) -> None:
    rid = signer.issue("tab", "client-42", T)
    claims = signer.verify(rid)
    assert (claims.model, claims.client_id, claims.time_ms) == ("tab", "client-42", T)
    assert len(claims.nonce) == 12
    assert len(rid) <= MAX_LENGTH and rid.count(".") == 1
    assert set(rid) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")
    assert RequestIdSigner(SECRET).verify(rid) == claims  # any gateway process with the secret


def test_the_serving_version_and_arm_round_trip(signer: RequestIdSigner) -> None:
    for version, arm in [(7, "canary"), (1, "control"), (2**32 - 1, "canary")]:
        claims = signer.verify(signer.issue("tab", "client-42", T, version=version, arm=arm))
        assert (claims.model, claims.version, claims.arm) == ("tab", version, arm)
    assert (signer.verify(signer.issue("tab", "c", T)).version, signer.verify(signer.issue("tab", "c", T)).arm) == (None, None)
    for bad in ({"version": 0}, {"version": 2**32}, {"arm": "shadow"}):
        with pytest.raises(ValueError):
            signer.issue("tab", "c", T, **bad)


def test_format_1_ids_issued_before_an_upgrade_are_still_read(signer: RequestIdSigner) -> None:
    raw = bytes([1]) + bytes(12) + T.to_bytes(8, "big") + b"\x03tab\x01c"
    payload = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    claims = signer.verify(f"{payload}.{signer._sign(payload)}")
    assert (claims.model, claims.client_id, claims.time_ms, claims.version, claims.arm) == ("tab", "c", T, None, None)


def test_round_trip_of_unicode_and_extreme_values(signer: RequestIdSigner) -> None:
    for model, client, t in [("m", "c", 0), ("modèle-ü", "клиент/1", 2**63), ("tab", "x" * 143, T)]:
        claims = signer.verify(signer.issue(model, client, t))
        assert (claims.model, claims.client_id, claims.time_ms) == (model, client, t)


def test_ids_are_unique(signer: RequestIdSigner) -> None:
    ids = [signer.issue("tab", "client", T) for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert len({signer.verify(i).nonce for i in ids[:1000]}) == 1000


def test_tampered_payload_is_refused(signer: RequestIdSigner) -> None:
    rid = signer.issue("tab", "client-42", T)
    payload, sig = rid.split(".")
    for i in (0, len(payload) // 2, len(payload) - 1):
        assert reason(signer, f"{swap_char(payload, i)}.{sig}") == "bad_signature"


def test_forged_claims_for_another_client_are_refused(signer: RequestIdSigner) -> None:
    rid = signer.issue("tab", "mallory", T)
    payload, sig = rid.split(".")
    raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).replace(b"mallory", b"victim1")
    forged = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    assert reason(signer, f"{forged}.{sig}") == "bad_signature"


def test_tampered_signature_is_refused_including_padding_bits(signer: RequestIdSigner) -> None:
    rid = signer.issue("tab", "client-42", T)
    payload, sig = rid.split(".")
    for i in range(len(sig)):  # the last character also carries 4 unused bits: changing them must fail too
        assert reason(signer, f"{payload}.{swap_char(sig, i)}") == "bad_signature"


def test_wrong_secret_is_refused(signer: RequestIdSigner) -> None:
    rid = RequestIdSigner(b"another-secret-0123456789abcdef").issue("tab", "client-42", T)
    assert reason(signer, rid) == "bad_signature"


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "abc",
        ".",
        "a.b",
        "..",
        "abc.def.ghi",
        "a+b/c.AAAAAAAAAAAAAAAAAAAAAA",
        "AAAA.AAAAAAAAAAAAAAAAAAAAA=",
        "héllo.AAAAAAAAAAAAAAAAAAAAAA",
        ".AAAAAAAAAAAAAAAAAAAAAA",
        None,
        b"AAAA.AAAAAAAAAAAAAAAAAAAAAA",
    ],
)
def test_garbage_is_malformed(signer: RequestIdSigner, garbage) -> None:
    assert reason(signer, garbage) == "malformed"


def test_over_long_input_is_refused_before_decoding(signer: RequestIdSigner) -> None:
    assert reason(signer, "A" * (MAX_LENGTH + 1)) == "too_long"
    assert reason(signer, "A." * 5_000_000) == "too_long"


def test_signed_but_unknown_format_is_a_bad_payload(signer: RequestIdSigner) -> None:
    raw = bytes([3]) + bytes(12) + T.to_bytes(8, "big") + bytes(5) + b"\x03tab\x01c"
    payload = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    assert reason(signer, f"{payload}.{signer._sign(payload)}") == "bad_payload"
    bad_arm = bytes([2]) + bytes(12) + T.to_bytes(8, "big") + bytes(4) + b"\x07" + b"\x03tab\x01c"
    payload = base64.urlsafe_b64encode(bad_arm).rstrip(b"=").decode()
    assert reason(signer, f"{payload}.{signer._sign(payload)}") == "bad_payload"
    truncated = payload[:10]
    assert reason(signer, f"{truncated}.{signer._sign(truncated)}") == "bad_payload"


def test_reasons_are_distinct(signer: RequestIdSigner) -> None:
    rid = signer.issue("tab", "client-42", T)
    reasons = {reason(signer, "garbage"), reason(signer, rid[:-1] + ("A" if rid[-1] != "A" else "B")), reason(signer, "A" * 300)}
    assert reasons == {"malformed", "bad_signature", "too_long"}


def test_issue_refuses_what_verify_could_not_accept(signer: RequestIdSigner) -> None:
    with pytest.raises(ValueError, match="client id"):
        signer.issue("tab", "", T)
    with pytest.raises(ValueError, match="time_ms"):
        signer.issue("tab", "c", -1)
    with pytest.raises(ValueError, match="at most 256"):
        signer.issue("tab", "x" * 200, T)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RequestIdSigner(b"short")
