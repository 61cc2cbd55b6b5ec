"""Write-ahead log of the gateway's log sink: segment files, the group-commit writer, start-up recovery.

Layout: `<wal_dir>/<kind>/<segment_id><suffix>`, one orjson object per line. A segment's state is its
suffix, changed only by atomic renames, so a crash at any point leaves every segment in one state:

    .jsonl            open: the writer appends to it
    .closed.jsonl     closed: complete, waiting for upload
    .uploaded.jsonl   uploaded: in the store; kept retain_s for recovery reads, then deleted

Segment ids `<epoch_ms:013d>-<pid:07d>-<counter:06d>` sort by creation time and are unique across
restarts; the object keys of a segment derive from its id only, which makes re-uploads idempotent.
The directory is owned by one process at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from data_contracts.log_layout import segment_id

log = logging.getLogger("tidal.logsink")

OPEN, CLOSED, UPLOADED = "open", "closed", "uploaded"
SUFFIXES = {OPEN: ".jsonl", CLOSED: ".closed.jsonl", UPLOADED: ".uploaded.jsonl"}
# <opened ms>-<writer>-<counter>; the writer part was the pid (7 digits) before it was a random id per writer
_NAME = re.compile(r"^(\d{13}-(?:[0-9a-f]{12}|\d{7})-\d{6})(\.closed|\.uploaded)?\.jsonl$")


@dataclass(frozen=True)
class Segment:
    kind: str
    id: str
    state: str
    path: Path

    def moved(self, state: str) -> Segment:
        return Segment(self.kind, self.id, state, self.path.with_name(self.id + SUFFIXES[state]))


def list_segments(wal_dir: Path, kind: str, states: tuple[str, ...] = (OPEN, CLOSED, UPLOADED)) -> list[Segment]:
    """Segments of one kind in the given states, oldest first; foreign files are ignored."""
    found = []
    for p in (wal_dir / kind).glob("*.jsonl"):
        m = _NAME.match(p.name)
        if m:
            state = (m.group(2) or ".open")[1:]
            if state in states:
                found.append(Segment(kind, m.group(1), state, p))
    return sorted(found, key=lambda s: s.id)


def read_lines(path: Path) -> tuple[list[bytes], bytes]:
    """(complete lines without their newline, torn tail): a tail with no newline was never fsynced+acked."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    return data[:end].splitlines(), data[end:]


def iter_records(wal_dir: Path, kind: str) -> Iterator[dict]:
    """Records of every local segment, oldest first. Tolerates the writer/uploader renaming or retention
    deleting a segment meanwhile; skips torn tails and lines that do not parse."""
    for seg in list_segments(wal_dir, kind):
        for state in (seg.state, CLOSED, UPLOADED):  # states only move forward
            try:
                lines, _ = read_lines(seg.moved(state).path)
                break
            except FileNotFoundError:
                continue
        else:
            continue  # deleted by retention
        for line in lines:
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                continue


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(wal_dir: Path, kind: str) -> int:
    """Close the open segments a previous process left; returns the torn (unacknowledged) lines dropped."""
    torn = 0
    for seg in list_segments(wal_dir, kind, (OPEN,)):
        lines, tail = read_lines(seg.path)
        if tail:
            torn += 1
            with open(seg.path, "r+b") as f:
                f.truncate(seg.path.stat().st_size - len(tail))
                os.fsync(f.fileno())
            log.warning("WAL segment %s/%s: dropped a torn last line (%d bytes, never acknowledged)", kind, seg.id, len(tail))
        if lines:
            os.rename(seg.path, seg.moved(CLOSED).path)
        else:
            seg.path.unlink()
    return torn


def new_writer_id() -> str:
    """A random id per WAL writer (48 bits). Not the pid: every container's gateway is pid 1, and two gateway
    pods writing the same object keys would overwrite each other's logs."""
    return secrets.token_hex(6)


