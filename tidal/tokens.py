"""The admin token: from settings, else generated once into the data directory (mode 0600)."""

from __future__ import annotations

import os
import secrets

from tidal.settings import TidalSettings


def admin_token(settings: TidalSettings) -> str:
    if settings.admin_token:
        return settings.admin_token
    path = settings.run_dir.parent / "secrets" / "admin_token"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    return path.read_text().strip()
