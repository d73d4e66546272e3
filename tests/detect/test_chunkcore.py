"""The compiled chunk core (detect/_chunkcore.c) reads what the pure-Python column reader reads,
to the byte: the same events (every field), metric values, run facts and stream state, on every
fixture, on the benchmark's inputs, on edge cases and on generated iteration lines; the same rows
in the store after a scan; and it is built by a normal install (CI fails without it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.detect import Detector, StreamState
from nanwatch.detect import core as chunkcore
from nanwatch.detect.columns import ColumnFormat
from nanwatch.store import Store
from tests.detect.test_columns import (
    EDGE_CASES,
    FIXTURE_FILES,
    FIXTURES,
    RULES,
    _chunks,
    _db_rows,
    _same,
    mmengine_logs,
)

ROOT = Path(__file__).resolve().parents[2]
COMPILED = chunkcore.status()[0]
needs_core = pytest.mark.skipif(not COMPILED, reason=f"compiled core: {chunkcore.status()[1]}")


def _detector(pure: bool) -> Detector:
    """A detector whose columns formats (chosen at the first chunk) use one reader."""
    old = os.environ.get(chunkcore.PURE_ENV)
    os.environ[chunkcore.PURE_ENV] = "1" if pure else "0"
    try:
        det = Detector(RULES, default_year=2026)
        assert all((f.core is None) == (pure or not COMPILED) for f in det._c.formats)
    finally:
        if old is None:
            del os.environ[chunkcore.PURE_ENV]
        else:
            os.environ[chunkcore.PURE_ENV] = old
    return det


class _Counted:
    """Counts the chunks the compiled core read itself (not handed back to Python)."""

    def __init__(self, det: Detector) -> None:
        self.read = self.declined = 0
        for fmt in det._c.formats:
            if fmt.core is not None:
                fn, where = fmt.core
                fmt.core = (self._wrap(fn), where)

    def _wrap(self, fn: Callable[[bytes, int], Any]) -> Callable[[bytes, int], Any]:
        def counted(chunk: bytes, limit: int) -> Any:
            got = fn(chunk, limit)
            if got is None:
                self.declined += 1
            else:
                self.read += 1
            return got

        return counted


def _feed(det: Detector, data: bytes, size: int, name: str) -> list[Any]:
    state = StreamState()
    out: list[Any] = []
    for off, chunk in _chunks(data, size):
        facts: list[dict[str, Any]] = []
        events, metrics = det.feed(chunk, off, state, name, facts=facts)
        out.append((events, [tuple(m) for m in metrics], facts, state.to_json()))
    return out


def _compare(
    data: bytes, sizes: tuple[int, ...] = (1 << 30, 4096), name: str = "r.log"
) -> _Counted:
    core = _detector(pure=False)
    counted = _Counted(core)
    for size in sizes:
        pure = _detector(pure=True)
        ref = _feed(pure, data, size, name)
        got = _feed(core, data, size, name)
        assert len(ref) == len(got)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert _same(a[0], b[0]), f"chunk {i} (size {size}): events differ"
            assert _same(a[1], b[1]), f"chunk {i} (size {size}): metrics differ"
            assert a[2] == b[2], f"chunk {i} (size {size}): facts differ"
            assert a[3] == b[3], f"chunk {i} (size {size}): stream state differs"
    return counted


# -- which core runs ------------------------------------------------------------------------


def test_ci_installs_the_compiled_core() -> None:
    """`pip install -e '.[test]'` on a fresh clone builds the extension (hatch_build.py)."""
    if os.environ.get("CI") != "true":
        pytest.skip("CI is not set: a machine without a C compiler reads in pure Python")
    compiled, detail = chunkcore.status()
    assert compiled, f"the compiled chunk core is not in use in CI: {detail}"


@needs_core
def test_the_shipped_mmengine_rule_is_read_by_the_compiled_core() -> None:
    (fmt,) = [f for f in _detector(pure=False)._c.formats if f.rule.id == "mmengine.iter_line"]
    assert fmt.core is not None, "parsers/mmengine.toml no longer matches what _chunkcore.c reads"
    line = EDGE_CASES["plain"][0].encode() + b"\n"
    rows = fmt.parse(line * 3)
    assert (
        rows is not None and rows.cols is not None and rows.starts == [0, len(line), 2 * len(line)]
    )


def test_pure_python_is_selected_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(chunkcore.PURE_ENV, "1")
    assert chunkcore.status() == (False, "NANWATCH_PURE set")
    assert all(f.core is None for f in Detector(RULES)._c.formats)


def test_a_prefix_that_can_start_on_a_head_keeps_the_python_reader() -> None:
    (rule,) = [r for r in RULES.rules if r.id == "mmengine.iter_line"]
    det = Detector(RULES)
    # a site prefix "20xx/..." (a date of its own) could make the rows regex skip a dated line
    for prefix in (r"\d{4}/\d\d/\d\d \S+ ", r"\d\d/\d\d ", r"(?:node\d+ )?"):
        assert ColumnFormat(rule, 0, [r"\[rank\d+\]: ", prefix], det._c).core is None, prefix
    fmt = ColumnFormat(rule, 0, [r"\[rank\d+\]: "], det._c)
    assert (fmt.core is not None) == COMPILED


# -- the same results -----------------------------------------------------------------------


@needs_core
@pytest.mark.parametrize(
    "path", FIXTURE_FILES, ids=[str(p.relative_to(FIXTURES)) for p in FIXTURE_FILES]
)
def test_fixture_same_with_the_compiled_core(path: Path) -> None:
    _compare(path.read_bytes(), name=str(path))


@pytest.fixture(scope="module")
def bench_logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bench")
    return {
        "long": mmengine_logs(root / "long", 1.5),
        "short": mmengine_logs(root / "short", 1.0, short=True),
    }


@needs_core
@pytest.mark.parametrize("variant", ["long", "short"])
def test_bench_inputs_same_and_read_by_the_compiled_core(
    bench_logs: dict[str, Any], variant: str
) -> None:
    read = declined = 0
    for f in bench_logs[variant].files:
        c = _compare(f.read_bytes(), (1 << 30, 64 << 10, 3000), name=str(f))
        read, declined = read + c.read, declined + c.declined
    # the generated logs hold nothing the core leaves to Python
    assert read > 0 and declined == 0


@needs_core
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_edge_case_same_with_the_compiled_core(case: str) -> None:
    _compare(("\n".join(EDGE_CASES[case]) + "\n").encode(), (1 << 30, 700, 300))


@needs_core
def test_numbers_float_refuses_go_to_the_python_reader() -> None:
    """A value float() refuses ("1.5,") is read by ``_number`` in Python: the core declines."""
    c = _compare(("\n".join(EDGE_CASES["odd_values"]) + "\n").encode(), (1 << 30,))
    assert c.declined == 1 and c.read == 0


def _scan_the_same_with_either_core(
    logs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scan ``logs`` in pure Python and with the compiled core: the same events, metrics and
    sources, every iteration stored."""
    got = {}
    for pure in ("1", "0"):
        monkeypatch.setenv(chunkcore.PURE_ENV, pure)
        db = tmp_path / f"{pure}.db"
        store = Store.open(db)
        try:
            Pipeline(Config(), store, [str(logs.root)]).scan()
        finally:
            store.close()
        got[pure] = _db_rows(db)
    assert len(got["0"]["metrics"]) == logs.iteration_lines
    assert _same(got["1"]["events"], got["0"]["events"])
    assert _same(got["1"]["metrics"], got["0"]["metrics"])
    assert got["1"]["sources"] == got["0"]["sources"]


