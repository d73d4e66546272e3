"""systemd/: the unit verifies with systemd's own tools; the example config covers every key."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanwatch.config import (
    _SCHEMA,
    FLEET_PASSWORD_CREDENTIAL,
    SLACK_TOKEN_CREDENTIAL,
    SLACK_WEBHOOK_CREDENTIAL,
    load_config,
    tomllib,
)

from ..conftest import ROOT

UNIT = ROOT / "systemd" / "nanwatch.service"
SYSUSERS = ROOT / "systemd" / "nanwatch.sysusers"
EXAMPLE = ROOT / "systemd" / "nanwatch.toml"


def settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def installed_copy(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart pointing at the nanwatch installed in this environment."""
    exe = Path(sys.executable).parent / "nanwatch"
    assert exe.exists(), f"{exe}: nanwatch is not installed in this environment"
    unit = tmp_path / "nanwatch.service"
    unit.write_text(text.replace("/usr/local/bin/nanwatch", str(exe)))
    return unit


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_the_unit_verifies_cleanly(tmp_path: Path) -> None:
    text = UNIT.read_text()
    assert text.count("/usr/local/bin/nanwatch") == 1
    result = verify(installed_copy(tmp_path, text))
    # systemd-analyze exits 0 on unknown or malformed settings: silence is the real pass
    assert result.returncode == 0 and not result.stdout + result.stderr, result
    # ... which it is not for a unit with a typo
    broken = verify(installed_copy(tmp_path, text.replace("PrivateTmp=", "PrivateTpm=")))
    assert "Unknown key 'PrivateTpm'" in broken.stdout + broken.stderr


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_the_fleet_unit_verifies_cleanly(tmp_path: Path) -> None:
    text = (ROOT / "systemd" / "nanwatch-fleet.service").read_text()
    assert "nanwatch fleet --config" in text and "LoadCredential=fleet-password" in text
    unit = installed_copy(tmp_path, text)
    unit = unit.rename(unit.with_name("nanwatch-fleet.service"))
    result = verify(unit)
    assert result.returncode == 0 and not result.stdout + result.stderr, result


@pytest.mark.skipif(not shutil.which("systemd-sysusers"), reason="needs systemd-sysusers")
def test_the_service_user_is_created_by_sysusers(tmp_path: Path) -> None:
    # verify does not resolve User=; the shipped sysusers.d entry is what makes it exist
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run(
        ["systemd-sysusers", f"--root={root}", str(SYSUSERS)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    unit = settings(UNIT.read_text())
    (user,) = unit["User"]
    (group,) = unit["Group"]
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (root / "etc/passwd").read_text().splitlines()
    }
    groups = {line.split(":")[0] for line in (root / "etc/group").read_text().splitlines()}
    assert user in passwd and group in groups
    assert passwd[user][5] == "/var/lib/nanwatch" and passwd[user][6].endswith("nologin")


def test_the_unit_says_what_the_service_relies_on() -> None:
    s = settings(UNIT.read_text())
    assert s["Type"] == ["notify"] and s["Restart"] == ["on-failure"]
    assert s["StateDirectory"] == ["nanwatch"] and s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert float(s["WatchdogSec"][0].rstrip("s")) >= 10
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "read-only",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
    }.items():
        assert s[key] == [value], key
    # the credentials the code reads, with a non-fatal empty default each
    loaded = {v.split(":")[0] for v in s["LoadCredential"]}
    defaults = {v.split(":")[0] for v in s["SetCredential"]}
    assert (
        loaded
        == defaults
        == {
            SLACK_TOKEN_CREDENTIAL,
            SLACK_WEBHOOK_CREDENTIAL,
            FLEET_PASSWORD_CREDENTIAL,
        }
    )
    (execstart,) = s["ExecStart"]
    assert re.fullmatch(
        r"/usr/local/bin/nanwatch watch --quiet --config /etc/nanwatch/\S+", execstart
    )


def test_the_example_config_loads_and_documents_every_key(tmp_path: Path) -> None:
    config = load_config(EXAMPLE)
    assert config.store.keep == 90 * 86400 and config.metrics.listen == "127.0.0.1:9464"
    # uncommented, every example line is valid and together they cover the whole schema
    uncommented = re.sub(r"(?m)^# ((?:[a-z_]+ = |\[[a-z]+\]).*)$", r"\1", EXAMPLE.read_text())
    full = tmp_path / "full.toml"
    # the webhook keys are the alternative to the bot token: valid without them
    full.write_text(re.sub(r"(?m)^webhook_url(?:_file)? = .*\n", "", uncommented))
    load_config(full)
    data = tomllib.loads(uncommented)
    for section, keys in _SCHEMA.items():
        present = data if section == "" else data.get(section, {})
        assert section == "" or section in data, section
        missing = set(keys) - set(present)
        assert not missing, f"[{section}] lacks {missing}"
