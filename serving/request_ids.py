"""Signed request ids: the gateway issues one per completion; feedback must present it back.

An id is `<payload>.<sig>`, both urlsafe base64 without padding. The payload packs a format byte, a
random 96-bit nonce, the arrival time, the served version and arm, the model and the client id (format 2;
format 1, without version and arm, is still read: feedback on ids issued before an upgrade counts under
an unknown version and arm); the signature is HMAC-SHA256
(truncated to 16 bytes) of the payload text under a key derived from the gateway secret. A forged
or altered id fails `verify`, so feedback cannot be attributed to completions that were never
served, nor to another client's. The version and arm let any gateway process count a verdict under the
version that earned it.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import random
import re
import struct
from dataclasses import dataclass

MAX_LENGTH = 256
FORMAT = 2
NONCE_BYTES = 12
SIG_BYTES = 16
ARMS = ("control", "canary")  # arm code in the payload = index here
_HEAD_V1 = struct.Struct(">B12sQ")  # format, nonce, time_ms
_HEAD = struct.Struct(">B12sQIB")  # format, nonce, time_ms, version (0 = not given), arm code (255 = not given)
_NO_ARM = 255
_SIG_CHARS = 22  # base64 of 16 bytes, unpadded
_B64URL = re.compile(r"[A-Za-z0-9_-]+")
_KEY_LABEL = b"tidal/request-id/v1"


class InvalidRequestId(ValueError):
    """A request id that is not one this gateway issued; `reason` is a short machine-readable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"invalid request id ({reason}): {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RequestIdClaims:
    """What a verified request id says."""

    model: str
    client_id: str
    time_ms: int
    nonce: bytes  # 12 random bytes
    version: int | None = None  # the version that served the completion (None: a format-1 id, or not given)
    arm: str | None = None  # its arm, 'control' or 'canary' (None likewise)


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class RequestIdSigner:
    """Issues and verifies request ids with one secret (the same on every gateway process)."""

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError(f"request id secret must be at least 16 bytes, got {len(secret)}")
        # a key of its own, so the gateway secret can also key other hashes (user_hash) safely
        self._key = hmac.digest(secret, _KEY_LABEL, "sha256")
        # Nonces need uniqueness, not secrecy (the HMAC makes ids unforgeable): a generator seeded
        # from the OS once costs ~0.3 µs a nonce, where os.urandom per id cost ~130 µs on a VM.
        self._nonces = random.Random(os.urandom(32))

    def _sign(self, payload: str) -> str:
        return _b64encode(hmac.digest(self._key, payload.encode("ascii"), "sha256")[:SIG_BYTES])

    def issue(self, model: str, client_id: str, time_ms: int, version: int | None = None, arm: str | None = None) -> str:
        m, c = model.encode(), client_id.encode()
        if not m or not c:
            raise ValueError(f"request ids need a model and a client id, got model={model!r}, client_id={client_id!r}")
        if len(m) > 255 or len(c) > 255:
            raise ValueError(f"model and client id must each be at most 255 UTF-8 bytes, got {len(m)} and {len(c)}")
        if not 0 <= time_ms < 2**64:
            raise ValueError(f"time_ms must be a non-negative epoch millisecond count, got {time_ms}")
        if version is not None and not 1 <= version < 2**32:
            raise ValueError(f"version must be in [1, 2**32), got {version}")
        if arm is not None and arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
        code = _NO_ARM if arm is None else ARMS.index(arm)
        head = _HEAD.pack(FORMAT, self._nonces.randbytes(NONCE_BYTES), time_ms, version or 0, code)
        raw = head + bytes((len(m),)) + m + bytes((len(c),)) + c
        payload = _b64encode(raw)
        rid = f"{payload}.{self._sign(payload)}"
        if len(rid) > MAX_LENGTH:
            raise ValueError(
                f"model and client id too long: the request id would be {len(rid)} characters "
                f"(at most {MAX_LENGTH}); shorten the client id"
            )
        return rid

    def verify(self, request_id: str) -> RequestIdClaims:
        """The claims of an id this signer issued; InvalidRequestId(reason) otherwise.

        Reasons: 'too_long' (over MAX_LENGTH, checked before anything else), 'malformed' (not
        '<base64url>.<22 base64url chars>'), 'bad_signature' (altered, forged or another secret's),
        'bad_payload' (signed but unreadable: an unknown format version).
        """
        if not isinstance(request_id, str):
            raise InvalidRequestId("malformed", f"expected a string, got {type(request_id).__name__}")
        if len(request_id) > MAX_LENGTH:
            raise InvalidRequestId("too_long", f"{len(request_id)} characters, at most {MAX_LENGTH}")
        payload, dot, sig = request_id.partition(".")
        if not dot or len(sig) != _SIG_CHARS or not _B64URL.fullmatch(payload) or not _B64URL.fullmatch(sig):
            raise InvalidRequestId("malformed", "expected '<payload>.<signature>' in urlsafe base64")
        # compare the canonical signature text: any changed character fails, padding bits included
        if not hmac.compare_digest(self._sign(payload), sig):
            raise InvalidRequestId("bad_signature", "the signature does not match (altered, forged, or another secret)")
        try:
            raw = _b64decode(payload)
            fmt = raw[0]
            if fmt == FORMAT:
                _, nonce, time_ms, version, code = _HEAD.unpack_from(raw)
                if code != _NO_ARM and code >= len(ARMS):
                    raise ValueError(f"arm code {code}")
                i = _HEAD.size
            elif fmt == 1:
                (_, nonce, time_ms), version, code = _HEAD_V1.unpack_from(raw), 0, _NO_ARM
                i = _HEAD_V1.size
            else:
                raise InvalidRequestId("bad_payload", f"unknown id format {fmt} (this gateway reads 1 and {FORMAT})")
            m_end = i + 1 + raw[i]
            model = raw[i + 1 : m_end].decode()
            c_end = m_end + 1 + raw[m_end]
            client_id = raw[m_end + 1 : c_end].decode()
            if c_end != len(raw) or len(model) == 0 or len(client_id) == 0:
                raise ValueError("length fields do not match the payload")
        except InvalidRequestId:
            raise
        except (binascii.Error, struct.error, IndexError, ValueError) as e:
            raise InvalidRequestId("bad_payload", f"signed payload cannot be read: {e}") from e
        return RequestIdClaims(
            model=model,
            client_id=client_id,
            time_ms=time_ms,
            nonce=nonce,
            version=version or None,
            arm=None if code == _NO_ARM else ARMS[code],
        )
