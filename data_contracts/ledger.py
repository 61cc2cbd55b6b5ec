"""The fate of every row a collection run owns, so counts reconcile exactly:

    rows in = rows kept + rows quarantined + rows filtered (one reason each)

A quarantined row lists every contract it broke (its reasons); a filtered row was valid but is not
used, for the first of: late_feedback, completion_quarantined, no_feedback, withheld, stale, duplicate.
Files quarantined whole (reason `schema`) count their rows as in and quarantined.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


class ReconciliationError(AssertionError):
    """Counts that do not add up: a row was lost or counted twice (a bug, never bad input)."""


@dataclass
class Ledger:
    kind: str
    rows: int
    quarantined: dict[int, list[str]] = field(default_factory=dict)  # row → reasons
    filtered: np.ndarray = field(default=None)  # (rows,) object: None or the reason
    schema_rows: int = 0  # rows of files quarantined whole

    def __post_init__(self) -> None:
        if self.filtered is None:
            self.filtered = np.full(self.rows, None, dtype=object)

    def quarantine(self, reasons: dict[int, list[str]]) -> None:
        for row, rs in reasons.items():
            self.quarantined[row] = sorted(set(self.quarantined.get(row, [])) | set(rs))

    def waive(self, waived: np.ndarray) -> int:
        """Released rows (data_contracts/release.py): drop the one reason each row's release waives; a row with no
        reason left is live again. waived: (rows,) object, None for rows no release holds. Returns rows let in."""
        let_in = 0
        for row in np.flatnonzero(np.not_equal(waived, None)):
            reasons = self.quarantined.get(int(row))
            if reasons is None:
                continue
            left = [r for r in reasons if r != waived[row]]
            if left:
                self.quarantined[int(row)] = left
            else:
                del self.quarantined[int(row)]
                let_in += 1
        return let_in

    @property
    def quarantine_mask(self) -> np.ndarray:
        mask = np.zeros(self.rows, dtype=bool)
        mask[list(self.quarantined)] = True
        return mask

    @property
    def live(self) -> np.ndarray:
        """(rows,) bool: neither quarantined nor filtered yet."""
        return ~self.quarantine_mask & np.equal(self.filtered, None)

    def filter(self, mask: np.ndarray, reason: str) -> int:
        """Filter the live rows of mask with reason; returns how many."""
        hit = mask & self.live
        self.filtered[hit] = reason
        return int(hit.sum())

    def counts(self) -> dict:
        filtered = Counter(r for r in self.filtered.tolist() if r is not None)
        by_reason = Counter(r for rs in self.quarantined.values() for r in rs)
        if self.schema_rows:
            by_reason["schema"] += self.schema_rows
        q_rows = len(self.quarantined) + self.schema_rows
        total_in = self.rows + self.schema_rows
        kept = int(self.live.sum())
        counts = {
            "in": total_in,
            "kept": kept,
            "quarantined": q_rows,
            "quarantined_by_reason": dict(sorted(by_reason.items())),
            "filtered": sum(filtered.values()),
            "filtered_by_reason": dict(sorted(filtered.items())),
        }
        if total_in != kept + q_rows + counts["filtered"]:
            raise ReconciliationError(
                f"{self.kind}: rows in {total_in} != kept {kept} + quarantined {q_rows} + filtered "
                f"{counts['filtered']} ({counts})"
            )
        return counts
