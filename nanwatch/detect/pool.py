"""Detection in worker processes, for a catch-up scan of many big files.

The rule packs cost ~10 us per iteration line in Python, so a scan of weeks of 8-rank logs is
CPU-bound there, and the files are independent streams. The writer process keeps everything
that must stay in one place (reading and identity checks, offsets, the SQLite transaction);
forked workers, which share the compiled rules, only run ``Detector.feed`` on the chunks they
are sent.

A stream is pinned to one worker, which keeps its StreamState between chunks. Results come
back to the caller in exactly the serial order (stream after stream, chunk after chunk), so
a parallel scan commits the same rows in the same order as a serial one; workers run ahead
on the next streams, with a bound on how much finished work may wait for its turn. A
``final`` chunk (an unterminated last line, scan only) is processed on a copy of the state
and never advances it, as in the serial path.
"""

from __future__ import annotations

import copy
import mmap
import multiprocessing
import os
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import astuple, field
from multiprocessing.connection import Connection, wait
from typing import Any

from .._dc import dataclass
from ..events import Event
from ..stream import StreamState
from .core import zip_rows
from .engine import Detector

DEPTH = 3  # chunks in flight per worker: one being processed, two queued (the writer may be
# busy committing for a while)
AHEAD_BYTES = 16 << 20  # finished chunks (their bytes) that may wait for an earlier stream


# (chunk without its bytes, its size, its newline count, events, metrics (tuples in Metric's
# field order, or what the pool's ``pack`` made of their columns), state after it, run facts
# its lines told)
Done = tuple[Any, int, int, list[Event], Any, StreamState, list[dict[str, Any]]]
# a chunk's metric columns (Metric's field order) -> what the writer stores (None: no rows)
Pack = Callable[[tuple[list[Any], ...]], Any]


def usable_workers() -> int:
    """How many worker processes a scan may start (0: detect in this process).

    ``$NANWATCH_SCAN_WORKERS`` sets it (0 or 1 turns the pool off); by default one per CPU
    this process may run on. Forking is only safe while this process has no other thread.
    """
    raw = os.environ.get("NANWATCH_SCAN_WORKERS", "").strip()
    try:
        n = int(raw) if raw else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        n = os.cpu_count() or 1
    if n < 2 or threading.active_count() > 1:
        return 0
    if "fork" not in multiprocessing.get_all_start_methods():
        return 0
    return n


