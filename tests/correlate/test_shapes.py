"""`nanwatch shapes` and shape -> module candidates, on checkpoints saved by real torch."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nanwatch.correlate.shapes import ShapeResolver, find_checkpoint, index_checkpoint

from ..conftest import nanwatch

torch = pytest.importorskip("torch")
nn = torch.nn

DINO_80x256 = {
    "dn_query_generator.label_embedding.weight",
    *(f"bbox_head.cls_branches.{i}.weight" for i in range(7)),
}


class _Gen(nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.label_embedding = nn.Embedding(80, 256)


class _Head(nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.cls_branches = nn.ModuleList([nn.Linear(256, 80) for _ in range(7)])
        self.reg_branches = nn.ModuleList(
            [nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)) for _ in range(7)]
        )


class Dino(nn.Module):  # type: ignore[misc]
    """The shapes of a DINO detector's query side: one [80, 256] embedding, seven classifiers."""

    def __init__(self) -> None:
        super().__init__()
        self.dn_query_generator = _Gen()
        self.bbox_head = _Head()
        self.query_embedding = nn.Embedding(900, 256)
        self.level_embed = nn.Parameter(torch.zeros(4, 256))
        self.memory_trans_fc = nn.Linear(256, 256)
        self.proj = nn.Linear(80, 256)  # [256, 80]: the transpose must not match


def _adam_state(model: Any) -> dict[str, Any]:
    opt = torch.optim.Adam(model.parameters())
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()  # exp_avg/exp_avg_sq of shape [80, 256] too: optimizer state is not the model
    return dict(opt.state_dict())


