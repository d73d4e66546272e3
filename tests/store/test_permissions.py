"""File modes: the database holds log lines, the token is a secret; one rule each, said alike
by `watch`, `doctor`, the unit and the README.

The reader tests run a real process as an ordinary uid (setpriv, as root) with or without a
supplementary group, against a real database in a folder of mode 0750.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.cli._doctor_services import check_slack
from nanwatch.config import load_config
from nanwatch.errors import ConfigError
from nanwatch.notify.slack_api import slack_settings
from nanwatch.store import files

from ..conftest import NANWATCH, ROOT, StartWatch
from ..sources.test_sources import nan_line

UNIT = ROOT / "systemd" / "nanwatch.service"
SETPRIV = shutil.which("setpriv")
AS_ROOT = os.geteuid() == 0
OTHER_GID = 4242  # a group no ordinary user of the test machine belongs to
NOBODY = 65534


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _umask_022() -> None:
    os.umask(0o022)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder other uids may enter (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="nw-perm-"))
    d.chmod(0o755)
    (d / "logs").mkdir()
    (d / "logs" / "rank0.log").write_text(nan_line(1))
    (d / "logs").chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# --- the token file -------------------------------------------------------------------------


def _slack_config(tmp_path: Path, token: Path) -> Path:
    cfg = tmp_path / "n.toml"
    cfg.write_text(
        f'[sources]\npaths = ["{tmp_path}"]\n'
        f'[slack]\nchannel = "#a"\nbase_url = "http://127.0.0.1:9/api/"\ntoken_file = "{token}"\n'
    )
    return cfg


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_watch_and_doctor_refuse_a_token_file_open_to_others_alike(
    tmp_path: Path, mode: int
) -> None:
    token = tmp_path / "slack-token"
    token.write_text("xoxb-1-2-3\n")
    token.chmod(mode)
    cfg = _slack_config(tmp_path, token)
    watch = CliRunner().invoke(cli, ["watch", "--config", str(cfg), "--db", str(tmp_path / "d")])
    assert watch.exit_code == 78, watch.output
    doctor = CliRunner().invoke(cli, ["doctor", "--config", str(cfg), "--db", str(tmp_path / "d")])
    assert doctor.exit_code == 1, doctor.output
    for out in (watch.output, doctor.output):
        flat = " ".join(out.split())
        assert f"chmod 600 {token}" in flat, out
        assert "0640" not in re.sub(r"mode 0\d{3}", "", flat), out
    assert str(token) in doctor.output and "fail" in doctor.output


def test_an_owner_only_token_file_passes_both(tmp_path: Path) -> None:
    token = tmp_path / "slack-token"
    token.write_text("xoxb-1-2-3\n")
    token.chmod(0o600)
    config = load_config(_slack_config(tmp_path, token))
    settings = slack_settings(config)  # what `watch` reads
    assert settings is not None and settings.token == "xoxb-1-2-3"
    findings = check_slack(config)  # what `doctor` says: only that Slack is not reachable
    assert [f.check for f in findings] == ["slack"] and "chmod" not in findings[0].message


def test_the_readme_and_the_messages_give_one_token_rule() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "chmod 0640" not in readme and "chmod 600" in readme
    with pytest.raises(ConfigError, match="chmod 600"):
        files_dir = Path(tempfile.mkdtemp())
        try:
            t = files_dir / "t"
            t.write_text("xoxb-x\n")
            t.chmod(0o640)
            from nanwatch.config import read_secret_file

            read_secret_file(str(t), key="[slack] token_file")
        finally:
            shutil.rmtree(files_dir)


# --- the database's modes -------------------------------------------------------------------


def test_a_per_user_database_is_private_under_umask_022(open_dir: Path) -> None:
    state = open_dir / "xdg"
    env = {k: v for k, v in os.environ.items() if k != "NANWATCH_DB"}
    env["XDG_STATE_HOME"] = str(state)
    subprocess.run(
        [*NANWATCH, "scan", str(open_dir / "logs")],
        env=env,
        preexec_fn=_umask_022,
        check=True,
        capture_output=True,
        timeout=60,
    )
    db = state / "nanwatch" / "nanwatch.db"
    assert _mode(state) == 0o700 and _mode(db.parent) == 0o700
    assert _mode(db) == 0o600
    for side in files.SIDE_FILES:
        p = Path(f"{db}{side}")
        if p.exists():
            assert _mode(p) == 0o600, p


def test_a_database_an_older_version_left_open_is_narrowed(tmp_path: Path) -> None:
    db = tmp_path / "private" / "nw.db"
    db.parent.mkdir(mode=0o700)
    subprocess.run(
        [*NANWATCH, "scan", "--db", str(db), str(tmp_path)], check=True, capture_output=True
    )
    old_lock = Path(f"{db}.lock")  # the lock file versions before the lock on the file itself made
    old_lock.touch()
    for p in (db, old_lock):
        p.chmod(0o644)
    r = CliRunner().invoke(cli, ["scan", "--db", str(db), str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert _mode(db) == 0o600 and _mode(old_lock) == 0o600


def test_the_unit_creates_what_the_rule_says() -> None:
    unit = UNIT.read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if re.match(r"^[A-Za-z]+=", line)
    )
    assert settings["Group"] == files.SERVICE_GROUP
    assert settings["StateDirectoryMode"] == "0750"
    umask = int(settings["UMask"], 8)
    # SQLite creates files 0644 less the umask; the store creates the database itself
    assert 0o644 & ~umask == 0o640 and 0o777 & ~umask == 0o750
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o750)
        assert files.file_mode(Path(d)) == 0o640
        os.chmod(d, 0o700)
        assert files.file_mode(Path(d)) == 0o600
        os.chmod(d, 0o1777)
        assert files.file_mode(Path(d)) == 0o600  # /tmp: nothing is passed on


needs_root = pytest.mark.skipif(
    not (AS_ROOT and SETPRIV), reason="needs root and setpriv to act as another uid"
)


def _as_nobody(*args: str, groups: list[int]) -> subprocess.CompletedProcess[str]:
    assert SETPRIV is not None
    prefix = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}"]
    prefix += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return subprocess.run(
        [*prefix, *NANWATCH, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/nonexistent"},
    )


@needs_root
def test_the_service_database_is_readable_by_its_group_only(
    open_dir: Path, start_watch: StartWatch
) -> None:
    state = open_dir / "state"
    state.mkdir(mode=0o750)
    os.chown(state, -1, OTHER_GID)
    db = state / "nanwatch.db"
    # ready: the writer holds the database in WAL mode, -wal and -shm included
    watch = start_watch(open_dir / "logs", db=db, preexec_fn=_umask_022)
    for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        assert _mode(p) == 0o640, p
        assert os.stat(p).st_gid == OTHER_GID, p
    member = _as_nobody("incidents", "--db", str(db), groups=[OTHER_GID])
    assert member.returncode == 0, member.stderr
    outsider = _as_nobody("incidents", "--db", str(db), groups=[])
    assert outsider.returncode != 0
    assert str(db) in outsider.stderr and "Traceback" not in outsider.stderr
    assert f"add yourself to group {OTHER_GID}" in outsider.stderr, outsider.stderr
    assert watch.stop() == 0
