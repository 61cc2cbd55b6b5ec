"""Secrets: from settings when given, else generated once into data_dir/secrets (mode 0600)."""

from __future__ import annotations

import os
import secrets as _secrets

from tidal.settings import ClientKey, TidalSettings


def secret(settings: TidalSettings, name: str, given: str | None = None) -> str:
    if given:
        return given
    path = settings.data_path / "secrets" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            return path.read_text().strip()
        with os.fdopen(fd, "w") as f:
            f.write(_secrets.token_urlsafe(32))
    return path.read_text().strip()


def admin_token(settings: TidalSettings) -> str:
    return secret(settings, "admin_token", settings.admin_token)


def client_keys(settings: TidalSettings) -> list[ClientKey]:
    """Configured API clients, or one client 'local' with a generated key."""
    return settings.gateway.clients or [ClientKey(client_id="local", key=secret(settings, "client_key_local"))]
