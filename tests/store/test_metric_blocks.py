"""Per-iteration metrics as columnar blocks: packing, both insert paths, exactly-once, the
migration of a schema-4 database, the readers, the incremental slowdown check, `metrics`."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.config import Config
from nanwatch.correlate import slowdown
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.demo.simulate import TrainingRun, mmengine_iter_line
from nanwatch.events import Metric
from nanwatch.query import list_incidents
from nanwatch.store import SCHEMA_VERSION, Store
from nanwatch.store.metric_blocks import _summary
from nanwatch.store.metrics import (
    SMALL_BLOCK,
    MetricColumns,
    Metrics,
    decode,
    encode,
    pack,
    unpacked,
)
from nanwatch.store.schema import MIGRATIONS

from ..conftest import nanwatch

T0 = dt.datetime(2026, 11, 30, 10, 0, 0)


_DEFAULT = -1


def _m(offset: int, rank: int | None = 0, step: int | None = _DEFAULT, **kw: object) -> Metric:
    return Metric(
        offset,
        rank,
        offset // 10 if step == _DEFAULT else step,
        kw.pop("epoch", 1),  # type: ignore[arg-type]
        kw.pop("iter", offset // 10),  # type: ignore[arg-type]
        kw.pop("stage", "train"),  # type: ignore[arg-type]
        kw.pop("time", f"2026-11-30T10:00:{offset // 10 % 60:02d}.000Z"),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _store(db: Path) -> tuple[Store, int, int]:
    store = Store.open(db)
    run = store.run_id("/r", "", "r")
    store.execute(
        "INSERT INTO sources(run_id, path, root, dev, ino, created_at, updated_at) "
        "VALUES (?, '/r/rank0.log', '/r', 1, 1, 'x', 'x')",
        (run,),
    )
    return store, run, 1


def _stored(store: Store) -> list[tuple[object, ...]]:
    return [tuple(Metric(*vars_of(m))) for m in Metrics(store).rows()]


def vars_of(m: object) -> list[object]:
    return [getattr(m, f) for f in Metric._fields]


def test_a_block_gives_back_what_went_in_missing_values_included() -> None:
    rows = [
        _m(0, loss=1.5, grad_norm=float("inf"), step_time=0.8, data_time=0.01, lr=1e-4),
        _m(10, rank=None, step=None, stage=None, time=None),  # nothing known but its place
        _m(20, stage="val", loss=float("nan"), memory=12345.0),  # NaN reads back as missing
        _m(30, rank=2**70, stage="odd\x1fstage"),  # not an int64; a separator in a value
    ]
    for compress in (True, False):
        back = list(decode(encode(MetricColumns.from_rows(rows), compress=compress)).rows())
        assert back[0] == rows[0]
        assert back[1] == rows[1]
        assert back[2].loss is None and back[2].memory == 12345.0 and back[2].stage == "val"
        assert back[3].rank is None and back[3].stage == "odd\x1fstage"
    # a column missing on every row costs nothing
    without = MetricColumns.from_rows([_m(i * 10) for i in range(100)])
    with_lr = MetricColumns.from_rows([_m(i * 10, lr=1e-4) for i in range(100)])
    assert len(encode(with_lr, compress=False)) - len(encode(without, compress=False)) == 800


def test_both_insert_paths_store_the_same_iterations(tmp_path: Path) -> None:
    rows = [_m(i * 10, loss=0.5 + i, step_time=0.8) for i in range(50)]
    a, run_a, src_a = _store(tmp_path / "a.db")
    b, run_b, src_b = _store(tmp_path / "b.db")
    with a.transaction():
        assert a.insert_metrics(run_a, src_a, rows) == 50
    cols = MetricColumns(*(list(c) for c in zip(*rows)))
    with b.transaction():
        assert b.insert_metric_columns(run_b, src_b, cols) == 50
    assert _stored(a) == _stored(b) == [tuple(r) for r in rows]
    assert Metrics(a).count() == Metrics(b).count() == 50
    a.close()
    b.close()


def _blocks(store: Store) -> list[tuple[object, ...]]:
    return store.execute("SELECT * FROM metric_blocks ORDER BY id").fetchall()


@pytest.mark.parametrize("seed", range(6))
def test_a_packed_chunk_is_stored_as_its_columns_would_be(tmp_path: Path, seed: int) -> None:
    # chunks of every size around a small block's, read again from earlier offsets, of two
    # runs: the packed path writes the very blocks (bytes and summaries) the columns' does
    import random

    rng = random.Random(seed)
    a, run, src = _store(tmp_path / "a.db")
    b, _, _ = _store(tmp_path / "b.db")
    other = a.run_id("/q", "", "q")
    assert b.run_id("/q", "", "q") == other
    offset = 0
    for _ in range(30):
        n = rng.choice([1, 3, SMALL_BLOCK - 2, SMALL_BLOCK, SMALL_BLOCK + 5, 700])
        if rng.random() < 0.2:
            offset = max(0, offset - rng.randint(1, 50) * 10)  # read again from earlier
        rows = [
            _m(
                offset + i * 10,
                loss=rng.choice([None, float("nan"), 0.0, rng.random()]),
                stage=rng.choice(["train", "train", "train", "val"]),
                step_time=rng.random(),
            )
            for i in range(n)
        ]
        offset += n * 10
        rid = run if rng.random() < 0.8 else other
        cols = MetricColumns.from_rows(rows)
        packed = pack(tuple(list(getattr(cols, f)) for f in Metric._fields))
        assert packed is not None and len(packed) == n
        with a.transaction():
            got_a = a.insert_metric_columns(rid, src, cols)
        with b.transaction():
            got_b = b.insert_metrics(rid, src, packed)
        assert got_a == got_b
        assert _blocks(a) == _blocks(b)
    assert Metrics(a).count() == Metrics(b).count() > 0
    assert pack(tuple([] for _ in Metric._fields)) is None
    a.close()
    b.close()


def test_a_block_read_column_by_column_is_the_block() -> None:
    rows = [_m(i * 10, loss=None if i % 7 == 0 else 0.5 + i, lr=1e-4) for i in range(300)]
    blob = encode(MetricColumns.from_rows(rows))
    lazy = unpacked(blob)
    assert len(lazy) == 300
    assert lazy.step == decode(blob).step  # one column read first, then the rest
    assert list(lazy.rows()) == list(decode(blob).rows()) == rows


def test_a_block_s_trained_step_is_the_highest_with_a_finite_loss() -> None:
    import random

    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 40)
        rows = [
            _m(
                i * 10,
                step=rng.choice([None, rng.randint(0, 60)]),
                epoch=rng.choice([None, rng.randint(0, 5)]),
                stage="train" if rng.random() < 0.9 else rng.choice(["val", None]),
                loss=rng.choice([None, float("nan"), float("inf"), 0.0, 1e308, rng.random()]),
            )
            for i in range(n)
        ]
        cols = MetricColumns.from_rows(rows)
        trained = [
            r for r in rows if r.stage == "train" and r.loss is not None and math.isfinite(r.loss)
        ]
        steps = [r.step for r in trained if r.step is not None]
        epochs = [r.epoch for r in trained if r.epoch is not None]
        summary = _summary(cols)
        assert summary[-2:] == (max(steps, default=None), max(epochs, default=None))


def test_the_trained_steps_before_and_after_a_step_are_the_ones_the_rows_give(
    tmp_path: Path,
) -> None:
    # most blocks answer from their summary; the rows of the others are read: either way the
    # answer is the highest training step below ``step`` with a finite loss, of all the rows
    import random

    rng = random.Random(11)
    store, run, src = _store(tmp_path / "m.db")
    every: list[Metric] = []
    offset = 0
    for _ in range(25):
        rows = []
        for _ in range(rng.randint(1, 30)):
            offset += 10
            rows.append(
                _m(
                    offset,
                    step=rng.choice([None, rng.randint(0, 300)]),
                    stage="train" if rng.random() < 0.85 else "val",
                    loss=rng.choice([None, float("nan"), float("-inf"), *[rng.random()] * 12]),
                )
            )
        with store.transaction():
            store.insert_metric_columns(run, src, MetricColumns.from_rows(rows))
        every += rows
    metrics = Metrics(store)
    for step in [*range(0, 310), 1000]:
        want = max(
            (
                r.step
                for r in every
                if r.stage == "train"
                and r.step is not None
                and r.step < step
                and r.loss is not None
                and math.isfinite(r.loss)
            ),
            default=None,
        )
        assert metrics.trained_before(run, step) == want
        after = sum(
            1
            for r in every
            if r.stage == "train"
            and r.step is not None
            and r.step > step
            and r.loss is not None
            and math.isfinite(r.loss)
        )
        assert metrics.trained_after(run, step) == after
    store.close()


def test_reading_a_chunk_again_never_doubles_an_iteration(tmp_path: Path) -> None:
    store, run, src = _store(tmp_path / "m.db")
    rows = [_m(i * 10, step_time=0.8) for i in range(30)]
    with store.transaction():
        store.insert_metrics(run, src, rows[:10])
        store.insert_metrics(run, src, rows[10:20])
    with store.transaction():
        # the same chunk again (offsets restarted), a longer re-read of a final chunk, a
        # chunk that overlaps two blocks
        assert store.insert_metrics(run, src, rows[:10]) == 0
        assert store.insert_metrics(run, src, rows[10:25]) == 5
        assert store.insert_metrics(run, src, rows[5:30]) == 5
    assert sorted(m[0] for m in _stored(store)) == [r.offset for r in rows]
    # another source's iterations at the same offsets are its own
    store.execute(
        "INSERT INTO sources(run_id, path, root, dev, ino, created_at, updated_at) "
        "VALUES (?, '/r/rank1.log', '/r', 1, 2, 'x', 'x')",
        (run,),
    )
    with store.transaction():
        assert store.insert_metrics(run, 2, rows[:10]) == 10
    store.close()


def test_a_final_chunk_read_again_with_more_lines_stores_each_iteration_once(
    tmp_path: Path,
) -> None:
    """A scan reads the last line before its newline (no offset committed past it); the next
    scan reads it again from the same offset, with what was appended since."""
    log = tmp_path / "job" / "rank0.log"
    log.parent.mkdir()
    lines = _lines([0.86] * 30)
    log.write_text("\n".join(lines[:10]))  # no newline after the 10th line
    db = tmp_path / "m.db"
    _scan(db, log.parent)
    store = Store.open(db, readonly=True)
    assert Metrics(store).count() == 10
    store.close()
    with log.open("a") as f:
        f.write("\n" + "\n".join(lines[10:]) + "\n")
    _scan(db, log.parent)
    _scan(db, log.parent)
    store = Store.open(db, readonly=True)
    steps = [m.step for m in Metrics(store).rows()]
    store.close()
    assert sorted(steps) == [i * 10 for i in range(1, 31)]


def test_a_live_pass_s_few_lines_grow_the_source_s_last_block(tmp_path: Path) -> None:
    store, run, src = _store(tmp_path / "m.db")
    for i in range(300):
        with store.transaction():
            assert store.insert_metrics(run, src, [_m(i * 10, step_time=0.8)]) == 1
    blocks = store._conn.execute("SELECT n FROM metric_blocks ORDER BY id").fetchall()
    assert blocks == [(256,), (44,)]
    assert [m[0] for m in _stored(store)] == [i * 10 for i in range(300)]
    with store.transaction():
        assert store.insert_metrics(run, src, [_m(i * 10) for i in range(250, 301)]) == 1
    assert Metrics(store).count() == 301
    store.close()


def test_a_grown_block_is_the_block_of_all_its_rows_at_once(tmp_path: Path) -> None:
    # pieces with columns missing in one piece and known in the next, missing values inside,
    # a stage that changes, texts that stop being constant
    pieces = [
        [_m(0, loss=1.5, step_time=0.8), _m(10, loss=1.25, step_time=0.8)],
        [_m(20, rank=None, step=None, stage=None, time=None)],
        [_m(30, stage="val", loss=float("nan"), lr=1e-4, memory=2048.0)],
        [_m(40, rank=3, grad_norm=float("inf"), data_time=0.01), _m(50, epoch=None)],
        [_m(60, stage="odd\x1fstage", time="2026-11-30T09:59:59.000Z")],
        [_m(70, loss=0.5), _m(80, loss=0.25, stage="train")],
    ]
    every = [m for piece in pieces for m in piece]
    cols = (
        "first_offset, last_offset, n, rank_min, rank_max, step_min, step_max, time_min, "
        "time_max, trained_step_max, trained_epoch_max, data"
    )
    other, run, other_src = _store(tmp_path / "at-once.db")
    with other.transaction():
        assert other.insert_metrics(run, other_src, every) == len(every)
    want = other._conn.execute(f"SELECT {cols} FROM metric_blocks").fetchall()
    store, run, src = _store(tmp_path / "m.db")
    for piece in pieces:
        with store.transaction():
            assert store.insert_metrics(run, src, piece) == len(piece)
    got = store._conn.execute(f"SELECT {cols} FROM metric_blocks").fetchall()
    assert len(got) == 1 and got[0][:-1] == want[0][:-1]  # the same summary columns
    assert list(decode(got[0][-1]).rows()) == list(decode(want[0][-1]).rows())
    # the next block starts: the grown one is packed as if its rows had come at once
    with store.transaction():
        store.insert_metrics(run, src, [_m(1000 + i * 10) for i in range(SMALL_BLOCK)])
    got = store._conn.execute(f"SELECT {cols} FROM metric_blocks ORDER BY id").fetchall()
    assert len(got) == 2 and got[0] == want[0]
    assert _stored(store) == [
        *_stored(other),
        *(tuple(_m(1000 + i * 10)) for i in range(SMALL_BLOCK)),
    ]
    store.close()
    other.close()


def test_a_growing_block_is_not_read_back_from_the_database(tmp_path: Path) -> None:
    store, run, src = _store(tmp_path / "m.db")
    with store.transaction():
        store.insert_metrics(run, src, [_m(0)])
    reads: list[str] = []
    store._conn.set_trace_callback(lambda sql: reads.append(sql) if "data" in sql else None)
    for i in range(1, 40):
        with store.transaction():
            assert store.insert_metrics(run, src, [_m(i * 10)]) == 1
    store._conn.set_trace_callback(None)
    # the block it grows is the one it wrote: written anew, never selected again
    assert [sql for sql in reads if sql.lstrip().upper().startswith("SELECT")] == []
    assert store._conn.execute("SELECT n FROM metric_blocks").fetchall() == [(40,)]
    assert [m[0] for m in _stored(store)] == [i * 10 for i in range(40)]
    store.close()


def test_a_grown_block_stays_exact_when_a_growth_rolls_back_or_retention_deletes_it(
    tmp_path: Path,
) -> None:
    store, run, src = _store(tmp_path / "m.db")
    with store.transaction():
        store.insert_metrics(run, src, [_m(0), _m(10)])
    # a refused commit (disk full): the growth is undone, and the batch is written again
    with pytest.raises(RuntimeError), store.transaction():
        store.insert_metrics(run, src, [_m(20)])
        raise RuntimeError("refused")
    with store.transaction():
        assert store.insert_metrics(run, src, [_m(20)]) == 1
        assert store.insert_metrics(run, src, [_m(30)]) == 1
    assert [m[0] for m in _stored(store)] == [0, 10, 20, 30]
    blocks = "SELECT n FROM metric_blocks WHERE source_id = ?"
    assert store._conn.execute(blocks, (src,)).fetchall() == [(4,)]  # one block, grown
    # another source's block takes the id a rolled-back growth had
    other = store.execute(
        "INSERT INTO sources(run_id, path, root, dev, ino, created_at, updated_at) "
        "VALUES (?, '/r/rank1.log', '/r', 1, 2, 'x', 'x')",
        (run,),
    ).lastrowid
    with pytest.raises(RuntimeError), store.transaction():
        store.insert_metrics(run, src, [_m(40)])
        raise RuntimeError("refused")
    with store.transaction():
        store.insert_metrics(run, other, [_m(5, rank=1)])
        assert store.insert_metrics(run, src, [_m(40)]) == 1
    assert store._conn.execute(blocks, (src,)).fetchall() == [(5,)]
    assert sorted(m[0] for m in _stored(store)) == [0, 5, 10, 20, 30, 40]
    # retention takes the source's block: what comes next starts a block of its own
    store.expire_metrics(Metrics(store).last_block())
    with store.transaction():
        assert store.insert_metrics(run, src, [_m(50), _m(60)]) == 2
    assert [m[0] for m in _stored(store)] == [50, 60]
    assert store._conn.execute("SELECT n FROM metric_blocks").fetchall() == [(2,)]
    store.close()


def _schema_4(db: Path) -> None:
    conn = sqlite3.connect(db)
    for m in MIGRATIONS[:4]:
        assert isinstance(m, str)
        conn.executescript(m)
    conn.execute("PRAGMA user_version=4")
    conn.execute("INSERT INTO runs(id, name, root, created_at) VALUES (1, 'job', '/job', 'now')")
    conn.execute(
        "INSERT INTO sources(id, run_id, path, root, dev, ino, created_at, updated_at) "
        "VALUES (1, 1, '/job/rank0.log', '/job', 1, 1, 'x', 'x')"
    )
    rows = [
        (
            1,
            1,
            i * 700,
            i % 2,
            i,
            1,
            i,
            "train" if i % 7 else "val",
            f"2026-11-30T10:{i // 60 % 60:02d}:{i % 60:02d}.000Z",
            0.5,
            None,
            0.86,
            0.01,
            1e-4,
            2048.0,
        )
        for i in range(5000)
    ]
    conn.executemany(
        "INSERT INTO metrics(run_id, source_id, offset, rank, step, epoch, iter, stage, time, "
        "loss, grad_norm, step_time, data_time, lr, memory) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        rows,
    )
    conn.execute("INSERT INTO meta(key, value) VALUES ('slowdown_metrics_upto', '5000')")
    conn.commit()
    conn.close()


def test_migration_5_turns_a_schema_4_database_s_rows_into_blocks(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    _schema_4(db)
    with sqlite3.connect(db) as conn:
        before = conn.execute(
            "SELECT offset, rank, step, epoch, iter, stage, time, loss, grad_norm, step_time, "
            "data_time, lr, memory FROM metrics ORDER BY offset"
        ).fetchall()
    store = Store.open(db)
    try:
        assert store._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        tables = {r[0] for r in store._conn.execute("SELECT name FROM sqlite_master")}
        assert "metrics" not in tables and "metric_blocks" in tables
        assert store._conn.execute("SELECT count(*) FROM metric_blocks").fetchone()[0] == 2
        assert [tuple(vars_of(m)) for m in Metrics(store).rows()] == before
        assert store.meta_get("slowdown_metrics_upto") is None
        # the converted blocks keep their identity: the same rows again add nothing
        again = [Metric(*r) for r in before[:100]]
        with store.transaction():
            assert store.insert_metrics(1, 1, again) == 0
        st = Metrics(store).step_times(1, rank=1)
        assert len(st.step) == sum(1 for r in before if r[1] == 1 and r[5] == "train")
    finally:
        store.close()


def test_step_times_are_training_steps_with_a_time(tmp_path: Path) -> None:
    store, run, src = _store(tmp_path / "m.db")
    with store.transaction():
        store.insert_metrics(
            run, src, [_m(i * 10, rank=i % 2, step_time=1.0 + i) for i in range(10)]
        )
        store.insert_metrics(
            run,
            src,
            [
                _m(100, step_time=5.0, stage="val"),
                _m(110, step_time=None),
                _m(120, step=None, step_time=5.0),
                _m(130, step_time=0.0),
                _m(140, rank=None, step_time=2.5),
            ],
        )
    st = Metrics(store).step_times(run)
    assert list(st.step) == [*range(10), 14]
    assert list(st.seconds) == [1.0 + i for i in range(10)] + [2.5]
    one = Metrics(store).step_times(run, rank=1)
    assert list(one.step) == [1, 3, 5, 7, 9] and set(one.rank) == {1}
    store.close()


def _lines(times: list[float], start: int = 1) -> list[str]:
    t, out = 0.0, []
    for i, st in enumerate(times, start=start):
        t += st * 10
        out.append(
            mmengine_iter_line(
                T0 + dt.timedelta(seconds=i * 100), "train", 1, i * 10, 10000, step_time=st
            )
        )
    return out


def _scan(db: Path, path: Path) -> list[dict[str, object]]:
    store = Store.open(db)
    try:
        Pipeline(Config(), store, [str(path)]).scan()
        return list_incidents(store._conn)
    finally:
        store.close()


def test_the_slowdown_check_keeps_its_statistics_not_the_history(tmp_path: Path) -> None:
    """The baseline learnt from the first part of a run survives the deletion of its step
    times (retention): each pass reads only what was stored since the last one."""
    log = tmp_path / "job" / "rank0.log"
    log.parent.mkdir()
    fast = _lines([0.86] * 40)
    log.write_text("\n".join(fast) + "\n")
    db = tmp_path / "m.db"
    assert _scan(db, log.parent) == []
    store = Store.open(db)
    assert Metrics(store).expire(Metrics(store).last_block()) == 40
    store.close()
    with log.open("a") as f:
        f.write("\n".join(_lines([2.84] * 20, start=41)) + "\n")
    (inc,) = _scan(db, log.parent)
    assert inc["kind"] == "slowdown"
    assert inc["origin"]["step"] == 410 and 3.0 <= inc["origin"]["ratio"] <= 3.6  # type: ignore[index, operator]


def test_the_same_slowdown_whether_read_at_once_or_line_by_line(tmp_path: Path) -> None:
    lines = _lines([3.0, 2.0] + [0.86] * 38 + [2.84] * 30)
    whole = tmp_path / "a" / "rank0.log"
    whole.parent.mkdir()
    whole.write_text("\n".join(lines) + "\n")
    (at_once,) = _scan(tmp_path / "a.db", whole.parent)
    parts = tmp_path / "b" / "rank0.log"
    parts.parent.mkdir()
    parts.write_text("")
    db = tmp_path / "b.db"
    for k in range(0, len(lines), 7):
        with parts.open("a") as f:
            f.write("\n".join(lines[k : k + 7]) + "\n")
        got = _scan(db, parts.parent)
    (bit_by_bit,) = got
    assert at_once["kind"] == bit_by_bit["kind"] == "slowdown"
    assert at_once["origin"] == bit_by_bit["origin"]


def test_most_ranks_must_be_slow() -> None:
    stats: dict[int, slowdown.RankStats] = {}
    for rank in range(4):
        st = stats[rank] = slowdown.RankStats()
        for i in range(40):
            slow = rank == 0 and i >= 20
            st.add(slowdown.Point(i, 2.8 if slow else 0.86, 1, i, None, None, None))
    assert stats[0].found is not None and stats[1].found is None
    # a copy of the same lines (the log file and the captured stdout) counts once
    again = slowdown.RankStats.from_json(stats[1].to_json())
    for i in range(40):
        again.add(slowdown.Point(i, 9.0, 1, i, None, None, None))
    assert again.found is None and again.to_json() == stats[1].to_json()


def _cli_db(tmp_path: Path) -> Path:
    run = TrainingRun(tmp_path / "wd" / "exp", ranks=2, epochs=1, iters=50)
    run.write()
    db = tmp_path / "m.db"
    _scan(db, run.work_dir)
    return db


def test_the_metrics_command_lists_every_iteration(tmp_path: Path) -> None:
    db = _cli_db(tmp_path)
    r = CliRunner().invoke(cli, ["metrics", "--db", str(db), "--json"])
    assert r.exit_code == 0, r.output
    got = [json.loads(line) for line in r.output.splitlines()]
    store = Store.open(db, readonly=True)
    n = Metrics(store).count()
    store.close()
    assert len(got) == n > 10 and {g["rank"] for g in got} == {0, 1}
    assert all(isinstance(g["step_time"], float) and g["stage"] == "train" for g in got)
    assert list(got[0])[:5] == ["run", "rank", "epoch", "iter", "step"]
    r = CliRunner().invoke(
        cli, ["metrics", "--db", str(db), "--csv", "--rank", "1", "--limit", "2"]
    )
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.output)))
    assert len(rows) == 2 and {x["rank"] for x in rows} == {"1"}
    assert math.isfinite(float(rows[0]["step_time"])) and rows[0]["stage"] == "train"
    r = CliRunner().invoke(cli, ["metrics", "--db", str(db), "--until", "2000-01-01"])
    assert r.exit_code == 0 and "No metrics" in r.output
    r = CliRunner().invoke(cli, ["metrics", "--db", str(db)])
    assert r.exit_code == 0 and "STEP_TIME" in r.output and len(r.output.splitlines()) == n + 2
    r = CliRunner().invoke(cli, ["metrics", "--db", str(db), "--run", "nope"])
    assert r.exit_code != 0 and "--run 'nope' matches no run" in r.output
    r = CliRunner().invoke(cli, ["metrics", "--db", str(db), "--json", "--csv"])
    assert r.exit_code != 0 and "choose one" in r.output


@pytest.mark.parametrize("flag", ["--help"])
def test_the_metrics_command_has_help(flag: str) -> None:
    r = CliRunner().invoke(cli, ["metrics", flag])
    assert r.exit_code == 0 and "--csv" in r.output and "Examples" in r.output
    assert "metrics" in CliRunner().invoke(cli, ["--help"]).output


def test_the_metrics_command_as_a_process(tmp_path: Path) -> None:
    db = _cli_db(tmp_path)
    out = nanwatch("metrics", "--db", str(db), "--csv", "--rank", "0").stdout
    head, *rows = out.splitlines()
    assert head.split(",")[:5] == ["run", "rank", "epoch", "iter", "step"] and rows
    assert {r.split(",")[1] for r in rows} == {"0"}
