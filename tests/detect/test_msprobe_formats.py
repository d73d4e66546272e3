"""msprobe monitor output: names, file recognition, rows, dumps; real samples and own fixtures."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.detect.msprobe.dump import classify_alert
from nanwatch.detect.msprobe.names import locate, maybe_squashed, parse_tag, suffix_matches
from nanwatch.detect.msprobe.reader import MonitorReader
from nanwatch.detect.msprobe.rows import layout, parse_row
from nanwatch.sources.monitor import classify, folder_time
from nanwatch.store import Store
from nanwatch.stream import StreamState

from ..conftest import ROOT

FORMATS = Path(__file__).parent.parent / "fixtures" / "msprobe_formats"


def _samples() -> Path | None:
    for base in (ROOT.parent / "shared", ROOT.parent.parent / "shared"):
        if (base / "msprobe-samples" / "README.md").is_file():
            return base / "msprobe-samples"
    return None


SAMPLES = _samples()
needs_samples = pytest.mark.skipif(SAMPLES is None, reason="shared msprobe samples not present")


def scan(db: Path, *paths: Path) -> Pipeline:
    store = Store.open(db)
    try:
        pipe = Pipeline(Config(), store, [str(p) for p in paths])
        pipe.scan()
        return pipe
    finally:
        store.close()


def events(db: Path) -> list[dict[str, Any]]:
    """Tensor findings (msprobe CSV rows, dumps, alert lines); the training script's own
    `loss nan` prints are detected too, by the text rules, and left out here."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT rank, step, fields, key, offset FROM events ORDER BY id")
        out = [
            {"rank": r, "step": s, "key": k, "offset": o, **json.loads(f)} for r, s, f, k, o in rows
        ]
    finally:
        conn.close()
    return [e for e in out if "via" in e]


def incident(db: Path) -> dict[str, Any]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT origin, detail FROM incidents WHERE kind='nan'").fetchall()
    finally:
        conn.close()
    assert len(rows) == 1, rows
    return {"origin": json.loads(rows[0][0]), "detail": json.loads(rows[0][1])}


# -- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "tag", "module", "role"),
    [
        ("module.embedding.weight", "grad_unreduced", "embedding", "param"),
        (
            "module.module.layers.3.attn.q_proj.bias",
            "grad_reduced",
            "layers.3.attn.q_proj",
            "param",
        ),
        (
            "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.mlp.weight",
            "exp_avg",
            "layers.0.mlp",
            "param",
        ),
        ("1:module.decoder.norm.gamma", "param_updated", "decoder.norm", "param"),
        ("embedding.weight.exp_avg_sq", "exp_avg_sq", "embedding", "param"),
        ("cls_token", "grad_unreduced", "", "param"),
        ("module.embedding.input", "actv_grad", "embedding", "input"),
        ("module.layers.0.output_1", "actv", "layers.0", "output"),
        (".output_1", "actv_grad", "", "output"),
        ("module.output", "actv_grad", "", "output"),
        ("layers.1.grad_input.0", "actv_grad", "layers.1", "input"),
        (".grad_output.1", "actv_grad", "", "output"),
        ("0:module.embedding.weight:1/rank1/acc_grad", None, "embedding", "param"),
    ],
)
def test_names_map_to_modules(name: str, tag: str | None, module: str, role: str) -> None:
    where = locate(name, tag)
    assert (where.module, where.role) == (module, role)


def test_tags_and_squashed_names() -> None:
    t = parse_tag("0:module.embedding.input:1/rank6/actv_grad")
    assert t is not None and (t.vpp, t.name, t.micro_step, t.rank, t.tag) == (
        0,
        "module.embedding.input",
        1,
        6,
        "actv_grad",
    )
    assert parse_tag("0:module.fc.weight/rank0/pre_grad").tag == "grad_unreduced"  # type: ignore[union-attr]
    assert parse_tag("0:module.fc.weight/rank0/post_grad").tag == "grad_reduced"  # type: ignore[union-attr]
    assert maybe_squashed("layers.3.attn.weight") and not maybe_squashed("backbone.conv1.weight")
    full = [
        "model.encoder.layers.3.attn.weight",
        "model.decoder.layers.3.attn.weight",
        "x.alayers.3.attn.weight",
    ]
    assert suffix_matches("layers.3.attn.weight", full) == full[:2]


