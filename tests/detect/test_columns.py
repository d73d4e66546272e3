"""The column reader (detect/columns.py) gives what the line engine gives, to the byte: the same
events, the same metric rows, the same stream state, on every fixture and on the benchmark's
inputs, in whole files and in small chunks; and the literal prefilter's backends agree."""

from __future__ import annotations

import json
import math
import os
import random
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.detect.prefilter import Prefilter
from nanwatch.query import iter_events
from nanwatch.store import Store

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.inputs import mmengine_logs, plogs  # noqa: E402

FIXTURES = Path(__file__).parent.parent / "fixtures"
RULES = load_rules()


def _text_files(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "expected.json" and b"\0" not in p.read_bytes()[:4096]:
            out.append(p)
    return out


def _same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN (a NaN loss is the same value on both paths)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _chunks(data: bytes, size: int) -> Iterator[tuple[int, bytes]]:
    off = 0
    while off < len(data):
        end = data.rfind(b"\n", off, off + size) + 1 if off + size < len(data) else len(data)
        if end <= off:
            end = data.find(b"\n", off + size)
            end = len(data) if end < 0 else end + 1
        yield off, data[off:end]
        off = end


def _run(det: Detector, path: Path, size: int, as_columns: bool = False) -> list[Any]:
    """Per chunk: events, metric rows (as tuples), facts, state after it. ``as_columns``:
    through ``feed_columns``, its columns turned into rows here."""
    data = path.read_bytes()
    state = StreamState()
    out: list[Any] = []
    for off, chunk in _chunks(data, size):
        facts: list[dict[str, Any]] = []
        if as_columns:
            events, cols = det.feed_columns(chunk, off, state, str(path), facts=facts)
            assert len(cols) == 13 and len({len(c) for c in cols}) == 1
            rows = list(zip(*cols))
        else:
            events, metrics = det.feed(chunk, off, state, str(path), facts=facts)
            rows = [tuple(m) for m in metrics]
        out.append((events, rows, facts, state.to_json()))
    return out


def _compare(path: Path, sizes: tuple[int, ...] = (1 << 30, 4096)) -> Detector:
    cols = Detector(RULES, columns=True, default_year=2026)
    for size in sizes:
        ref = _run(Detector(RULES, columns=False, default_year=2026), path, size)
        got = _run(cols, path, size)
        # the columns a worker packs: the same rows, in the same order
        as_cols = _run(Detector(RULES, columns=True, default_year=2026), path, size, True)
        assert len(ref) == len(got) == len(as_cols)
        for i, (a, b) in enumerate([*zip(ref, got), *zip(got, as_cols)]):
            assert _same(a[0], b[0]), f"{path} chunk {i} (size {size}): events differ"
            assert _same(a[1], b[1]), f"{path} chunk {i} (size {size}): metrics differ"
            assert a[2] == b[2], f"{path} chunk {i}: facts differ"
            assert a[3] == b[3], f"{path} chunk {i}: stream state differs"
    return cols


FIXTURE_FILES = _text_files(FIXTURES)


@pytest.mark.parametrize(
    "path", FIXTURE_FILES, ids=[str(p.relative_to(FIXTURES)) for p in FIXTURE_FILES]
)
def test_fixture_same_both_ways(path: Path) -> None:
    _compare(path)


@pytest.fixture(scope="module")
def bench_logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bench")
    return {
        "long": mmengine_logs(root / "long", 1.5),
        "short": mmengine_logs(root / "short", 1.0, short=True),
        "plog": plogs(root / "plog", 0.3)[0],
    }


@pytest.mark.parametrize("variant", ["long", "short"])
def test_bench_inputs_same_both_ways_and_read_as_columns(
    bench_logs: dict[str, Any], variant: str
) -> None:
    logs = bench_logs[variant]
    rows = 0
    for f in logs.files:
        det = _compare(f, (1 << 30, 64 << 10, 3000))
        rows += det.counters["column_rows"]
    # nearly every iteration line is read as a column row (NaN lines go to the line engine)
    assert rows > 0.9 * logs.iteration_lines * 3


def test_plogs_same_both_ways(bench_logs: dict[str, Any]) -> None:
    for f in bench_logs["plog"][:2]:
        _compare(f)


HEAD = "2026/11/30 10:00:{s:02d} - mmengine - INFO - "
ROW = (
    "Epoch(train)  [{e}][{i:>2}/20]  lr: 1.0000e-04  eta: 0:00:10  time: 0.8612  "
    "data_time: 0.0123  memory: 21034  grad_norm: {g}  loss: {loss}  loss_cls: 0.5"
)
ITER = (
    "Iter(train) [{k:>5}/90000]  base_lr: 1.0000e-04 lr: 1.0000e-04  eta: 1 day, 2:03:04  "
    "time: 0.8612  data_time: 0.0123  memory: 21034  loss: 2.3055"
)


def _rows(n: int, *, e: int = 1, start: int = 1, **kw: Any) -> list[str]:
    out = []
    for k in range(n):
        i = start + k
        out.append(
            HEAD.format(s=i % 60)
            + ROW.format(e=e, i=i, g=kw.get("g", "12.5"), loss=kw.get("loss", "1.25"))
        )
    return out


EDGE_CASES = {
    "plain": _rows(30),
    "nan_rows_in_between": [
        *_rows(8),
        *_rows(3, start=9, g="nan", loss="nan"),
        *_rows(5, start=12),
    ],
    "epoch_zero": _rows(10, e=0),
    "val_then_train": [
        *_rows(5),
        HEAD.format(s=7)
        + "Epoch(val)  [1][ 5/50]    eta: 0:00:00  time: 0.1484  data_time: 0.0018  memory: 8887",
        HEAD.format(s=8)
        + "Epoch(val) [1][10/50]    eta: 0:00:00  time: 0.1484  data_time: 0.0018  memory: 8887",
        *_rows(5, start=6),
    ],
    "iter_based": [HEAD.format(s=k) + ITER.format(k=k) for k in range(1, 20)],
    "year_less_head": [
        f"11/30 10:00:{k:02d} - mmengine - INFO - " + ROW.format(e=1, i=k, g="3.0", loss="1.0")
        for k in range(1, 15)
    ],
    "traceback_between": [
        *_rows(5),
        "Traceback (most recent call last):",
        '  File "tools/train.py", line 121, in <module>',
        "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB",
        *_rows(5, start=6),
    ],
    "prefixed_rows_fall_back": [f"[rank3]:{x}" for x in _rows(10)],
    "a_row_among_prefixed_fall_back": [
        *_rows(3),
        f"[rank1]:{_rows(1, start=4)[0]}",
        *_rows(3, start=5),
    ],
    "second_marker_on_a_line": [
        *_rows(3),
        _rows(1, start=4)[0] + "  note: Epoch(train) again",
        *_rows(2, start=5),
    ],
    "epoch_word_on_a_row": [
        *_rows(3),
        _rows(1, start=4)[0] + "  epoch: 4 step: 9",
        *_rows(2, start=5),
    ],
    "invalid_second": [
        HEAD.format(s=0).replace(":00 -", ":61 -") + ROW.format(e=1, i=1, g="1", loss="1"),
        *_rows(3, start=2),
    ],
    "crlf": [x + "\r" for x in _rows(6)],
    "odd_values": [
        *_rows(2),
        HEAD.format(s=3) + ROW.format(e=1, i=3, g="1.5,", loss="2|"),
        *_rows(2, start=4),
    ],
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_edge_case_same_both_ways(case: str, tmp_path: Path) -> None:
    path = tmp_path / "rank0.log"
    path.write_text("\n".join(EDGE_CASES[case]) + "\n")
    _compare(path, (1 << 30, 700, 300))


def test_rows_that_are_not_every_line_of_the_format_go_to_the_line_engine(tmp_path: Path) -> None:
    path = tmp_path / "rank0.log"
    path.write_text("\n".join(EDGE_CASES["prefixed_rows_fall_back"]) + "\n")
    det = _compare(path, (1 << 30,))
    assert det.counters["column_fallbacks"] == 1
    assert det.counters["column_rows"] == 0


def _metric_rows(db: Path) -> list[tuple[Any, ...]]:
    """Every stored iteration as (source, Metric fields...), through the store's block reader
    where metrics are stored as blocks, else the metrics table."""
    try:
        from nanwatch.store.metrics import Metrics  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        conn = sqlite3.connect(db)
        try:
            return conn.execute(
                "SELECT source_id, offset, rank, step, epoch, iter, stage, time, loss, grad_norm, "
                "step_time, data_time, lr, memory FROM metrics ORDER BY source_id, offset"
            ).fetchall()
        finally:
            conn.close()
    store = Store.open(db)
    try:
        rows = [(b.source_id, *m) for b in Metrics(store).blocks_after(0) for m in b.columns.rows()]
    finally:
        store.close()
    return sorted(rows, key=lambda r: (r[0], r[1]))


def _db_rows(db: Path) -> dict[str, Any]:
    store = Store.open(db)
    try:
        events = [
            {k: v for k, v in e.items() if k not in ("id", "ingested_at")}
            for e in iter_events(store)
        ]
    finally:
        store.close()
    metrics = _metric_rows(db)
    conn = sqlite3.connect(db)
    try:
        sources = conn.execute("SELECT path, offset, ctx FROM sources ORDER BY path").fetchall()
    finally:
        conn.close()
    return {"events": events, "metrics": metrics, "sources": sources}


def test_a_scan_stores_the_same_both_ways(
    bench_logs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("NANWATCH_COLUMNS", mode)
        db = tmp_path / f"{mode}.db"
        store = Store.open(db)
        try:
            Pipeline(Config(), store, [str(bench_logs["long"].root)]).scan()
        finally:
            store.close()
        got[mode] = _db_rows(db)
    assert got["1"]["events"] and got["1"]["metrics"]
    assert len(got["1"]["metrics"]) == bench_logs["long"].iteration_lines
    assert _same(got["0"]["events"], got["1"]["events"])
    assert _same(got["0"]["metrics"], got["1"]["metrics"])
    assert got["0"]["sources"] == got["1"]["sources"]


def _backends() -> list[str]:
    out = ["ahocorasick", "regex"]
    try:
        import hyperscan  # noqa: F401

        out.append("hyperscan")
    except ImportError:
        pass
    return out


def test_prefilter_backends_find_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANWATCH_CACHE", str(tmp_path / "cache"))
    rng = random.Random(7)
    lits = sorted({lit.encode() for r in RULES.rules for lit in r.literals})
    alphabet = b"".join(lits) + b"\n \t0123456789"
    blobs = [bytes(rng.choice(alphabet) for _ in range(20000)) for _ in range(3)]
    blobs += [p.read_bytes() for p in FIXTURE_FILES[:20]]
    ref = Prefilter(lits, "regex")
    for backend in _backends():
        pf = Prefilter(lits, backend)
        assert pf.backend == backend
        for blob in blobs:
            assert pf.find(blob) == ref.find(blob), backend


def test_hyperscan_database_is_cached_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("hyperscan")
    monkeypatch.setenv("NANWATCH_CACHE", str(tmp_path / "cache"))
    lits = [b"out of memory", b"EI0002", b"loss: nan"]
    Prefilter(lits, "hyperscan")
    cached = list((tmp_path / "cache").glob("prefilter-*.hsdb"))
    assert len(cached) == 1
    # a second start reads the database back instead of compiling it again
    written = cached[0].stat().st_mtime_ns
    cached[0].touch()
    touched = cached[0].stat().st_mtime_ns
    again = Prefilter(lits, "hyperscan")
    assert again.find(b"out of memory\n") == [(0, 0, 13)]
    assert cached[0].stat().st_mtime_ns == touched >= written
    # a second start reads it back (a damaged file is compiled again, not an error)
    cached[0].write_bytes(b"garbage")
    pf = Prefilter(lits, "hyperscan")
    assert pf.find(b"x EI0002 loss: nan\n") == [(1, 2, 8), (2, 9, 18)]


def test_detection_is_the_same_without_hyperscan(monkeypatch: pytest.MonkeyPatch) -> None:
    path = FIXTURES / "npu_val_oom_hccl"
    files = _text_files(path)
    ref = [_run(Detector(RULES, default_year=2026), f, 4096) for f in files]
    monkeypatch.setenv("NANWATCH_NO_HYPERSCAN", "1")
    got = [_run(Detector(RULES, default_year=2026), f, 4096) for f in files]
    assert _same(ref, got)
    assert os.environ["NANWATCH_NO_HYPERSCAN"] == "1"


def test_doctor_says_which_prefilter_and_reader_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from nanwatch.cli import cli

    (tmp_path / "logs").mkdir()
    cfg = tmp_path / "nanwatch.toml"
    cfg.write_text(f'db = "state/nw.db"\n[sources]\npaths = ["{tmp_path / "logs"}"]\n')
    for env, backend in (("", _backends()[-1]), ("1", "ahocorasick")):
        monkeypatch.setenv("NANWATCH_NO_HYPERSCAN", env)
        out = CliRunner().invoke(cli, ["doctor", "--config", str(cfg), "--json"]).output
        rows = [json.loads(line) for line in out.splitlines()]
        (row,) = [r for r in rows if r["check"] == "detect"]
        assert row["status"] == "ok"
        assert row["message"].startswith(f"literal prefilter: {backend}")
        assert "iteration lines read as columns: on" in row["message"]