class SinkStats:
    """Counters and gauges shared by the writer, the uploader and metrics(). One lock, taken a few times
    per commit batch. The cap alarm lives here so every change of the pending bytes re-evaluates it."""

    def __init__(self, kinds: tuple[str, ...], cap_bytes: int, warn_fraction: float = 0.8):
        self._lock = threading.Lock()
        self.cap_bytes, self.warn_bytes = cap_bytes, int(cap_bytes * warn_fraction)
        self.over_cap = self.near_cap = False
        self.values: dict[str, int] = dict.fromkeys(
            [
                "wal_pending_bytes",
                "wal_retained_bytes",
                "segments_pending",
                "commits_total",
                "uploads_total",
                "segments_uploaded_total",
                "upload_errors_total",
                "quarantined_total",
                "torn_lines_total",
                "segments_poisoned_total",
            ]
            + [f"records_appended_total:{k}" for k in kinds],
            0,
        )

    def add(self, deltas: dict[str, int]) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.values[k] += v
            pending = self.values["wal_pending_bytes"]
            was, self.over_cap = self.over_cap, pending > self.cap_bytes
            was_near, self.near_cap = self.near_cap, pending > self.warn_bytes
        if self.near_cap and not was_near and not self.over_cap:
            log.warning(
                "WAL holds %d bytes not yet in the object store, nearing its %d-byte cap: is the store down?",
                pending,
                self.cap_bytes,
            )
        if self.over_cap and not was:
            log.warning(
                "WAL holds %d bytes not yet in the object store, over the %d-byte cap: is the store down? "
                "Appends continue; the disk fills.",
                pending,
                self.cap_bytes,
            )
        elif was and not self.over_cap:
            log.info("WAL back under its cap (%d bytes pending)", pending)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


@dataclass(slots=True)
class _Append:
    kind: str
    line: bytes
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    enqueued: float  # time.monotonic(): the commit interval counts from the oldest waiting append


class _Control:
    """Rotate (close every open segment) or stop; runs after all appends queued before it."""

    def __init__(self, stop: bool):
        self.stop = stop
        self.done = threading.Event()


@dataclass(slots=True)
class _Open:
    seg: Segment
    fd: int
    size: int
    opened: float  # monotonic


def _settle(futures: list[asyncio.Future], exc: BaseException | None) -> None:
    for f in futures:
        if not f.done():  # a cancelled append was still written; nobody waits for it
            if exc is None:
                f.set_result(None)
            else:
                f.set_exception(exc)


