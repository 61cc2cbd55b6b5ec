"""Reward rules as plugins: the interface a rule implements, the verdicts it reads, and how a rule is found.

A rule is a named, versioned pydantic class (its fields are its constants) that turns each completion's verdicts
into one scalar reward. Rules are found through the Python entry-point group `tidal.reward_rules`: the entry's name
is the rule's `plugin`, its value the class (`package.module:Class`), so a team ships a rule as a package of its own
and selects it in the settings (`collect.reward_rules.<model>.plugin`) without touching Tidal. The built-in rules
are registered the same way, in Tidal's own pyproject.toml.

A dataset records the rule's id (name@version), its plugin and the package (and version) that provided it, and
the rule's JSON, so every reward can be recomputed by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib.metadata import entry_points
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, ValidationError

from tidal.section import Section

GROUP = "tidal.reward_rules"
NoFeedback = Literal["drop", "ignored"]
ALL_GROUPS = ("verdict", "score", "thumbs", "edit", "judge")


class RuleError(ValueError):
    """A rule that cannot be found or built: names what was asked and what is installed."""


@dataclass
class Verdicts:
    """What users said about N completions, one row each (a group absent from a row: that event never came).

    event: (N,) object, the Tab verdict (accepted | rejected | partial) or 'none';
    accepted_chars: (N,) float, characters kept by the Tab verdict, NaN when it gave none;
    completion_chars: (N,) float, len(completion_text) (0: nothing was shown);
    score: (N,) float in [0, 1], the score rescaled from the model's score_range, NaN when none;
    thumbs: (N,) float, +1 up, -1 down, 0 none;
    edit_text: (N,) object, the text the user finally kept, None when none;
    completion_text: (N,) object, what was shown (for rules that compare an edit with it);
    judge_score: (N,) float in [0, 1], the model's judge's score rescaled like `score`, NaN when none (group 'judge')."""

    event: np.ndarray
    accepted_chars: np.ndarray
    completion_chars: np.ndarray
    score: np.ndarray
    thumbs: np.ndarray
    edit_text: np.ndarray
    completion_text: np.ndarray
    judge_score: np.ndarray | None = None  # None: (N,) NaN, set in __post_init__

    def __post_init__(self) -> None:
        if self.judge_score is None:
            self.judge_score = np.full(len(self.event), np.nan)

    @classmethod
    def tab(cls, event, accepted_chars, completion_chars, completion_text=None) -> Verdicts:
        """Tab verdicts alone (no score, thumbs or edit)."""
        event = np.asarray(event, dtype=object)
        n = len(event)
        texts = np.full(n, None, dtype=object) if completion_text is None else np.asarray(completion_text, dtype=object)
        return cls(
            event,
            np.asarray(accepted_chars, dtype=np.float64),
            np.asarray(completion_chars, dtype=np.float64),
            np.full(n, np.nan),
            np.zeros(n),
            np.full(n, None, dtype=object),
            texts,
        )

    def __len__(self) -> int:
        return len(self.event)

    def take(self, rows: np.ndarray) -> Verdicts:
        """The verdicts of some rows (indices or a mask)."""
        return Verdicts(*(getattr(self, f.name)[rows] for f in fields(self)))

    def present(self, group: str) -> np.ndarray:
        """(N,) bool: the rows with an event of `group` (verdict, score, thumbs or edit)."""
        if group == "verdict":
            return self.event != "none"
        if group == "score":
            return ~np.isnan(self.score)
        if group == "thumbs":
            return self.thumbs != 0
        if group == "edit":
            return np.not_equal(self.edit_text, None)
        if group == "judge":
            return ~np.isnan(self.judge_score)
        raise ValueError(f"unknown feedback group {group!r}; expected one of {ALL_GROUPS}")


class BaseRewardRule(Section):
    """The interface: subclass it, give `plugin` a Literal default equal to the entry point's name, implement
    `reward_verdicts` and `bounds`, and declare in `reads` the feedback groups the rule uses."""

    reads: ClassVar[tuple[str, ...]] = ALL_GROUPS  # the feedback groups whose presence makes a row rewarded

    plugin: str = Field(description="The rule's entry point in `tidal.reward_rules` (which class computes it).")
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,62}$", description="Rule family name (datasets record name@version).")
    version: int = Field(1, ge=1, description="Bumped on any change; datasets record name@version and the rule's JSON.")
    no_feedback: NoFeedback = Field(
        "drop",
        description=(
            "A shown completion with no event the rule reads within the collection's feedback_timeout_s: 'drop' leaves "
            "it out of the dataset (counted as no_feedback), 'ignored' keeps it with reward `ignored`. Empty "
            "completions are always kept: nothing was shown, so no verdict was possible."
        ),
    )
    ignored: float = Field(0.0, description="Reward of a shown completion without feedback when no_feedback='ignored'.")
    turn_discount: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Credit to earlier turns of a conversation: a turn without an event the rule reads takes the reward of the "
            "nearest later turn with one (in the same collection) x turn_discount per turn between them. 0 = none: "
            "each turn is rewarded by its own feedback alone."
        ),
    )

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    def bounds(self) -> tuple[float, float]:
        """Smallest and largest reward the rule can give (the contract checks every reward lies between)."""
        raise NotImplementedError

    def reward_verdicts(self, v: Verdicts) -> np.ndarray:
        """(N,) float64 rewards of N completions' verdicts; rows without any event the rule reads get `ignored`."""
        raise NotImplementedError

    def rewarded(self, v: Verdicts) -> np.ndarray:
        """(N,) bool: the rows with an event the rule reads (the others count as no feedback)."""
        out = np.zeros(len(v), dtype=bool)
        for group in self.reads:
            out |= v.present(group)
        return out

    def rewards(self, event: np.ndarray, accepted_chars: np.ndarray, completion_chars: np.ndarray) -> np.ndarray:
        """Rewards of Tab verdicts alone (the gateway's metrics and the canary read these)."""
        return self.reward_verdicts(Verdicts.tab(event, accepted_chars, completion_chars))

    def reward_of(self, event: str, accepted_chars: int | None, completion_chars: int) -> float:
        """One Tab verdict's reward from the completion's length alone (what the gateway holds at feedback time)."""
        chars = np.array([np.nan if accepted_chars is None else accepted_chars], dtype=np.float64)
        return float(self.rewards(np.array([event], dtype=object), chars, np.array([completion_chars]))[0])

    def package(self) -> str:
        """'<distribution> <version>' that installed this rule's plugin, or '' when it is not installed as one."""
        ep = installed_rules().get(self.plugin)
        dist = getattr(ep, "dist", None)
        return f"{dist.name} {dist.version}" if dist is not None else ""


