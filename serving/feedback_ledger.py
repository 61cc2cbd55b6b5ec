"""The request ids that already have a verdict, for as long as a duplicate could still be accepted.

Feedback is refused once its completion is older than the feedback window, so an id needs remembering only
until then; the ledger keeps each id one window past the time its verdict arrived (never earlier than its
completion), in arrival order, so expiring the oldest ids costs O(1) amortised per verdict. Memory is one
window of ids (about 200 bytes each, measured by bench/feedback_ledger.py), however long the gateway runs.

Across restarts the gateway refills the ledger from the feedback its WAL retains, which the log sink keeps
for at least the feedback window (serving/logsink.py, `retain_s`, checked at start-up).
"""

from __future__ import annotations

from collections import deque


class FeedbackLedger:
    def __init__(self, window_ms: int):
        if window_ms <= 0:
            raise ValueError(f"window_ms must be > 0, not {window_ms}")
        self.window_ms = window_ms
        self._seen: dict[str, int] = {}  # request id → time its verdict arrived (ms)
        self._order: deque[tuple[int, str]] = deque()  # (arrival ms, request id), oldest first

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seen

    def claim(self, request_id: str, now_ms: int) -> bool:
        """Record a verdict for request_id; False if it already has one (a duplicate)."""
        self.expire(now_ms)
        if request_id in self._seen:
            return False
        self._seen[request_id] = now_ms
        self._order.append((now_ms, request_id))
        return True

    def release(self, request_id: str) -> None:
        """Forget a claim whose verdict could not be stored (its entry in the order is skipped on expiry)."""
        self._seen.pop(request_id, None)

    def expire(self, now_ms: int) -> None:
        cutoff = now_ms - self.window_ms
        while self._order and self._order[0][0] < cutoff:
            t, rid = self._order.popleft()
            if self._seen.get(rid) == t:  # not released and claimed again since
                del self._seen[rid]


class CompletionLengths:
    """Request id → characters suggested, for one feedback window: a verdict `accepted` carries no character count
    (the client kept the whole suggestion), so the gateway's accepted-characters metric reads it here.

    Same expiry as FeedbackLedger (by completion time, in arrival order); refilled from the WAL's completions at
    start. An id absent here (another gateway process served it, or it expired) counts as unknown characters.
    """

    def __init__(self, window_ms: int):
        if window_ms <= 0:
            raise ValueError(f"window_ms must be > 0, not {window_ms}")
        self.window_ms = window_ms
        self._chars: dict[str, int] = {}
        self._order: deque[tuple[int, str]] = deque()  # (completion ms, request id), oldest first

    def __len__(self) -> int:
        return len(self._chars)

    def add(self, request_id: str, chars: int, time_ms: int) -> None:
        self.expire(time_ms)
        self._chars[request_id] = chars
        self._order.append((time_ms, request_id))

    def pop(self, request_id: str) -> int | None:
        """The suggestion's length, forgotten once read (one verdict per completion)."""
        return self._chars.pop(request_id, None)

    def expire(self, now_ms: int) -> None:
        cutoff = now_ms - self.window_ms
        while self._order and self._order[0][0] < cutoff:
            self._chars.pop(self._order.popleft()[1], None)
