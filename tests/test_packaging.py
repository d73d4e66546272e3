"""parsers/ and alerts/ ship inside the wheel and load the same from a checkout and a wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import nanwatch
from nanwatch.detect import load_rules
from nanwatch.resources import data_dir

from .conftest import ROOT


def test_checkout_and_editable_install_find_the_data() -> None:
    assert data_dir("parsers") == ROOT / "parsers"
    assert data_dir("alerts") == ROOT / "alerts"


def test_public_surface_is_honest() -> None:
    for name in nanwatch.__all__:
        assert getattr(nanwatch, name) is not None
    assert "Pipeline" in nanwatch.__all__ and "load_rules" in nanwatch.__all__


@pytest.mark.slow
def test_wheel_ships_and_loads_the_data(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("nanwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packs = sorted(p.name for p in (ROOT / "parsers").glob("*.toml"))
    for p in packs:
        assert f"nanwatch/_data/parsers/{p}" in names
    assert any(n.startswith("nanwatch/_data/alerts/") for n in names)
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    probe = (
        "import nanwatch.resources as r, nanwatch.detect as d; "
        "print(r.data_dir('parsers')); print(r.data_dir('alerts')); "
        "print(len(d.load_rules().rules))"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    ).stdout.split()
    assert out[0] == str(site / "nanwatch" / "_data" / "parsers")
    assert out[1] == str(site / "nanwatch" / "_data" / "alerts")
    assert int(out[2]) == len(load_rules().rules)
