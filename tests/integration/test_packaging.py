"""parsers/ and alerts/ ship inside the wheel and load the same from a checkout and a wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import nanwatch
from nanwatch.detect import load_rules
from nanwatch.detect.resources import data_dir

from ..conftest import ROOT


def test_checkout_and_editable_install_find_the_data() -> None:
    assert data_dir("parsers") == ROOT / "parsers"
    assert data_dir("alerts") == ROOT / "alerts"


def test_public_surface_is_honest() -> None:
    for name in nanwatch.__all__:
        assert getattr(nanwatch, name) is not None
    assert "Pipeline" in nanwatch.__all__ and "load_rules" in nanwatch.__all__


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
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
    (built,) = dist.glob("nanwatch-*.whl")
    return built


@pytest.mark.slow
def test_wheel_ships_and_loads_the_data(wheel: Path, tmp_path: Path) -> None:
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
        "import nanwatch.detect.resources as r, nanwatch.detect as d; "
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


# The daemon's own dependencies (pyproject's `dependencies`), as importable names: a training
# image that installs the companion with --no-deps has none of them.
RUNTIME = (
    "click",
    "regex",
    "ahocorasick_rs",
    "watchdog",
    "slack_sdk",
    "prometheus_client",
)


PIP_INSTALL = (sys.executable, "-m", "pip", "install", "--no-deps", "-q")


def _venv(path: Path, *, wheel: Path | None, stack: Path | None) -> Path:
    """A fresh virtual environment (no pip, nothing installed), with the wheel installed
    without its dependencies and/or the training stack on its path; returns its python."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    if wheel is not None:
        subprocess.run(
            [*PIP_INSTALL, "--target", purelib, str(wheel)],
            check=True,
            capture_output=True,
            timeout=300,
        )
    if stack is not None:
        (Path(purelib) / "training-stack.pth").write_text(f"{stack}\n")
    return python