class WalWriter:
    """One thread owns the open segments: it drains the queue, writes every pending line of a kind in one
    write, fsyncs once per kind per batch, then wakes each batch's futures with one call per event loop."""

    def __init__(
        self,
        wal_dir: Path,
        kinds: tuple[str, ...],
        stats: SinkStats,
        commit_interval_s: float,
        segment_max_bytes: int,
        segment_max_age_s: float,
    ):
        self.wal_dir, self.kinds, self.stats = wal_dir, kinds, stats
        self.commit_interval_s, self.max_bytes, self.max_age_s = commit_interval_s, segment_max_bytes, segment_max_age_s
        self._q: queue.SimpleQueue[_Append | _Control] = queue.SimpleQueue()
        self._open: dict[str, _Open] = {}
        self._counter, self._writer = 0, new_writer_id()
        self._last_batch = 1  # size of the previous commit batch: how many appenders to wait for
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="logsink-wal", daemon=True)
        self._thread.start()

    def submit(self, kind: str, line: bytes, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        with self._lock:  # nothing may be queued behind the stop item
            if self._thread is None or self._stopped:
                raise RuntimeError("log sink is not running (call start(); not after stop())")
            self._q.put(_Append(kind, line, loop, future, time.monotonic()))

    def rotate(self) -> None:
        """Close every open segment, after the appends queued so far are committed; blocks until done."""
        with self._lock:
            if self._thread is None or self._stopped:
                return
            c = _Control(stop=False)
            self._q.put(c)
        self._wait(c)

    def stop(self) -> None:
        """Commit what is queued, close the open segments, end the thread."""
        with self._lock:
            if self._thread is None or self._stopped:
                self._stopped = True
                return
            self._stopped = True
            c = _Control(stop=True)
            self._q.put(c)
        self._wait(c)
        self._thread.join()

    def _wait(self, c: _Control) -> None:
        while not c.done.wait(0.5):
            if not self._thread.is_alive():
                raise RuntimeError("the WAL writer thread died; see the log")

    # ---- the writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            control, batch = self._next_batch()
            if batch:
                self._commit(batch)
            self._rotate(expired_only=control is None)
            if control is not None:
                control.done.set()
                if control.stop:
                    return

    def _next_batch(self) -> tuple[_Control | None, list[_Append]]:
        """Wait for work (or the next age rotation), then gather appends. Once the queue runs dry the
        batch waits for more only while it is smaller than the previous one (the appenders seen last time
        have not all come back) and its oldest append has waited less than commit_interval_s: a lone
        appender never waits, a crowd shares one fsync. A control item ends the batch."""
        try:
            first = self._q.get(timeout=self._until_next_rotation())
        except queue.Empty:
            return None, []
        if isinstance(first, _Control):
            return first, []
        batch, deadline = [first], first.enqueued + self.commit_interval_s
        try:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    left = deadline - time.monotonic()
                    if len(batch) >= self._last_batch or left <= 0:
                        return None, batch
                    try:
                        item = self._q.get(timeout=left)
                    except queue.Empty:
                        return None, batch
                if isinstance(item, _Control):
                    return item, batch
                batch.append(item)
        finally:
            self._last_batch = len(batch)

    def _until_next_rotation(self) -> float | None:
        if not self._open:
            return None
        oldest = min(o.opened for o in self._open.values())
        return max(0.0, oldest + self.max_age_s - time.monotonic())

    def _commit(self, batch: list[_Append]) -> None:
        by_kind: dict[str, list[bytes]] = {}
        for a in batch:
            by_kind.setdefault(a.kind, []).append(a.line)
        errors: dict[str, BaseException] = {}
        deltas = {"commits_total": 1}
        for kind, lines in by_kind.items():
            try:
                deltas["wal_pending_bytes"] = deltas.get("wal_pending_bytes", 0) + self._write(kind, b"".join(lines))
                deltas[f"records_appended_total:{kind}"] = len(lines)
            except Exception as e:  # disk full, I/O error: these appends fail, later ones get a fresh segment
                log.error("WAL write of %d %s records failed: %s", len(lines), kind, e)
                errors[kind] = e
        self.stats.add(deltas)  # before waking the appenders: metrics() then counts every acknowledged record
        per_loop: dict[asyncio.AbstractEventLoop, dict[BaseException | None, list[asyncio.Future]]] = {}
        for a in batch:
            per_loop.setdefault(a.loop, {}).setdefault(errors.get(a.kind), []).append(a.future)
        for loop, groups in per_loop.items():
            for exc, futures in groups.items():
                try:
                    loop.call_soon_threadsafe(_settle, futures, exc)
                except RuntimeError:  # that loop is closed: nobody is waiting any more
                    pass

    def _write(self, kind: str, data: bytes) -> int:
        o = self._open.get(kind) or self._new_segment(kind)
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(o.fd, view) :]
            os.fsync(o.fd)
        except OSError:
            # Cut the unacknowledged bytes off so no half line precedes later acknowledged ones, and leave
            # this segment: after a failed fsync the kernel may have dropped the pages (it won't re-report).
            try:
                os.ftruncate(o.fd, o.size)
            except OSError:
                pass
            self._close(kind)
            raise
        o.size += len(data)
        if o.size >= self.max_bytes:
            self._close(kind)
        return len(data)

    def _new_segment(self, kind: str) -> _Open:
        kind_dir = self.wal_dir / kind
        while True:  # never reuse a name, whoever made it
            self._counter += 1
            seg_id = segment_id(time.time_ns() // 1_000_000, self._writer, self._counter)
            seg = Segment(kind, seg_id, OPEN, kind_dir / (seg_id + SUFFIXES[OPEN]))
            if any(seg.moved(s).path.exists() for s in (CLOSED, UPLOADED)):
                continue
            try:
                fd = os.open(
                    seg.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600
                )  # raw prompts: owner only
                break
            except FileExistsError:
                continue
        try:
            fsync_dir(kind_dir)  # the file's name must survive a crash as well as its bytes
        except OSError:
            os.close(fd)
            seg.path.unlink()
            raise
        self._open[kind] = o = _Open(seg, fd, 0, time.monotonic())
        return o

    def _close(self, kind: str) -> None:
        o = self._open.pop(kind)
        os.close(o.fd)
        if o.size == 0:
            o.seg.path.unlink()
            return
        # No directory fsync: if the rename is lost in a crash, recovery closes the segment again.
        os.rename(o.seg.path, o.seg.moved(CLOSED).path)
        self.stats.add({"segments_pending": 1})  # the uploader's next pass finds it by its name

    def _rotate(self, expired_only: bool) -> None:
        now = time.monotonic()
        for kind in [k for k, o in self._open.items() if not expired_only or now - o.opened >= self.max_age_s]:
            try:
                self._close(kind)
            except OSError as e:
                log.error("closing WAL segment of %s failed: %s", kind, e)
