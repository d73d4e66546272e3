from __future__ import annotations

from pathlib import Path

import pytest

from nanwatch.config import load_config, parse_duration
from nanwatch.errors import ConfigError


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