@needs_core
def test_a_scan_stores_the_same_with_either_core(
    bench_logs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _scan_the_same_with_either_core(bench_logs["short"], tmp_path, monkeypatch)


@needs_core
def test_a_scan_in_worker_processes_stores_the_same_with_either_core(
    bench_logs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers send metric rows as columns; the compiled core zips them back into rows."""
    import nanwatch.daemon.passes as passes_module
    import nanwatch.detect.pool as pool_module

    monkeypatch.setenv("NANWATCH_SCAN_WORKERS", "2")
    monkeypatch.setattr(passes_module, "POOL_MIN_BYTES", 0)
    started: list[int] = []
    real_pool = pool_module.DetectorPool

    def pool(detector: Detector, workers: int, **kw: Any) -> Any:
        started.append(workers)
        return real_pool(detector, workers, **kw)

    monkeypatch.setattr(pool_module, "DetectorPool", pool)
    _scan_the_same_with_either_core(bench_logs["long"], tmp_path, monkeypatch)
    assert started == [2, 2]


# -- generated iteration lines ----------------------------------------------------------------

_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=0, max_value=10**30).map(str),
    st.sampled_from(
        [
            "nan", "inf", "-inf", "NaN", "Inf", "-nan", "+inf", "infinity", "1e999", "-1e-999",
            "1.0043e-03", "4.6860", ".5", "5.", "1_000", "0x10", "1.5,", "2|", "é1", "1.5é",
            "١٢", "", "1e", "--1", "9" * 40, "9" * 70, "0" * 19 + "1",
        ]
    ),
)  # fmt: skip
_DIGITS = st.one_of(
    st.integers(min_value=0, max_value=10**6).map(str),
    st.sampled_from(["0", "007", "9" * 18, "9" * 19, "1" * 40]),
)
_SP = st.sampled_from([" ", "  ", "   ", "\t", ""])
_HEADS = st.sampled_from(
    [
        "2026/11/30 10:00:{s} - mmengine - INFO - ",
        "1999/12/31 23:59:{s} - mmengine - WARNING - ",
        "11/30 10:00:{s} - mmengine - INFO - ",
        "2026/11/30 10:00:{s} - mmengine - info - ",
        "2026/11/30 10:00:{s} -  mmengine - INFO - ",
        "[rank1]:2026/11/30 10:00:{s} - mmengine - INFO - ",
        "2026-11-30 10:00:{s} - mmengine - INFO - ",
    ]
)
_SECONDS = st.sampled_from(["00", "07", "59", "60", "61", "62", "69"])


@st.composite
def _line(draw: st.DrawFn) -> str:
    head = draw(_HEADS).format(s=draw(_SECONDS))
    marker = draw(st.sampled_from(["Epoch(", "Iter("]))
    stage = draw(st.sampled_from(["train", "val", "test", "Train", "eval"]))
    sp = draw(_SP)
    epoch = f"[{draw(_DIGITS)}]" if draw(st.booleans()) else ""
    it = f"[{draw(_SP)}{draw(_DIGITS)}/{draw(_DIGITS)}]"
    parts = [f"{head}{marker}{stage}){sp}{epoch}{draw(_SP)}{it}"]
    if draw(st.booleans()):
        parts.append(f"base_lr: {draw(_NUMBERS)}")
    for name in ("lr", "eta", "time", "data_time", "memory", "grad_norm", "loss", "loss_cls"):
        if not draw(st.booleans()):
            continue
        if name == "eta":
            value = draw(st.sampled_from(["0:00:10", "5 days, 23:08:13", "1 day, 2:03:04",
                                          "5 days, x", "12:3:04", "1 dayss, 0:00:00"]))  # fmt: skip
        elif name == "memory":
            value = draw(_DIGITS)
        else:
            value = draw(_NUMBERS)
        parts.append(f"{name}: {value}")
    sep = draw(st.sampled_from(["  ", " ", "   "]))
    line = sep.join(parts)
    if draw(st.booleans()):
        line += draw(st.sampled_from(["  Epoch(train) again", "  epoch: 4 step: 9", " ü"]))
    return line


@st.composite
def _log(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(_line(), min_size=1, max_size=12))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), "Traceback (most recent call last):")
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    data = eol.join(lines).encode("utf-8")
    cut = draw(st.sampled_from(["newline", "none", "mid"]))
    if cut == "newline":
        data += eol.encode()
    elif cut == "mid" and len(data) > 10:
        data = data[: draw(st.integers(len(data) // 2, len(data) - 1))]
    return data


@needs_core
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_log())
def test_generated_lines_same_with_the_compiled_core(data: bytes) -> None:
    _compare(data, (1 << 30, 200))


@needs_core
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_DIGITS, _DIGITS, _NUMBERS, _NUMBERS), min_size=1, max_size=20))
def test_generated_clean_rows_are_read_by_the_core(rows: list[tuple[str, str, str, str]]) -> None:
    """Rows of the common shape, whatever their numbers: the core reads every chunk float()
    and int() read as it does, and gives the Python reader's values."""
    text = "".join(
        f"2026/11/30 10:00:{k % 60:02d} - mmengine - INFO - Epoch(train)  [{e}][{i}/900]  "
        f"lr: 1.0000e-04  eta: 0:00:10  time: 0.8612  data_time: 0.0123  memory: 21034  "
        f"grad_norm: {g}  loss: {loss}\n"
        for k, (e, i, g, loss) in enumerate(rows)
    )
    c = _compare(text.encode(), (1 << 30,))
    odd = any(
        len(e) > 18 or len(i) > 18 or not _plain_float(g) or not _plain_float(loss)
        for e, i, g, loss in rows
    )
    assert c.read + c.declined == 1
    if not odd:
        assert c.read == 1


def _plain_float(text: str) -> bool:
    if not text or "_" in text or not text.isascii() or len(text) >= 64:
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


# -- doctor and the build -------------------------------------------------------------------


def _doctor_core(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    from click.testing import CliRunner

    from nanwatch.cli import cli

    (tmp_path / "logs").mkdir(exist_ok=True)
    cfg = tmp_path / "nanwatch.toml"
    cfg.write_text(f'db = "state/nw.db"\n[sources]\npaths = ["{tmp_path / "logs"}"]\n')
    out = CliRunner().invoke(cli, ["doctor", "--config", str(cfg), "--json"]).output
    (row,) = [r for r in map(json.loads, out.splitlines()) if r["check"] == "core"]
    return dict(row)


def test_doctor_says_which_chunk_core_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(chunkcore.PURE_ENV, "1")
    row = _doctor_core(monkeypatch, tmp_path)
    assert row == {
        "check": "core",
        "status": "ok",
        "message": "chunk core: pure Python (why: NANWATCH_PURE set)",
        "fix": None,
    }
    monkeypatch.delenv(chunkcore.PURE_ENV)
    row = _doctor_core(monkeypatch, tmp_path)
    if COMPILED:
        assert row["status"] == "ok"
        assert row["message"].startswith("chunk core: compiled (")
        assert "_chunkcore" in row["message"]
    else:
        assert row["status"] == "warn"
        assert row["message"].startswith("chunk core: pure Python (why: ")
        assert "C compiler" in row["fix"]


def _hatch_build() -> Any:
    sys.path.insert(0, str(ROOT))
    try:
        import hatch_build
    finally:
        sys.path.remove(str(ROOT))
    return hatch_build


def test_the_build_hook_compiles_the_core(tmp_path: Path) -> None:
    hb = _hatch_build()
    out = tmp_path / Path(hb.TARGET).name
    why = hb.compile_core(out)
    if why is not None and "No such file" in why:
        pytest.skip(f"no C compiler here: {why}")
    assert why is None and out.exists()
    # the built module loads and reads a row (in a process of its own: this one has the
    # package's copy loaded already)
    line = EDGE_CASES["plain"][0].encode() + b"\n"
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('_chunkcore', {str(out)!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        f"print(m.rows({line!r}, 65536)[8])"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert got.stdout.strip() == "[1]", got.stderr


def test_without_a_compiler_the_install_goes_on_in_pure_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hb = _hatch_build()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    why = hb.compile_core(tmp_path / "x.so")
    assert why is not None and "no-such-cc" in why
    hook = hb.CustomBuildHook.__new__(hb.CustomBuildHook)
    monkeypatch.setattr(hb.CustomBuildHook, "target_name", property(lambda self: "wheel"))
    build_data: dict[str, Any] = {"force_include": {}, "pure_python": True, "infer_tag": False}
    hook.initialize("standard", build_data)
    assert build_data == {"force_include": {}, "pure_python": True, "infer_tag": False}
    assert "compiled chunk core was not built" in capsys.readouterr().err


@needs_core
def test_a_row_longer_than_the_rule_examines_goes_to_the_python_reader() -> None:
    rows = EDGE_CASES["plain"][:3]
    long = rows[1] + "  loss_x: 0.5" * 6000  # past the rule's max_chars (65536)
    c = _compare(("\n".join([rows[0], long, rows[2]]) + "\n").encode(), (1 << 30,))
    assert c.declined == 1 and c.read == 0


_DECIMALS = st.from_regex(r"[+-]?[0-9]{0,17}(\.[0-9]{0,17})?([eE][+-]?[0-9]{1,4})?", fullmatch=True)


@needs_core
@settings(max_examples=500, deadline=None)
@given(st.lists(_DECIMALS, min_size=1, max_size=8))
def test_decimal_numbers_read_as_float_reads_them(values: list[str]) -> None:
    """The core's exact shortcut for short decimals (one multiplication or division by a
    power of ten) gives float()'s double, to the bit, and its fallback the rest."""
    text = "".join(
        f"2026/11/30 10:00:{k:02d} - mmengine - INFO - Epoch(train)  [1][{k + 1}/900]  "
        f"lr: {v}  time: 0.8612  grad_norm: {v}  loss: {v}\n"
        for k, v in enumerate(values)
    )
    c = _compare(text.encode(), (1 << 30,))
    if all(_plain_float(v) for v in values):
        assert c.read == 1


def test_a_build_of_an_older_source_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """An editable install whose extension was built from an older _chunkcore.c (another
    interface) reads in pure Python, and doctor says why."""
    import types

    old = types.ModuleType("nanwatch.detect._chunkcore")
    old.VERSION = chunkcore.CORE_VERSION - 1  # type: ignore[attr-defined]
    old.__file__ = "/x/_chunkcore.so"
    monkeypatch.setattr(chunkcore, "import_module", lambda name, package=None: old)
    mod, why = chunkcore._load()
    assert mod is None
    v = chunkcore.CORE_VERSION
    assert why == f"stale build /x/_chunkcore.so (version {v - 1}, this nanwatch needs {v})"


@needs_core
@settings(max_examples=400, deadline=None)
@given(
    st.binary(max_size=300).map(lambda b: bytes(c % 6 + 97 if c > 40 else 10 for c in b)),
    st.lists(
        st.binary(min_size=1, max_size=4).map(lambda b: bytes(c % 6 + 97 for c in b)),
        min_size=1,
        max_size=12,
    ),
)
def test_one_pass_counts_are_bytes_count(data: bytes, needles: list[bytes]) -> None:
    # overlapping needles ("aa" in "aaa") and needles sharing a first byte included
    got = chunkcore.count_all(data, tuple(needles))
    assert got == [data.count(n) for n in needles]


def test_counts_without_the_core_are_bytes_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(chunkcore.PURE_ENV, "1")
    data = b"Epoch(train) [1][10/20]\nIter(val) [3/9]\nEpoch(\n"
    needles = (b"Epoch(", b"Iter(", b"poch", b"\n")
    assert chunkcore.count_all(data, needles) == [2, 1, 2, 3]


@pytest.mark.parametrize("pure", ["1", "0"])
def test_numbers_beyond_what_a_run_counts_are_no_position(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pure: str
) -> None:
    """A rank, epoch or iteration of 25 digits (or a step their product makes) is not stored as
    one: the scan keeps every line's event and metric, with those positions missing, instead of
    failing on the database's 64-bit columns."""
    from nanwatch.query import iter_events

    monkeypatch.setenv(chunkcore.PURE_ENV, pure)
    big, wide = "9" * 25, "9" * 12
    head = "2026/11/30 10:00:{:02d} - mmengine - INFO - "
    tail = "  lr: 1.0e-04  eta: 0:01:00  time: 0.5  data_time: 0.01  memory: 1000  loss: {}"
    lines = [
        head.format(1) + f"Epoch(train) [{big}][1/{big}]" + tail.format("0.5"),
        head.format(2) + f"Epoch(train) [{wide}][2/{wide}]" + tail.format("0.5"),
        head.format(3) + f"Epoch(train) [{wide}][3/{wide}]" + tail.format("nan"),
        f"[rank{big}]: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB "
        "(GPU 0; 10.00 GiB total capacity; 9.00 GiB already allocated)",
    ]
    log = tmp_path / "huge.log"
    log.write_text("\n".join(lines) + "\n")
    db = tmp_path / "huge.db"
    store = Store.open(db)
    try:
        Pipeline(Config(), store, [str(log)]).scan()
        events = {e["kind"]: e for e in iter_events(store._conn)}
    finally:
        store.close()
    assert events["nan"]["epoch"] == int(wide) and events["nan"]["iter"] == 3
    assert events["nan"]["step"] is None  # (epoch - 1) * iters + iter is beyond 2**62
    assert events["oom"]["rank"] is None
    assert len(_db_rows(db)["metrics"]) == 3
