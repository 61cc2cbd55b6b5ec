"""Wall-clock time as the platform's records hold it: Unix epoch milliseconds."""

from __future__ import annotations

import time


def now_ms() -> int:
    return time.time_ns() // 1_000_000  # exact: no float rounding of the nanoseconds