# -- files ---------------------------------------------------------------------------------------


def test_monitor_files_are_recognised_by_place_and_name() -> None:
    d = "/o/monitor_output/Nov30_15-48-51-rank1-de3ab572"
    mf = classify(f"{d}/grad_unreduced_3-5.csv")
    assert mf is not None and (mf.kind, mf.family, mf.rank, mf.start, mf.end) == (
        "csv",
        "grad_unreduced",
        1,
        3,
        5,
    )
    part = classify(f"{d}/actv_grad_0-0_part_2.csv")
    assert part is not None and part.part == 2 and part.base_csv == "actv_grad_0-0.csv"
    assert classify(f"{d}/exp_avg_sq_0-2.csv").family == "exp_avg_sq"  # type: ignore[union-attr]
    assert classify(f"{d}/stack_info.csv").kind == "ignore"  # type: ignore[union-attr]
    assert classify(f"{d}/other_0-0.csv").kind == "ignore"  # type: ignore[union-attr]
    assert classify("/o/monitor_output/anomaly_detected/rank7/anomaly.json").kind == "anomaly"  # type: ignore[union-attr]
    assert classify("/o/monitor_output/anomaly_detected/anomaly_analyse.json").kind == "ignore"  # type: ignore[union-attr]
    assert classify("/o/monitor_output/module_struct/rank0/module_struct.json").kind == "ignore"  # type: ignore[union-attr]
    v2 = classify("/o/v2/rank_3/weight_grad_step2-2.csv")
    assert v2 is not None and (v2.version, v2.family, v2.rank) == (2, "weight_grad", 3)
    # ordinary files, even with similar names, stay text
    assert classify("/o/logs/grad_unreduced_3-5.csv") is None
    assert classify(f"{d}/train.log") is None
    # the year is the latest one that puts the folder's creation before its mtime
    dec_2026 = 1796083200.0  # 2026-12-01 00:00 UTC
    t = folder_time("Nov30_15-48-51-rank1-de3ab572", dec_2026)
    assert t is not None and t == pytest.approx(1796024931.0)  # 2026-11-30 07:48:51 UTC
    # a folder named on 31 December and written into on 2 January is last year's
    jan_2027 = 1798848000.0  # 2027-01-02 00:00 UTC
    t = folder_time("Dec31_23-59-00-rank0-de3ab572", jan_2027)
    assert t == pytest.approx(1798732740.0)  # 2026-12-31 15:59:00 UTC
    # the same name in a folder last written in 2029 is 2029's
    dec_2029 = 1891209600.0  # 2029-12-06 00:00 UTC
    t = folder_time("Nov30_15-48-51-rank1-de3ab572", dec_2029)
    assert t == pytest.approx(1890719331.0)  # 2029-11-30 07:48:51 UTC


# -- rows ----------------------------------------------------------------------------------------

HEADER = (
    "vpp_stage",
    "name",
    "step",
    "micro_step",
    "norm",
    "min",
    "max",
    "mean",
    "nans",
    "zeros",
    "shape",
    "dtype",
)


