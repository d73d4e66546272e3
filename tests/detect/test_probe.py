"""nanwatch.probe: what the training process prints, read back the way the daemon reads it."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nanwatch.detect import companion  # noqa: E402
from nanwatch.integrations.probe_facts import collect_facts, stats_fields  # noqa: E402
from nanwatch.probe import Probe, encode  # noqa: E402


def records(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for line in text.splitlines():
        rec = companion.parse(line)
        assert rec is not None, line
        out.append(rec)
    return out


def det_sample(i: int, n: int) -> Any:
    """A data sample the way mmdet's PackDetInputs builds one."""
    from mmengine.structures import BaseDataElement, InstanceData

    s = BaseDataElement(metainfo={"img_id": i, "img_path": f"data/coco/train2017/{i:012d}.jpg"})
    s.gt_instances = InstanceData(labels=torch.arange(n), bboxes=torch.ones(n, 4))
    return s


def test_empty_ground_truth_in_an_mmengine_batch() -> None:
    pytest.importorskip("mmengine")
    out = io.StringIO()
    p = Probe(stream=out, rank=6)
    batch = {
        "inputs": [torch.zeros(3)] * 4,
        "data_samples": [det_sample(i, i % 2) for i in range(4)],
    }
    assert p.check_batch(batch, epoch=3, iter=137, step=1387) == 2
    recs = records(out.getvalue())
    assert [r[0] for r in recs] == ["DATA", "DATA"]
    got = [(d["image"], d["image_id"], d["index"], d["rank"], d["iter"]) for _, d in recs]
    assert got == [
        ("data/coco/train2017/000000000000.jpg", 0, 0, 6, 137),
        ("data/coco/train2017/000000000002.jpg", 2, 2, 6, 137),
    ]
    assert all(d["reason"] == "empty ground truth" and d["batch_size"] == 4 for _, d in recs)


def test_a_batch_of_empty_samples_is_called_out() -> None:
    pytest.importorskip("mmengine")
    out = io.StringIO()
    p = Probe(stream=out)
    assert p.check_batch([det_sample(7, 0), det_sample(8, 0)], iter=5) == 2
    kinds = [d["reason"] for _, d in records(out.getvalue())]
    assert kinds == ["empty ground truth", "empty ground truth", "empty batch"]
    last = records(out.getvalue())[-1][1]
    assert last["images"] == [
        "data/coco/train2017/000000000007.jpg",
        "data/coco/train2017/000000000008.jpg",
    ]
    # healthy batches print nothing
    out.truncate(0)
    assert p.check_batch([det_sample(1, 2)], iter=6) == 0 and out.getvalue() == ""


@pytest.mark.parametrize(
    ("batch", "want"),
    [
        # torchvision detection loaders: (images, targets)
        (
            (
                [torch.zeros(3, 8, 8)] * 2,
                [
                    {"boxes": torch.ones(1, 4), "labels": torch.tensor([3]), "image_id": 11},
                    {
                        "boxes": torch.zeros(0, 4),
                        "labels": torch.zeros(0),
                        "image_id": torch.tensor([12]),
                    },
                ],
            ),
            [(None, 12)],
        ),
        # HF DETR: pixel_values + a list of target dicts with class_labels
        (
            {
                "pixel_values": torch.zeros(2, 3, 8, 8),
                "labels": [
                    {
                        "class_labels": torch.zeros(0, dtype=torch.long),
                        "image_id": torch.tensor([139]),
                    },
                    {"class_labels": torch.tensor([1, 2]), "image_id": torch.tensor([285])},
                ],
            },
            [(None, 139)],
        ),
        # mmdet 2.x: gt_labels beside img_metas
        (
            {
                "img": torch.zeros(2, 3, 8, 8),
                "gt_labels": [torch.tensor([0]), torch.tensor([])],
                "img_metas": [
                    {"filename": "a.jpg"},
                    {"filename": "b.jpg", "ori_filename": "b.jpg"},
                ],
            },
            [("b.jpg", None)],
        ),
    ],
    ids=["torchvision", "hf-detr", "mmdet2"],
)
def test_other_batch_layouts(batch: Any, want: list[tuple[Any, Any]]) -> None:
    out = io.StringIO()
    Probe(stream=out).check_batch(batch)
    got = [(d.get("image"), d.get("image_id")) for _, d in records(out.getvalue())]
    assert got == want