class Marker:
    """Unpickling this would touch a file: a checkpoint's code must never run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def test_dino_like_checkpoint_lists_all_eight_and_nothing_else(tmp_path: Path) -> None:
    model = Dino()
    ckpt = tmp_path / "epoch_12.pth"
    marker = tmp_path / "code-ran"
    torch.save(
        {
            "meta": {"epoch": 12, "hook_msgs": {"last_ckpt": str(ckpt)}, "x": Marker(str(marker))},
            "state_dict": model.state_dict(),
            "optimizer": _adam_state(model),
        },
        ckpt,
    )
    out = nanwatch("shapes", str(ckpt), "--shape", "80,256", "--json").stdout
    rows = [json.loads(x) for x in out.splitlines()]
    assert {r["name"] for r in rows} == DINO_80x256
    assert len(rows) == 8
    assert all(
        r["shape"] == [80, 256] and r["module"] == r["name"][: -len(".weight")] for r in rows
    )
    assert not marker.exists()
    text = nanwatch("shapes", str(ckpt), "--shape", "[80, 256]").stdout
    assert "dn_query_generator.label_embedding" in text and "8 parameters share this shape" in text
    assert nanwatch("shapes", str(ckpt), "--shape", "3,3").stdout.startswith("No parameters")
    every = [json.loads(x) for x in nanwatch("shapes", str(ckpt), "--json").stdout.splitlines()]
    assert len(every) == len(model.state_dict())


@pytest.mark.parametrize("layout", ["plain", "lightning", "deepspeed", "legacy", "model_key"])
def test_checkpoint_layouts(tmp_path: Path, layout: str) -> None:
    model = Dino()
    sd = model.state_dict()
    ckpt = tmp_path / "model.ckpt"
    if layout == "plain":
        torch.save(sd, ckpt)
    elif layout == "lightning":
        torch.save(
            {
                "epoch": 3,
                "state_dict": {f"model.{k}": v for k, v in sd.items()},
                "optimizer_states": [_adam_state(model)],
                "hyper_parameters": {"lr": 1e-4},
            },
            ckpt,
        )
    elif layout == "deepspeed":
        torch.save({"module": sd, "buffer_names": [], "optimizer": None, "dp_world_size": 8}, ckpt)
    elif layout == "legacy":
        torch.save(sd, ckpt, _use_new_zipfile_serialization=False)
    else:
        torch.save({"model": sd, "optimizer": _adam_state(model), "epoch": 2}, ckpt)
    names = {
        p.name.removeprefix("model.") if layout == "lightning" else p.name
        for p in index_checkpoint(ckpt)
        if p.shape == (80, 256)
    }
    assert names == DINO_80x256


def test_safetensors_header(tmp_path: Path) -> None:
    header = {
        "label_embedding.weight": {"dtype": "F32", "shape": [80, 256], "data_offsets": [0, 81920]},
        "__metadata__": {"format": "pt"},
    }
    raw = json.dumps(header).encode()
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 81920)
    (p,) = index_checkpoint(f)
    assert (p.name, p.shape, p.module) == ("label_embedding.weight", (80, 256), "label_embedding")


def test_bad_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "half.pth"
    torch.save(Dino().state_dict(), bad)
    bad.write_bytes(bad.read_bytes()[:4000])  # still being written
    proc = nanwatch("shapes", str(bad), check=False)
    assert proc.returncode == 1 and str(bad) in proc.stderr
    proc = nanwatch("shapes", str(tmp_path / "nope.pth"), check=False)
    assert proc.returncode == 1 and "no such checkpoint" in proc.stderr


def test_the_daemon_side_never_imports_torch(tmp_path: Path) -> None:
    ckpt = tmp_path / "m.pth"
    torch.save({"state_dict": Dino().state_dict()}, ckpt)
    code = (
        "import sys; import nanwatch.daemon.pipeline; "
        "from nanwatch.correlate.shapes import ShapeResolver;"
        f"r = ShapeResolver({str(ckpt)!r}); c = r.lookup(None, 'layers.9.weight', [80, 256]);"
        "assert c and c['candidates_total'] == 8 and c['ambiguous'], c;"
        "assert 'torch' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_candidates_for_squashed_and_unknown_names(tmp_path: Path) -> None:
    class Two(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleDict(
                {"layers": nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])}
            )
            self.decoder = nn.ModuleDict(
                {"layers": nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])}
            )
            self.head = nn.Linear(8, 3)

    work = tmp_path / "work_dirs" / "exp"
    work.mkdir(parents=True)
    ckpt = work / "iter_100.pth"
    torch.save({"state_dict": Two().state_dict()}, ckpt)
    (work / "last_checkpoint").write_text(str(ckpt))
    assert find_checkpoint(str(work)) == str(ckpt)
    r = ShapeResolver()
    squashed = r.lookup(str(work), "layers.1.weight", [8, 8])
    assert squashed is not None and squashed["ambiguous"]
    assert squashed["candidates"] == ["encoder.layers.1", "decoder.layers.1"]
    assert r.lookup(str(work), "module.head.weight", [3, 8]) is None  # the name is known
    by_shape = r.lookup(str(work), "module.classifier.weight", [3, 8])
    assert by_shape is not None and by_shape["candidates"] == ["head"] and not by_shape["ambiguous"]


def test_nan_events_get_candidates_during_a_run(tmp_path: Path) -> None:
    from nanwatch.config import Config
    from nanwatch.daemon.pipeline import Pipeline
    from nanwatch.query import list_incidents
    from nanwatch.store import Store

    run = tmp_path / "run"
    rank = run / "monitor_output" / "Dec01_10-00-00-rank6-0a1b2c3d"
    rank.mkdir(parents=True)
    (rank / "grad_unreduced_1520-1520.csv").write_text(
        "vpp_stage,name,step,norm,min,max,mean,nans,zeros,shape,dtype\n"
        "0,module.bbox_head.cls_branches.5.bias,1520,0.1,-0.1,0.1,0.0,0,0.0,[80],torch.float32\n"
        '0,label_embedding.weight,1520,nan,nan,nan,nan,256,0.0,"[80, 256]",torch.float32\n'
    )
    torch.save({"state_dict": Dino().state_dict()}, run / "epoch_1.pth")
    store = Store.open(tmp_path / "db")
    try:
        Pipeline(Config(), store, [str(run)]).scan()
        (inc,) = list_incidents(store._conn)
    finally:
        store.close()
    o = inc["origin"]
    assert o["first_param"]["shape"] == [80, 256]
    assert o["candidates"] == ["dn_query_generator.label_embedding"]  # name tail and shape
    assert o["ambiguous"] is False