def test_rows_placeholder_real_finite_inf() -> None:
    lay = layout(HEADER, 1)
    assert lay is not None
    verdict, _ = parse_row(
        lay, "0,module.embedding.input,3,0,nan,nan,nan,nan,nan,nan,nan,nan", "actv_grad"
    )
    assert verdict == "placeholder"
    verdict, f = parse_row(
        lay,
        '0,module.embedding.output,3,0,nan,nan,nan,nan,16.0,0.0,"[4, 4, 8]",torch.float32',
        "actv_grad",
    )
    assert verdict == "nonfinite" and f is not None
    assert (f.tensor, f.tag, f.module, f.role, f.shape, f.dtype, f.micro_step) == (
        "module.embedding.output",
        "actv_grad",
        "embedding",
        "output",
        [4, 4, 8],
        "torch.float32",
        0,
    )
    assert f.stats["nans"] == 16 and f.stats["norm"] == "nan" and f.value == "nan"
    verdict, _ = parse_row(
        lay, '0,.output_0,3,0,0.42,-0.18,0.07,0.0,0.0,0.0,"[4, 4]",torch.float32', "actv_grad"
    )
    assert verdict == "finite"
    verdict, f = parse_row(
        lay, '0,layers.0.output,3,0,inf,-1.0,inf,inf,0,0.0,"[4, 8]",torch.float16', "actv"
    )
    assert verdict == "nonfinite" and f is not None and f.value == "inf"
    verdict, _ = parse_row(lay, "0,broken,row", "actv")
    assert verdict == "bad"


def test_empty_tensors_and_infinities() -> None:
    lay = layout(HEADER, 1)
    assert lay is not None
    # msprobe writes NaN min/max/mean for a tensor with no elements: not a NaN, but a clue
    verdict, f = parse_row(
        lay, '0,module.label_embedding.input,7,0,0.0,nan,nan,nan,0,nan,"[0]",torch.int64', "actv"
    )
    assert verdict == "empty" and f is not None and (f.value, f.shape) == ("empty", [0])
    # +inf and -inf: the mean is NaN, the NaN count says there is none
    verdict, f = parse_row(
        lay, '0,fc.output,7,0,inf,-inf,inf,nan,0,0.0,"[3]",torch.float32', "actv"
    )
    assert verdict == "nonfinite" and f is not None and f.value == "inf"
    verdict, f = parse_row(
        lay, '0,fc.output,7,0,inf,-inf,-1.0,-inf,0,0.0,"[3]",torch.float32', "actv"
    )
    assert f is not None and f.value == "-inf"


def test_alert_lines_are_bounded_per_rank_and_tag(tmp_path: Path) -> None:
    esc = "\x1b"
    lines = [
        f"2026-12-01 10:00:09 (3120) [rank 2] [INFO] {esc}[93m> Rule AnomalyNan reports anomaly "
        f"signal in ('0:module.blocks.{i}.weight/rank2/post_grad', 'norm') at step 5, current "
        f"value nan, history mean 0.5.{esc}[0m\n"
        for i in range(600)
    ]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "stdout.log").write_text("".join(lines))
    scan(tmp_path / "db", tmp_path / "logs")
    evs = events(tmp_path / "db")
    assert len(evs) == 512 and {e["tag"] for e in evs} == {"grad_reduced"}
    assert evs[0]["tensor"] == "module.blocks.0.weight"


def test_old_layout_without_shape_column() -> None:
    lay = layout(("vpp_stage", "name", "step", "norm", "min", "max", "mean"), 1)
    assert lay is not None
    # parameters never have placeholders (a None gradient is not written): a real NaN
    verdict, f = parse_row(lay, "0,module.fc.weight,9,nan,nan,nan,nan", "grad_unreduced")
    assert verdict == "nonfinite" and f is not None and f.shape is None
    # an all-NaN activation row cannot be told from a placeholder there: never a finding
    verdict, _ = parse_row(lay, "0,module.fc.input,9,nan,nan,nan,nan", "actv_grad")
    assert verdict == "placeholder"