def test_labels_and_images_given_directly() -> None:
    out = io.StringIO()
    n = Probe(stream=out).check_batch(
        labels=[[1, 2], [], torch.zeros(0)], images=["x.jpg", "y.jpg", 33], step=9
    )
    assert n == 2
    got = [(d.get("image"), d.get("image_id"), d["step"]) for _, d in records(out.getvalue())]
    assert got == [("y.jpg", None, 9), (None, 33, 9)]


def test_ids_are_never_read_from_a_device() -> None:
    out = io.StringIO()
    target = {"labels": torch.zeros(0, device="meta"), "image_id": torch.zeros(1, device="meta")}
    assert Probe(stream=out).check_batch([target]) == 1
    ((_, d),) = records(out.getvalue())
    assert "image_id" not in d  # .item() would sync the device: left out


def test_data_lines_are_rate_limited_and_say_what_they_left_out() -> None:
    out = io.StringIO()
    now = [1000.0]
    p = Probe(stream=out, lines_per_minute=60 * 4, burst=1, clock=lambda: now[0])
    p.check_batch(labels=[[]], images=["a.jpg"])  # the burst
    p.check_batch(labels=[[]], images=["b.jpg"])  # no token yet: counted, not printed
    assert p.suppressed == 1
    now[0] += 0.125  # 4 lines a second: half a token, still none to spend
    p.check_batch(labels=[[]], images=["b2.jpg"])
    assert p.suppressed == 2
    now[0] += 0.125  # a whole token is back
    p.check_batch(labels=[[], [1]], images=["c.jpg", "d.jpg"])
    got = [(d["image"], d.get("suppressed")) for _, d in records(out.getvalue())]
    assert got == [("a.jpg", None), ("c.jpg", 2)]
    assert p.empty_samples == 4


def test_a_record_is_printed_once_per_console(tmp_path: Path) -> None:
    # mmengine's rank 0: its logger prints INFO on the console itself
    console = logging.getLogger("nanwatch-test-console")
    console.propagate = False
    handler = logging.StreamHandler(sys.stderr)
    console.addHandler(handler)
    console.setLevel(logging.INFO)
    out = io.StringIO()
    try:
        Probe(logger=console, stream=out).stage("val", "start")
    finally:
        console.removeHandler(handler)
    assert out.getvalue() == ""
    # other ranks: the logger writes a file (or nothing); stderr carries the line
    filed = logging.getLogger("nanwatch-test-file")
    filed.propagate = False
    fh = logging.FileHandler(tmp_path / "rank1.log")
    filed.addHandler(fh)
    filed.setLevel(logging.INFO)
    try:
        Probe(logger=filed, stream=out, rank=1).stage("val", "end")
    finally:
        filed.removeHandler(fh)
        fh.close()
    assert records(out.getvalue())[0][1]["event"] == "end"
    assert "NANWATCH-STAGE" in (tmp_path / "rank1.log").read_text()


def test_the_stage_is_what_the_loop_marked_never_a_default() -> None:
    out = io.StringIO()
    p = Probe(stream=out, rank=0)
    assert p.memory_summary()["stage"] is None  # an inference server is not training
    p.stage("val", "start")
    assert p.memory_summary()["stage"] == "val"
    p.stage("val", "end")  # validation inside training: training resumes
    assert p.memory_summary()["stage"] == "train"
    p.stage("test", "start")
    p.stage("test", "end")
    assert p.memory_summary()["stage"] is None


def test_a_record_stays_one_line() -> None:
    line = encode("DATA", {"image": "a\u2028b\nc\x85d/新.jpg", "reason": "empty ground truth"})
    assert len(line.splitlines()) == 1
    assert companion.parse(line) == (
        "DATA",
        {"image": "a\u2028b\nc\x85d/新.jpg", "reason": "empty ground truth"},
    )


