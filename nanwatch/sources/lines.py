"""Complete lines only: a record's new bytes read from its descriptor, in chunks.

Each chunk carries the offset to commit once its lines are processed and the checksums that
identify the file at that offset (``records``). A line without its newline yet waits (a scan
gives it for processing only, never committed); an over-long line is cut and counted; NUL bytes
a writer left after copytruncate are skipped, never read as lines.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator

from .records import HEAD, TAIL, Chunk, SourceRecord, digest

log = logging.getLogger("nanwatch.sources")


def read_lines(
    rec: SourceRecord,
    fd: int,
    *,
    final: bool,
    read_chunk: int,
    max_line: int,
    counters: dict[str, int],
) -> Iterator[Chunk]:
    """Chunks of complete new lines from ``rec``'s offset; ``final`` also gives an unterminated
    last line (for processing only: its chunk does not move the offset)."""
    offset = rec.offset
    cutting = rec.cutting
    head_hash, head_len = rec.head_hash, rec.head_len
    while True:
        try:
            data = os.pread(fd, read_chunk, offset)
        except OSError as e:
            log.warning("%s: read failed (%s); will retry", rec.path, e.strerror)
            return
        if not data:
            return
        if not cutting and data[:1] == b"\0":
            # a hole: a writer without O_APPEND goes on at its old offset after
            # copytruncate, and the bytes before it read back as NULs; they are no line
            skip = _hole(fd, offset, data, read_chunk)
            if skip is None:
                return  # NULs up to the end: maybe bytes still being written, wait
            offset += skip
            yield _chunk(rec, b"", offset - skip, offset, head_hash, head_len, False)
            continue
        start = offset
        skipped = 0
        if cutting:
            nl = data.find(b"\n")
            if nl < 0:
                offset += len(data)
                yield _chunk(rec, b"", start, offset, head_hash, head_len, True)
                if len(data) < read_chunk:
                    return
                continue
            skipped = nl + 1
            cutting = False
        body = data[skipped:]
        last = body.rfind(b"\n")
        cut = 0
        if last < 0:
            if len(body) >= max_line:
                # over-long line: keep its first max_line bytes as a line, skip the rest
                counters["lines_cut"] += 1
                rec.lines_cut += 1
                log.warning(
                    "%s: line at byte %d longer than %d bytes; cut",
                    rec.path,
                    start + skipped,
                    max_line,
                )
                line = body[:max_line] + b"\n"
                offset = start + len(data)
                if head_len < HEAD:
                    head_hash, head_len = _head(fd)
                yield _chunk(rec, line, start + skipped, offset, head_hash, head_len, True, 1)
                cutting = True
                continue
            if final and body:
                yield Chunk(
                    rec,
                    body + b"\n",
                    start + skipped,
                    start + skipped,
                    None,
                    head_hash,
                    head_len,
                    cutting,
                    0,
                    True,
                )
            if skipped:
                offset = start + skipped
                yield _chunk(rec, b"", start, offset, head_hash, head_len, False)
            return
        lines = body[: last + 1]
        offset = start + skipped + last + 1
        if head_len < HEAD:
            head_hash, head_len = _head(fd)
        yield _chunk(rec, lines, start + skipped, offset, head_hash, head_len, False, cut)
        if len(data) < read_chunk and final and last + 1 < len(body):
            rest = body[last + 1 :]
            yield Chunk(
                rec, rest + b"\n", offset, offset, None, head_hash, head_len, False, 0, True
            )
            return


def _hole(fd: int, offset: int, data: bytes, read_chunk: int) -> int | None:
    """How many NUL bytes to skip at ``offset`` (``data`` read there): the run up to the
    next byte of text, or None when nothing but NULs follows yet."""
    run = len(data) - len(data.lstrip(b"\0"))
    if run < len(data):
        return run
    if len(data) < read_chunk:
        return None
    try:
        # a sparse hole is skipped whole; a run of written zeros, a chunk at a time
        after = os.lseek(fd, offset + run, os.SEEK_DATA)
    except OSError as e:
        # ENXIO: only a hole follows (the writer's bytes are still to come)
        return None if e.errno == errno.ENXIO else run
    return max(run, after - offset)


def _head(fd: int) -> tuple[str | None, int]:
    try:
        head = os.pread(fd, HEAD, 0)
    except OSError:
        return None, 0
    return digest(head), len(head)


def _chunk(
    rec: SourceRecord,
    data: bytes,
    start: int,
    end: int,
    head_hash: str | None,
    head_len: int,
    cutting: bool,
    cut: int = 0,
) -> Chunk:
    tail_hash = None
    if end > 0 and rec.fd is not None:
        lo = max(0, end - TAIL)
        try:
            tail_hash = digest(os.pread(rec.fd, end - lo, lo))
        except OSError:
            tail_hash = None
    return Chunk(rec, data, start, end, tail_hash, head_hash, head_len, cutting, cut)