def _rows(cols: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Metric rows (plain tuples) back from their columns; the compiled core's zip when built."""
    if not cols:
        return []
    fast = zip_rows()
    got = fast(tuple, tuple(cols)) if fast is not None else None
    return got if got is not None else list(zip(*cols))


def _serve(
    conn: Connection, detector: Detector, shared: mmap.mmap, slot_size: int, pack: Pack | None
) -> None:
    states: dict[int, StreamState] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        sid, slot, size, start, state, file, final = msg
        data = shared[slot * slot_size : slot * slot_size + size]
        if state is not None:
            states[sid] = state
        st = states[sid]
        work = copy.copy(st) if final else st
        facts: list[dict[str, Any]] = []
        try:
            if pack is not None:
                # the block is made here, in parallel with the other workers: the writer
                # stores its bytes
                events, columns = detector.feed_columns(data, start, work, file, facts=facts)
                out: Any = pack(columns)
            else:
                events, metrics = detector.feed(data, start, work, file, facts=facts)
                # metric rows go as columns (one tuple per field): a tuple per row cost more
                # to unpickle than to detect
                out = list(zip(*metrics))
        except BaseException:
            conn.send(("error", sid, traceback.format_exc()))
            return
        # plain tuples pickle (and unpickle) in a fraction of a dataclass's time
        conn.send((sid, [astuple(e) for e in events], out, work, facts))


def _run(
    conn: Connection, detector: Detector, shared: mmap.mmap, slot_size: int, pack: Pack | None
) -> None:
    try:
        _serve(conn, detector, shared, slot_size, pack)
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    finally:
        conn.close()


@dataclass
class _Stream:
    chunks: Iterator[Any]
    worker: int
    index: int
    sids: dict[int, int] = field(default_factory=dict)  # id(record) -> stream id
    # (chunk, bytes, lines, slot) of the chunks in flight
    sent: deque[tuple[Any, int, int, int]] = field(default_factory=deque)
    submitted: int = 0  # chunks sent and not yet yielded
    exhausted: bool = False
    done: deque[Done] = field(default_factory=deque)


class DetectorPool:
    """Workers forked from this process; use as a context manager (stopped and joined)."""

    def __init__(
        self,
        detector: Detector,
        workers: int,
        *,
        slot_size: int = 4 << 20,
        pack: Pack | None = None,
    ) -> None:
        """``pack``: what a worker makes of a chunk's metric columns for the writer (without
        it, the metrics come back as rows)."""
        ctx = multiprocessing.get_context("fork")
        self._pack = pack
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        # Chunk bytes go through memory shared with the workers (mapped before the fork), one
        # slot per chunk in flight; the pipes carry only small messages. A 4 MB chunk sent
        # through a pipe would deadlock: the writer blocks in send while the worker blocks
        # sending back its previous result.
        self._slot_size = slot_size
        self._shared = mmap.mmap(-1, slot_size * DEPTH * workers)
        self._free = [list(range(w * DEPTH, (w + 1) * DEPTH)) for w in range(workers)]
        try:
            for i in range(workers):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(
                    target=_run,
                    args=(theirs, detector, self._shared, slot_size, pack),
                    name=f"nanwatch-detect-{i}",
                    daemon=True,
                )
                p.start()
                theirs.close()
                self._conns.append(mine)
                self._procs.append(p)
        except BaseException:
            self.close()
            raise
        self._next_sid = 0

    def __enter__(self) -> DetectorPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ordered(self, streams: Iterable[Iterator[Any]]) -> Iterator[tuple[int, Done]]:
        """(stream index, what a chunk gave) for every chunk of every stream, in the order a
        serial loop would produce them.

        Chunks are the tailer's (``record``, ``data``, ``start``, ``final``); each result
        carries a copy of its chunk without the bytes (freed as soon as they are sent), their
        size and newline count, the events, the metrics and the stream state after it.
        """
        todo = iter(streams)
        n = len(self._conns)
        working: list[_Stream | None] = [None] * n  # the stream each worker is given chunks of
        inflight = [0] * n
        owner: list[deque[_Stream]] = [deque() for _ in range(n)]  # per worker, chunk order
        order: deque[_Stream] = deque()  # streams in the caller's order, not yet all yielded
        waiting = 0  # bytes of finished chunks waiting for an earlier stream
        more = True
        index = 0
        while True:
            # keep the workers' pipes fed: a worker whose stream has no more chunks takes the
            # next stream at once (a small file is one chunk: the worker must not wait for the
            # caller's next turn, which may be a long commit), unless finished work is piling
            # up (then only the first stream in order is fed)
            for w in range(n):
                while inflight[w] < DEPTH:
                    s = working[w]
                    if s is None:
                        if not more or waiting >= AHEAD_BYTES:
                            break
                        nxt = next(todo, None)
                        if nxt is None:
                            more = False
                            break
                        s = working[w] = _Stream(nxt, w, index)
                        index += 1
                        order.append(s)
                    if waiting >= AHEAD_BYTES and s is not order[0]:
                        break
                    chunk = next(s.chunks, None)
                    if chunk is None:
                        s.exhausted = True
                        working[w] = None
                        continue
                    self._send(s, chunk)
                    inflight[w] += 1
                    owner[w].append(s)
            # hand out what is next in order
            progressed = False
            while order and (order[0].done or (order[0].exhausted and not order[0].submitted)):
                head = order[0]
                if head.done:
                    r = head.done.popleft()
                    waiting -= r[1]
                    head.submitted -= 1
                    progressed = True
                    yield head.index, r
                if head.exhausted and not head.submitted:
                    order.popleft()
            if not order and not more and not any(inflight):
                return
            if progressed or not any(inflight):
                continue
            for conn in wait([self._conns[w] for w in range(n) if inflight[w]]):
                w = self._conns.index(conn)  # type: ignore[arg-type]
                s = owner[w].popleft()
                inflight[w] -= 1
                r = self._receive(w, s)
                s.done.append(r)
                waiting += r[1]

    def _send(self, s: _Stream, chunk: Any) -> None:
        rec = chunk.record
        sid = s.sids.get(id(rec))
        state: StreamState | None = None
        if sid is None:
            # a new record (a stream's next generation after a truncation, too): its state
            sid = s.sids[id(rec)] = self._next_sid
            self._next_sid += 1
            state = copy.copy(rec.state)
        data: bytes = chunk.data
        if len(data) > self._slot_size:
            raise ValueError(f"chunk of {len(data)} bytes > the pool's {self._slot_size}")
        slot = self._free[s.worker].pop()
        at = slot * self._slot_size
        self._shared[at : at + len(data)] = data
        msg = (sid, slot, len(data), chunk.start, state, rec.path, chunk.final)
        self._conns[s.worker].send(msg)
        light = copy.copy(chunk)
        light.data = b""
        s.sent.append((light, len(data), data.count(b"\n"), slot))
        s.submitted += 1

    def _receive(self, w: int, s: _Stream) -> Done:
        try:
            msg = self._conns[w].recv()
        except EOFError:
            raise RuntimeError(f"detection worker {w} died") from None
        if msg[0] == "error":
            raise RuntimeError(f"detection failed in a worker:\n{msg[2]}")
        _, events, out, state, facts = msg
        metrics = out if self._pack is not None else _rows(out)
        chunk, size, lines, slot = s.sent.popleft()
        self._free[w].append(slot)
        return (
            chunk,
            size,
            lines,
            [Event(*e) for e in events],
            # tuples in Metric's field order, or the packed block (an empty list: no rows)
            metrics if metrics is not None else [],
            state,
            facts,
        )

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._procs = []
        if not self._shared.closed:
            self._shared.close()