@pytest.mark.parametrize(
    ("op", "value", "history", "raw", "real"),
    [
        ("mean", "nan", "0.0013", "acc_grad", True),
        ("norm", "inf", "0.2", "actv", True),
        ("zeros", "nan", "nan", "actv_grad", False),  # placeholder
        ("nans", "nan", "0.0", "actv_grad", False),  # placeholder (its NaN count is NaN)
        ("norm", "nan", "nan", "actv_grad", False),  # placeholder or NaN since earlier
        ("norm", "1.5e12", "0.2", "acc_grad", False),  # threshold on a finite value
        ("norm", None, None, "acc_grad", True),  # pre-8.1 text: parameters only
        ("norm", None, None, "actv_grad", False),
    ],
)
def test_alerts_tell_placeholders_from_nans(
    op: str, value: str | None, history: str | None, raw: str, real: bool
) -> None:
    assert classify_alert(op, value, history, raw)[0] is real


# -- own fixtures ----------------------------------------------------------------------------


def test_part_files_take_the_header_of_their_first_part(tmp_path: Path) -> None:
    scan(tmp_path / "db", FORMATS / "v1_part")
    evs = events(tmp_path / "db")
    assert [e["tensor"] for e in evs] == [
        "layers.1.input",
        "layers.0.input",
        "layers.0.output",
        "embedding.output",
    ]
    assert all(e["tag"] == "actv_grad" and e["step"] == 5 and e["rank"] == 0 for e in evs)
    part = FORMATS / "v1_part" / "Dec01_10-00-00-rank0-0a1b2c3d" / "actv_grad_5-5_part_1.csv"
    assert evs[0]["offset"] == part.read_bytes().index(b"0,layers.1.input,")
    assert evs[0]["shape"] == [4, 4, 8] and evs[0]["after_finite"] is True


def test_old_layout_and_alert_lines_and_dumps(tmp_path: Path) -> None:
    scan(tmp_path / "db", FORMATS / "v1_old", FORMATS / "alerts.log", FORMATS / "dump")
    evs = events(tmp_path / "db")
    by_via: dict[str, list[dict[str, Any]]] = {}
    for e in evs:
        by_via.setdefault(e["via"], []).append(e)
    (old,) = by_via["csv"]
    assert (old["tensor"], old["rank"], old["step"], old["shape"]) == (
        "module.dn_query_generator.label_embedding.weight",
        6,
        1520,
        None,
    )
    # alert lines: no placeholder, no NaN-history repeat, one event per tensor and statistic kept
    assert [(e["tensor"], e["tag"]) for e in by_via["alert"]] == [
        ("layers.1.input", "actv_grad"),
        ("layers.1.weight", "grad_unreduced"),
        ("layers.1.weight", "grad_reduced"),
    ]
    # dump entries: keyed by their own key; placeholders and the threshold alert left out
    dump = {(e["tensor"], e["tag"]): e for e in by_via["anomaly"]}
    assert set(dump) == {
        ("layers.1.input", "actv_grad"),
        ("layers.1.weight", "grad_unreduced"),
        ("layers.1.bias", "grad_unreduced"),
        ("layers.0.weight", "grad_reduced"),  # the pre-8.1 message: a parameter, so kept
        ("layers.1.weight", "param_updated"),
    }
    unreduced = dump[("layers.1.weight", "grad_unreduced")]
    assert unreduced["key"] == "0:layers.1.weight/rank0/acc_grad_step_5_call_22"
    assert (
        unreduced["call_id"] == 22 and dump[("layers.1.weight", "param_updated")]["call_id"] is None
    )
    assert all(e["offset"] == 0 for e in by_via["anomaly"])


def test_monitor_v2_rows(tmp_path: Path) -> None:
    scan(tmp_path / "db", FORMATS / "v2")
    evs = events(tmp_path / "db")
    got = {(e["tensor"], e["tag"]) for e in evs}
    assert got == {
        ("layers.0.grad_input.0", "actv_grad"),
        ("embedding.grad_output.0", "actv_grad"),
        ("layers.0.weight", "grad_unreduced"),
        ("embedding.weight", "grad_unreduced"),
        ("embedding.weight", "grad_reduced"),
        ("layers.0.weight", "grad_reduced"),
    }
    assert {e["rank"] for e in evs} == {1} and {e["step"] for e in evs} == {7}
    o = incident(tmp_path / "db")["origin"]
    assert (o["rank"], o["step"], o["phase"], o["module"]) == (1, 7, "backward", "layers.0")
    assert o["first_param"]["tensor"] == "layers.0.weight"


