"""Base of every settings section (kept apart so component modules can declare their own sections)."""

from pydantic import BaseModel, ConfigDict


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
