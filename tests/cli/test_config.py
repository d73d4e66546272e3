from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.config import RANGES, format_duration, load_config, parse_duration
from nanwatch.errors import ConfigError

from ..conftest import NANWATCH


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "nanwatch.toml"
    p.write_text(text)
    return p


def test_defaults_without_file() -> None:
    c = load_config(None)
    assert c.sources.mode == "auto"
    assert c.alerts.group_wait == 30.0


def test_full_config(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        """
db = "state/nw.db"
[sources]
paths = ["/data/logs", "/data/monitor/*"]
mode = "poll"
poll_interval = "2s"
[alerts]
group_wait = "30s"
group_interval = "5m"
repeat_interval = "4h"
[store]
keep = "90d"
[knowledge]
cann_version = "7.0.0"
hccl_exec_timeout = 1800
[cluster]
job = "job42"
""",
    )
    c = load_config(p)
    assert c.db == tmp_path / "state" / "nw.db"
    assert c.sources.paths == ("/data/logs", "/data/monitor/*")
    assert c.sources.poll_interval == 2.0
    assert c.alerts.group_interval == 300.0
    assert c.alerts.repeat_interval == 4 * 3600
    assert c.store.keep == 90 * 86400
    assert c.knowledge.hccl_exec_timeout == 1800.0
    assert c.cluster.job == "job42"


def test_misspelt_key_names_file_key_and_nearest(tmp_path: Path) -> None:
    p = write(tmp_path, "[alerts]\ngroup_wiat = '30s'\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p.resolve()) in msg and "group_wiat" in msg and "group_wait" in msg


def test_unknown_section(tmp_path: Path) -> None:
    p = write(tmp_path, "[slak]\nchannel = '#x'\n")
    with pytest.raises(ConfigError, match=r"unknown section \[slak\].*slack"):
        load_config(p)


def test_unknown_top_level_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'db'"):
        load_config(write(tmp_path, "dbb = 'x'\n"))


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[sources\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (30, 30.0),
        ("30", 30.0),
        ("30s", 30.0),
        ("5m", 300.0),
        ("4h", 14400.0),
        ("90d", 7776000.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["5x", "-1", "", "soon", True])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)


def test_bad_value_names_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[sources\] mode"):
        load_config(write(tmp_path, "[sources]\nmode = 'fast'\n"))


# --- ranges: no value may spin a core, overflow, or make a timer that never fires --------------

RANGED = sorted(RANGES)


def _toml(value: object) -> str:
    if isinstance(value, float):
        return {math.inf: "inf", -math.inf: "-inf"}.get(
            value, "nan" if value != value else repr(value)
        )
    return repr(value) if not isinstance(value, str) else f'"{value}"'


def _bad_values(lo: float, hi: float) -> list[object]:
    bad: list[object] = [math.nan, math.inf, -math.inf, -1, hi * 10, 1e300, f"{int(hi * 2)}s"]
    if lo > 0:
        bad += [0, "0s", lo / 100, 1e-9]
    return bad


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        pytest.param(s, k, v, id=f"{s}.{k}={v!r}")
        for (s, k) in RANGED
        for v in _bad_values(RANGES[s, k][0], RANGES[s, k][1])
    ],
)
def test_absurd_durations_are_refused(
    tmp_path: Path, section: str, key: str, value: object
) -> None:
    p = write(tmp_path, f"[{section}]\n{key} = {_toml(value)}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p.resolve()) in msg and f"[{section}] {key}" in msg, msg
    lo, hi, _ = RANGES[section, key]
    assert "out of range" in msg and f"= {value!r}" in msg, msg
    assert f"from {format_duration(lo)} to {format_duration(hi)}" in msg, msg


@pytest.mark.parametrize(("section", "key"), RANGED)
def test_the_ends_of_each_range_are_accepted(tmp_path: Path, section: str, key: str) -> None:
    lo, hi, example = RANGES[section, key]
    for value in (lo, hi, example, format_duration(hi)):
        c = load_config(write(tmp_path, f"[{section}]\n{key} = {_toml(value)}\n"))
        got = getattr(getattr(c, section), key)
        assert got == parse_duration(value), (value, got)


@pytest.mark.parametrize("value", [0, -1, "0", "1KB", "100", "2PB", math.nan, math.inf, "lots"])
def test_absurd_sizes_are_refused(tmp_path: Path, value: object) -> None:
    p = write(tmp_path, f"[store]\nmax_size = {_toml(value)}\n")
    with pytest.raises(ConfigError, match=r"\[store\] max_size"):
        load_config(p)


def test_sizes_at_the_ends_are_accepted(tmp_path: Path) -> None:
    for value, size in (("1MiB", 1 << 20), ("4GB", 4 * 10**9), ("1PB", 10**15)):
        c = load_config(write(tmp_path, f'[store]\nmax_size = "{value}"\n'))
        assert c.store.max_size == size


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1m30s", 90.0), ("1h30m", 5400.0), ("2h0m5s", 7205.0), ("1d12h", 129600.0), ("1m 30s", 90.0)],
)
def test_compound_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("bad", ["1m30", "m30s", "1x30s", "30s1", "nan", "inf", "1e9s"])
def test_bad_compound_durations(bad: str) -> None:
    with pytest.raises(ConfigError, match="expected a duration"):
        parse_duration(bad)


@pytest.mark.parametrize(
    "body",
    [
        "[sources]\npoll_interval = nan\n",
        "[alerts]\nresolve_after = nan\n",
        "[store]\nkeep = inf\n",
        "[sources]\npoll_interval = 1e-9\n",
    ],
)
def test_watch_exits_78_on_an_absurd_value(tmp_path: Path, body: str) -> None:
    (tmp_path / "logs").mkdir()
    p = write(
        tmp_path, f'[sources]\npaths = ["{tmp_path / "logs"}"]\n' * ("sources" not in body) + body
    )
    r = CliRunner().invoke(cli, ["watch", "--config", str(p), "--db", str(tmp_path / "nw.db")])
    assert r.exit_code == 78, r.output
    key = body.split("\n")[1].split(" =")[0]
    assert str(p.resolve()) in r.output and key in r.output and "out of range" in r.output


def test_watch_process_exits_78_instead_of_spinning(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    p = write(tmp_path, f'[sources]\npaths = ["{tmp_path / "logs"}"]\npoll_interval = nan\n')
    r = subprocess.run(
        [*NANWATCH, "watch", "--config", str(p), "--db", str(tmp_path / "nw.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 78, r.stderr
    assert "[sources] poll_interval = nan: out of range" in r.stderr
    assert "from 100ms to 1h" in r.stderr
