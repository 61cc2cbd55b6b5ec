"""Secrets: from settings when given, else generated once into data_dir/secrets (mode 0600).

A generated secret is written whole or not at all: into a private temporary file, flushed to disk, then linked
to its name, which fails if another process got there first (its secret is then the one used). A secret shorter
than MIN_SECRET_CHARS, given or read, is refused: an empty token would equal a missing header.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets as _secrets
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.section import SettingsError

if TYPE_CHECKING:
    from tidal.core_settings import SettingsRoot

MIN_SECRET_CHARS = 16


def secret(data_path: Path, name: str, given: str | None = None) -> str:
    """The given secret, else the one generated once into data_path/secrets/name."""
    if given is not None:
        return _checked(given, f"the configured {name}", "set a longer one")
    path = data_path / "secrets" / name
    if not path.exists():
        _create(path, _secrets.token_urlsafe(32))
    return _checked(path.read_text().strip(), f"{path}", "delete the file to have a new secret generated")


def _checked(value: str, what: str, fix: str) -> str:
    if len(value) < MIN_SECRET_CHARS:
        # the value itself is never echoed: a short secret is still a secret
        raise SettingsError(
            f"{what} is {'empty' if not value else f'{len(value)} characters'}; a secret needs at least {MIN_SECRET_CHARS}: {fix}"
        )
    return value


def _create(path: Path, value: str) -> None:
    """Write value to path atomically with mode 0600, unless path exists (then leave the other writer's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{_secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(value)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists
        except FileExistsError:
            pass
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


def fernet_key(value: str) -> str:
    """A Fernet key (urlsafe base64 of 32 bytes) derived from a secret: MLflow's webhook-secret encryption key."""
    return base64.urlsafe_b64encode(hashlib.sha256(value.encode()).digest()).decode()


def admin_token(settings: SettingsRoot) -> str:
    return secret(settings.data_path, "admin_token", settings.admin_token)


def bearer(authorization: str) -> str:
    """The credential of an `Authorization: Bearer <credential>` header ('' when there is none)."""
    return authorization.removeprefix("Bearer ").strip()


def admin_authorized(authorization: str, token: str) -> bool:
    """Whether the header carries the admin token: one constant-time comparison, for every admin API."""
    return hmac.compare_digest(bearer(authorization).encode(), token.encode())
