"""Base of every settings section, and what every layer raises about settings.

Kept apart so that each component declares its own sections in a leaf module of its own package; the
settings root (`tidal/settings.py`) only composes them.
"""

from pathlib import Path

from pydantic import BaseModel, ConfigDict

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class SettingsError(ValueError):
    """A bad setting, with the fix in its message."""


class Section(BaseModel):
    """A settings section: unknown keys are typos, refused like top-level ones."""

    model_config = ConfigDict(extra="forbid")


def deep_merge(config: dict, extra: dict) -> dict:
    """Merge extra into config in place and return it: a section given in both keeps the keys extra does not name."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            deep_merge(config[key], value)
        else:
            config[key] = value
    return config