# -- tailing, torn reads, idempotence -----------------------------------------------------------

ROW_OK = "0,module.fc.bias,{s},0.1,-0.1,0.1,0.0,0,0.0,[4],torch.float32\n"
ROW_NAN = '0,module.fc.weight,{s},nan,nan,nan,nan,8,0.0,"[4, 8]",torch.float32\n'
GRAD_HEADER = "vpp_stage,name,step,norm,min,max,mean,nans,zeros,shape,dtype\n"


def test_half_written_row_is_never_parsed(tmp_path: Path) -> None:
    d = tmp_path / "run" / "monitor_output" / "Dec01_10-00-00-rank3-0a1b2c3d"
    d.mkdir(parents=True)
    f = d / "grad_unreduced_0-9.csv"
    whole = ROW_NAN.format(s=4)
    f.write_text(GRAD_HEADER + ROW_OK.format(s=4) + whole[:20])
    db = tmp_path / "db"
    scan(db, tmp_path / "run")
    assert events(db) == []
    with f.open("a") as fh:
        fh.write(whole[20:])
    scan(db, tmp_path / "run")
    scan(db, tmp_path / "run")
    (ev,) = events(db)
    assert (ev["tensor"], ev["rank"], ev["step"], ev["shape"]) == ("module.fc.weight", 3, 4, [4, 8])
    assert ev["offset"] == len(GRAD_HEADER) + len(ROW_OK.format(s=4))


