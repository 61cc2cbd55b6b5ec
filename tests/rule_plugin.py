"""A team's reward-rule plugin as a package of its own, written into a directory: a module and the dist-info that
registers it in the `tidal.reward_rules` entry-point group. Put the directory on sys.path (or PYTHONPATH for a
server) and Python's entry-point discovery finds it, as it would after `pip install acme-rules`."""

from __future__ import annotations

from pathlib import Path

MODULE = '''
from typing import Literal

import numpy as np
from pydantic import Field

from data_contracts.reward_rules import BaseRewardRule, Verdicts


class ThumbsAndLength(BaseRewardRule):
    """+up / -down per thumbs, less a cost per character shown: a chat team's rule that wants short answers."""

    reads = ("thumbs",)

    plugin: Literal["acme-thumbs"] = "acme-thumbs"
    name: str = "acme-thumbs"
    up: float = Field(1.0, description="Reward of a thumbs up.")
    down: float = Field(-1.0, description="Reward of a thumbs down.")
    per_char: float = Field(0.001, ge=0, description="Cost per character shown.")

    def bounds(self):
        return min(self.down - 10.0, self.ignored), max(self.up, self.ignored)

    def reward_verdicts(self, v: Verdicts):
        base = np.select([v.thumbs > 0, v.thumbs < 0], [self.up, self.down], default=self.ignored)
        return np.maximum(base - self.per_char * v.completion_chars, self.down - 10.0).astype(np.float64)


class Mislabelled(ThumbsAndLength):
    plugin: Literal["acme-other"] = "acme-other"
'''

ENTRY_POINTS = """[tidal.reward_rules]
acme-thumbs = acme_rules:ThumbsAndLength
acme-mislabelled = acme_rules:Mislabelled
acme-missing = acme_rules_gone:Nothing
"""


def write_plugin(root: Path, version: str = "1.2.0") -> Path:
    """acme_rules (module) + acme_rules-<version>.dist-info under root; returns root (the path entry)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "acme_rules.py").write_text(MODULE)
    info = root / f"acme_rules-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: acme-rules\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root
