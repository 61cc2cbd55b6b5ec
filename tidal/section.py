"""Base of every settings section (kept apart so component modules can declare their own sections)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A settings section: unknown keys are typos, refused like top-level ones."""

    model_config = ConfigDict(extra="forbid")