def test_torn_dump_is_retried_never_fatal(tmp_path: Path) -> None:
    d = tmp_path / "run" / "monitor_output" / "anomaly_detected" / "rank0"
    d.mkdir(parents=True)
    dump = d / "anomaly.json"
    full = (FORMATS / "dump" / "anomaly_detected" / "rank0" / "anomaly.json").read_text()
    dump.write_text(full[: len(full) // 2])  # caught in the middle of msprobe's rewrite
    db = tmp_path / "db"
    pipe = scan(db, tmp_path / "run")
    assert events(db) == [] and pipe.counters()["msprobe_json_retries"] >= 1
    with dump.open("r+") as fh:  # rewritten in place, as msprobe does
        fh.truncate(0)
        fh.write(full)
    scan(db, tmp_path / "run")
    n = len(events(db))
    assert n == 5
    data = json.loads(full)
    data["0:layers.2.weight/rank0/acc_grad_step_6_call_30"] = {
        "rank": 0,
        "step": 6,
        "call_id": 30,
        "tag_name": "0:layers.2.weight/rank0/acc_grad",
        "message": "Rule AnomalyNan reports anomaly signal in ('0:layers.2.weight/rank0/acc_grad', "
        "'mean') at step 6, current value nan, history mean 0.01.",
    }
    with dump.open("r+") as fh:
        fh.truncate(0)
        fh.write(json.dumps(data, indent=1))
    scan(db, tmp_path / "run")
    scan(db, tmp_path / "run")
    assert len(events(db)) == n + 1
    # a relaunch starts the same file afresh (same inode here): its entries are new findings,
    # even those whose keys repeat the first launch's
    with dump.open("r+") as fh:
        fh.truncate(0)
        fh.write("{}")
    scan(db, tmp_path / "run")
    with dump.open("r+") as fh:
        fh.truncate(0)
        fh.write(full)
    scan(db, tmp_path / "run")
    assert len(events(db)) == 2 * n + 1


def test_event_volume_is_bounded(tmp_path: Path) -> None:
    """Every tensor NaN at every step for 100 steps: full first steps, then log-spaced samples."""
    d = tmp_path / "run" / "monitor_output" / "Dec01_10-00-00-rank0-0a1b2c3d"
    d.mkdir(parents=True)
    rows = [
        f'0,module.l{i}.weight,{{s}},nan,nan,nan,nan,8,0.0,"[4, 8]",torch.float32\n'
        for i in range(50)
    ]
    for s in range(10, 110):
        (d / f"grad_reduced_{s}-{s}.csv").write_text(
            GRAD_HEADER + "".join(r.format(s=s) for r in rows)
        )
    db = tmp_path / "db"
    scan(db, tmp_path / "run")
    steps = [e["step"] for e in events(db)]
    assert steps.count(10) == 50 and steps.count(11) == 50
    assert sorted(set(steps)) == [10, 11, 12, 13, 17, 25, 41, 73]
    assert len(steps) == 106
    # a restart (new reader) keeps counting instead of starting over
    for s in range(110, 140):
        (d / f"grad_reduced_{s}-{s}.csv").write_text(
            GRAD_HEADER + "".join(r.format(s=s) for r in rows)
        )
    scan(db, tmp_path / "run")
    assert sorted({e["step"] for e in events(db)})[-1] == 137  # the 128th NaN step


# -- the shared real samples ------------------------------------------------------------------


@needs_samples
def test_real_single_process_sample(tmp_path: Path) -> None:
    assert SAMPLES is not None
    run = tmp_path / "single"
    shutil.copytree(SAMPLES / "single", run)
    db = tmp_path / "db"
    scan(db, run)
    evs = events(db)
    assert evs and all(e["step"] >= 2 for e in evs)
    assert not [e for e in evs if e["tensor"] in (".input", "embedding.input")]
    assert {e["via"] for e in evs} == {"csv", "anomaly", "alert"}
    inc = incident(db)
    o = inc["origin"]
    # the sample's NaN comes from an auxiliary loss term on the model's second output
    assert (o["rank"], o["step"], o["micro_step"], o["tag"], o["tensor"]) == (
        0,
        2,
        1,
        "actv_grad",
        ".output_1",
    )
    assert o["module"] is None and "arrives from the loss" in inc["detail"]["root_cause"]
    assert o["first_param"] == {
        "tensor": "embedding.weight",
        "tag": "grad_unreduced",
        "shape": [16, 8],
        "step": 2,
    }


@needs_samples
def test_real_v2_and_struct_samples(tmp_path: Path) -> None:
    assert SAMPLES is not None
    db = tmp_path / "db"
    scan(db, SAMPLES / "v2", SAMPLES / "struct")
    evs = events(db)
    assert evs and {e["via"] for e in evs} == {"csv"}
    assert {e["tag"] for e in evs} >= {"actv_grad", "grad_reduced", "exp_avg", "param_updated"}
    assert min(e["step"] for e in evs) == 2
    o = incident(db)["origin"]
    assert (o["step"], o["tensor"], o["module"]) == (2, ".grad_output.1", None)


@needs_samples
def test_reader_alone_on_real_rows() -> None:
    assert SAMPLES is not None
    f = next((SAMPLES / "single" / "monitor_output").glob("*-rank0-*/grad_unreduced_0-2.csv"))
    data = f.read_bytes()
    reader = MonitorReader()
    state = StreamState()
    cut = data.index(b"\n", len(data) // 2) + 1
    first, _ = reader.feed(data[:cut], 0, state, str(f))
    rest, _ = reader.feed(data[cut:], cut, state, str(f))
    evs = first + rest
    assert [(e.fields["tensor"], e.step, e.fields["micro_step"]) for e in evs] == [
        ("embedding.weight", 2, 1)
    ]
    assert evs[0].offset == data.index(b"0,embedding.weight,2,1,nan")
    assert state.line_no == data.count(b"\n")