def _training_stack(tmp: Path) -> Path:
    """What a training image holds: this environment's packages (torch, mmengine and their
    requirements) without nanwatch and without the daemon's dependencies, as symlinks."""
    mmengine = pytest.importorskip("mmengine")
    site = Path(mmengine.__file__).resolve().parent.parent
    stack = tmp / "stack"
    stack.mkdir()
    for entry in site.iterdir():
        name = entry.name.split("-")[0].split(".")[0].lower()
        if entry.suffix == ".pth" or "nanwatch" in name or "editable" in name:
            continue
        if name in RUNTIME or name == "slack":
            continue
        (stack / entry.name).symlink_to(entry)
    return stack


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "TZ": "UTC"}
    return subprocess.run(
        [str(python), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=240
    )


_ABSENT = (
    "import importlib.util as u, sys\n"
    f"missing = [m for m in {RUNTIME!r} if u.find_spec(m) is not None]\n"
    "assert not missing, missing\n"
)


@pytest.mark.slow
def test_the_companion_needs_only_the_standard_library(wheel: Path, tmp_path: Path) -> None:
    python = _venv(tmp_path / "venv", wheel=wheel, stack=None)
    script = _ABSENT + (
        "assert u.find_spec('mmengine') is None and u.find_spec('torch') is None\n"
        "import nanwatch\n"
        "from nanwatch import probe\n"
        "probe.announce(work_dir='.')\n"
        "print(nanwatch.__version__)\n"
    )
    got = _run(python, "-c", script, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == nanwatch.__version__
    assert got.stderr.startswith("NANWATCH-FACTS {")


# A tiny model and dataset for a real mmengine Runner, registered where `type=` finds them.
_TOY = """
import torch
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS


@DATASETS.register_module()
class NanwatchToySet(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "y": torch.ones(1)}


@MODELS.register_module()
class NanwatchToyNet(BaseModel):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y, mode="tensor"):
        out = self.fc(x)
        return {"loss": (out - y).pow(2).mean()} if mode == "loss" else out
"""
_TRAIN = """
import sys
import toy_parts
from mmengine.config import Config
from mmengine.runner import Runner

cfg = Config.fromfile(sys.argv[1])
cfg.work_dir = sys.argv[2]
Runner.from_cfg(cfg).train()
print("TRAINED")
"""
_TOY_CONFIG = """
model = dict(type="NanwatchToyNet")
train_dataloader = dict(
    dataset=dict(type="NanwatchToySet"),
    sampler=dict(type="DefaultSampler", shuffle=False),
    batch_size=2,
    num_workers=0,
    collate_fn=dict(type="default_collate"),
)
optim_wrapper = dict(optimizer=dict(type="SGD", lr=0.01))
train_cfg = dict(by_epoch=True, max_epochs=1)
default_hooks = dict(logger=dict(type="LoggerHook", interval=1))
"""


def readme_configs() -> dict[str, str]:
    """The README's mmengine config snippets: plain, inheriting, optional."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    hooks = [b for b in blocks if "NanwatchHook" in b]
    assert len(hooks) == 3, hooks
    return dict(zip(("plain", "inherit", "optional"), hooks))


@pytest.mark.slow
@pytest.mark.e2e
def test_the_readme_config_trains_with_and_without_nanwatch(wheel: Path, tmp_path: Path) -> None:
    stack = _training_stack(tmp_path)
    job = tmp_path / "job"
    job.mkdir()
    (job / "toy_parts.py").write_text(_TOY)
    (job / "train.py").write_text(_TRAIN)
    optional = job / "optional.py"
    optional.write_text(_TOY_CONFIG + readme_configs()["optional"])
    # allow_failed_imports alone, the hook always listed: what the README warns about
    unguarded = job / "unguarded.py"
    unguarded.write_text(
        _TOY_CONFIG
        + 'custom_imports = dict(imports=["nanwatch.integrations.mmengine"], '
        + "allow_failed_imports=True)\n"
        + 'custom_hooks = [dict(type="NanwatchHook")]\n'
    )

    slim = _venv(tmp_path / "slim", wheel=wheel, stack=stack)
    got = _run(slim, "-c", _ABSENT + "import mmengine, nanwatch.integrations.mmengine", cwd=job)
    assert got.returncode == 0, got.stderr
    got = _run(slim, str(job / "train.py"), str(optional), str(tmp_path / "w1"), cwd=job)
    assert got.returncode == 0 and "TRAINED" in got.stdout, got.stderr[-3000:]
    out = got.stdout + got.stderr  # rank 0 prints through mmengine's logger, on stdout
    assert "NANWATCH-FACTS {" in out and "NANWATCH-STAGE {" in out

    bare = _venv(tmp_path / "bare", wheel=None, stack=stack)
    got = _run(bare, str(job / "train.py"), str(optional), str(tmp_path / "w2"), cwd=job)
    assert got.returncode == 0 and "TRAINED" in got.stdout, got.stderr[-3000:]
    out = got.stdout + got.stderr
    assert "failed to import and is ignored" in out and "NANWATCH-" not in out
    got = _run(bare, str(job / "train.py"), str(unguarded), str(tmp_path / "w3"), cwd=job)
    assert got.returncode != 0 and "NanwatchHook is not in the" in got.stderr


def test_readme_configs_keep_what_the_base_config_declared(tmp_path: Path) -> None:
    mmengine_config = pytest.importorskip("mmengine.config")
    (tmp_path / "base.py").write_text(
        'custom_imports = dict(imports=["json"], allow_failed_imports=False)\n'
        'custom_hooks = [dict(type="EMAHook", momentum=0.0002)]\n'
    )
    snippets = readme_configs()

    def load(name: str, body: str) -> tuple[list[str], list[str]]:
        path = tmp_path / f"{name}.py"
        path.write_text(body)
        # the merge is what is tested here; importing the hook would import torch
        cfg = mmengine_config.Config.fromfile(str(path), import_custom_modules=False)
        return [h["type"] for h in cfg.custom_hooks], list(cfg.custom_imports["imports"])

    base_line = '_base_ = ["../dino/dino-4scale_r50_8xb2-12e_coco.py"]\n'
    assert base_line in snippets["inherit"]
    inherit = snippets["inherit"].replace(base_line, '_base_ = ["./base.py"]\n')
    assert load("inherit", inherit) == (
        ["EMAHook", "NanwatchHook"],
        ["json", "nanwatch.integrations.mmengine"],
    )
    # the plain lines under a _base_ replace its lists: why the README shows the form above
    plain = '_base_ = ["./base.py"]\n' + snippets["plain"]
    assert load("plain", plain) == (["NanwatchHook"], ["nanwatch.integrations.mmengine"])
    # nanwatch is importable here: the optional form lists the hook
    assert load("optional", snippets["optional"]) == (
        ["NanwatchHook"],
        ["nanwatch.integrations.mmengine"],
    )