def test_facts_from_the_environment() -> None:
    env = {
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "8",
        "SLURM_JOB_ID": "73105",
        "TORCHELASTIC_RUN_ID": "dino-73105",
        "MASTER_ADDR": "10.0.0.11",
        "MASTER_PORT": "29500",
        "MINDX_TASK_ID": "mindx-dino-0042",
        "MA_VJ_NAME": "ma-job-8f2c",
        "VC_TASK_INDEX": "1",
        "HCCL_EXEC_TIMEOUT": "3600",
        "HCCL_CONNECT_TIMEOUT": "1200",
        "NCCL_TIMEOUT": "soon",  # not a number: no fact
        "HCCL_DETERMINISTIC": "true",
    }
    f = collect_facts(work_dir="work_dirs/dino", environ=env)
    assert (f["rank"], f["local_rank"], f["world_size"]) == (6, 2, 8)
    assert f["job"] == {
        "slurm_job_id": "73105",
        "torchelastic_run_id": "dino-73105",
        "master_addr": "10.0.0.11",
        "master_port": 29500,
        "mindx_task_id": "mindx-dino-0042",
        "volcano_job_name": "ma-job-8f2c",
        "volcano_task_index": 1,
    }
    assert f["timeouts"] == {"HCCL_EXEC_TIMEOUT": 3600, "HCCL_CONNECT_TIMEOUT": 1200}
    assert f["determinism"]["HCCL_DETERMINISTIC"] == "true"
    assert f["work_dir"].endswith("work_dirs/dino")
    # without torch_npu in the process, CANN is unknown (and nothing imports it)
    assert "torch_npu" not in sys.modules
    assert "cann" not in f["versions"] and "torch_npu" not in f["versions"]
    assert f["versions"]["torch"] == torch.__version__
    assert f["device"] == {"type": "cpu"}
    told = companion.run_facts(json.loads(json.dumps(f)))
    assert "cann" not in told["versions"]  # no made-up version in runs.facts
    # ... but the run's facts say that it is unknown, and why
    assert "torch_npu is not imported" in told["unknown"]["cann"]


def test_process_group_timeout_and_backend_in_a_real_group(tmp_path: Path) -> None:
    script = (
        "import datetime, os, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
        "store = dist.TCPStore('127.0.0.1', 0, 1, True)\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1,"
        " timeout=datetime.timedelta(seconds=1234))\n"
        "from nanwatch import probe\n"
        "probe.announce()\n"
        "dist.destroy_process_group()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    ((kind, data),) = [r for r in map(companion.parse, proc.stderr.splitlines()) if r]
    assert kind == "FACTS"
    assert (data["rank"], data["world_size"], data["backend"]) == (0, 1, "gloo")
    assert data["timeouts"]["pg_timeout"] == 1234


def test_memory_summary_fields_from_allocator_stats() -> None:
    # the keys of torch.cuda.memory_stats() / torch.npu.memory_stats()
    stats = {
        "allocated_bytes.all.current": 61_312_548_864,
        "allocated_bytes.all.peak": 62_000_000_000,
        "reserved_bytes.all.current": 62_696_013_824,
        "reserved_bytes.all.peak": 62_696_013_824,
        "active_bytes.all.current": 61_312_548_864,
        "inactive_split_bytes.all.current": 1_383_464_960,
        "num_alloc_retries": 3,
        "num_ooms": 1,
        "segment.all.current": 412,
    }
    assert stats_fields(stats) == {
        "allocated": 61_312_548_864,
        "reserved": 62_696_013_824,
        "active": 61_312_548_864,
        "inactive_split": 1_383_464_960,
        "peak_allocated": 62_000_000_000,
        "peak_reserved": 62_696_013_824,
        "alloc_retries": 3,
        "ooms": 1,
    }


def test_uncaught_exception_prints_the_traceback_then_the_summary(tmp_path: Path) -> None:
    script = (
        "from nanwatch import probe\n"
        "probe.install_excepthook()\n"
        "probe.stage('val', 'start')\n"
        "raise RuntimeError('NPU out of memory. Tried to allocate 2.25 GiB (NPU 2; 60.96 GiB "
        "total capacity; 57.10 GiB already allocated; 57.10 GiB current active; 1.02 GiB free; "
        "58.39 GiB reserved in total by PyTorch)')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    tb = next(i for i, x in enumerate(lines) if x.startswith("Traceback"))
    mem = next(i for i, x in enumerate(lines) if x.startswith("NANWATCH-MEMORY"))
    assert tb < mem  # the usual report first, untouched
    data = companion.parse(lines[mem])
    assert data is not None and data[1]["oom"] is True and data[1]["stage"] == "val"
    # the daemon: one OOM report, in validation, from the traceback's own line
    from nanwatch.detect import Detector, StreamState, load_rules

    events, _ = Detector(load_rules()).feed(proc.stderr.encode(), 0, StreamState(), "rank2.log")
    assert [(e.kind, e.stage) for e in events] == [("oom", "val")]
    assert events[0].fields["rule"] != "companion.oom"