def installed_rules() -> dict[str, Any]:
    """plugin name → its entry point, of every package installed in this environment. Two packages registering one
    name for different classes is refused: which one computed a dataset's rewards would depend on the path order."""
    found: dict[str, Any] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            raise RuleError(
                f"reward rule plugin {ep.name!r} is registered twice: {found[ep.name].value} and {ep.value}; "
                "uninstall one of the packages"
            )
        found[ep.name] = ep
    return found


def rule_class(plugin: str) -> type[BaseRewardRule]:
    eps = installed_rules()
    if plugin not in eps:
        raise RuleError(
            f"reward rule plugin {plugin!r} is not installed: the entry-point group '{GROUP}' offers {sorted(eps)}; "
            "install the package that provides it, or fix the rule's `plugin`"
        )
    try:
        cls = eps[plugin].load()
    except Exception as e:  # an import error in a team's package: say which entry point
        raise RuleError(f"reward rule plugin {plugin!r} ({eps[plugin].value}) failed to load: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, BaseRewardRule)):
        raise RuleError(f"reward rule plugin {plugin!r} ({eps[plugin].value}) is not a BaseRewardRule subclass")
    if cls.model_fields["plugin"].default != plugin:
        raise RuleError(
            f"reward rule plugin {plugin!r} loads {cls.__name__}, whose `plugin` default is "
            f"{cls.model_fields['plugin'].default!r}: they must be equal"
        )
    return cls


def build_rule(spec: Any, default_plugin: str = "cursor-tab") -> BaseRewardRule:
    """A rule from its settings or stored JSON ({"plugin": ..., its fields}; no plugin: `default_plugin`)."""
    if isinstance(spec, BaseRewardRule):
        return spec
    if not isinstance(spec, dict):
        raise RuleError(f"a reward rule is a mapping with a 'plugin' and the rule's fields, not {type(spec).__name__}")
    plugin = spec.get("plugin") or default_plugin
    cls = rule_class(plugin)
    try:
        return cls.model_validate({**spec, "plugin": plugin})
    except ValidationError as e:
        first = e.errors()[0]
        raise RuleError(f"reward rule plugin {plugin!r}: {first['msg']} at {first['loc']}") from None
