"""`nanwatch demo`: the seed case replayed live while `watch` follows it."""

from __future__ import annotations

import json
import random
import shlex
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

import click

from ._common import handle_errors, setup_logging


@click.command()
@click.option(
    "--speed",
    type=float,
    default=30.0,
    show_default=True,
    help="How much faster than real time the runs are replayed.",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the runs and the database (default: a new temporary folder).",
)
@click.option("-v", "--verbose", count=True, help="Show the daemon's log lines too.")
@handle_errors
def demo(speed: float, directory: Path | None, verbose: int) -> None:
    """Replay the case nanwatch exists for, while `watch` follows it on a fresh database in a
    temporary folder (never your own database):

    \b
    1. run A: an 8-rank DINO training on NPUs; rank 3 runs out of memory in validation and
       the seven other ranks die in HCCL timeouts (EI0002) 30 minutes later;
    2. run B: the same experiment relaunched with validation off: every step is 3.3x slower,
       and the loss turns NaN on rank 6 first;
    3. the annotation file is checked for images that reach the model with empty labels.

    Incidents are printed as they are detected; at the end `nanwatch incidents` is shown,
    with the commands to explore the database further. Long waits are compressed.

    \b
    Example:
      nanwatch demo
    """
    setup_logging(verbose, quiet_default=True)
    from ..config import Config
    from ..dataset import check
    from ..notify.console import ConsoleSink
    from ..pipeline import Pipeline
    from ..query import list_incidents
    from ..render import origin_text, ranks_text, table
    from ..simulate import demo_scenario
    from ..store import Store

    base = directory or Path(tempfile.mkdtemp(prefix="nanwatch-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    db_path = base / "nanwatch.db"
    run_a, run_b = demo_scenario(base)
    run_a.work_dir.mkdir(parents=True, exist_ok=True)
    say = click.echo
    say(f"nanwatch demo: database {db_path}")
    say(f"nanwatch demo: watching {run_a.work_dir}")

    store = Store.open(db_path)
    stop = threading.Event()
    ready = threading.Event()
    pipe = Pipeline(Config(), store, [str(run_a.work_dir)], live=True, sinks=[ConsoleSink()])
    watcher = threading.Thread(
        target=pipe.watch, args=(stop,), kwargs={"on_ready": ready.set}, name="nanwatch-watch"
    )
    watcher.start()
    try:
        ready.wait(30)
        say(f"\n==> Run A ({run_a.timestamp}): 8 ranks train; validation starts after epoch 2")
        run_a.replay(speed=speed, max_pause=1.0)
        _settle(db_path, sum(1 for _ in run_a.lines()))
        say(f"\n==> Run B ({run_b.timestamp}): relaunched with validation off")
        run_b.replay(speed=speed, max_pause=1.0)
        _settle(db_path, sum(1 for _ in run_a.lines()) + sum(1 for _ in run_b.lines()))
    finally:
        pipe.request_stop()
        watcher.join(30)
        store.close()

    reader = Store.open(db_path, readonly=True)
    try:
        incidents = list_incidents(reader.conn)
    finally:
        reader.close()
    say("\n$ nanwatch incidents")
    if incidents:
        say(
            table(
                [
                    (
                        i["id"],
                        i["status"],
                        i["kind"],
                        i["run"].rsplit("/", 1)[-1],
                        ranks_text(i["ranks"]),
                        i["event_count"],
                        origin_text(i["origin"]),
                    )
                    for i in incidents
                ],
                ["ID", "STATUS", "KIND", "RUN", "RANKS", "EVENTS", "ORIGIN"],
            )
        )
    else:
        say("No incidents.")

    annotations = base / "data" / "annotations" / "instances_train.json"
    empty = _annotations(annotations)
    say(f"\n$ nanwatch check-dataset {annotations} --classes person,car,bicycle")
    report = check(annotations, ["person", "car", "bicycle"])
    say(
        f"{report.images_total} images; {len(report.empty_gt_images)} will have empty ground "
        f"truth (expected {empty}):"
    )
    for reason, count in report.reasons.items():
        say(f"  {count:>5}  {reason}")
    for c in report.out_of_range:
        say(
            f"  category {c['category_id']} ({c['name']}): {c['annotations']} annotations "
            "outside the classes"
        )
    db_arg = shlex.quote(str(db_path))
    say(
        f"\nExplore it:\n  nanwatch incidents --json --db {db_arg}\n"
        f"  nanwatch show 1 --db {db_arg}\n  nanwatch events --kind nan --db {db_arg}"
    )


def _settle(db_path: Path, expected_lines: int, timeout: float = 15.0) -> None:
    """Wait until the daemon has committed the lines written so far (and printed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _committed_lines(db_path) >= expected_lines:
            break
        time.sleep(0.1)
    time.sleep(0.5)


def _committed_lines(db_path: Path) -> int:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        total = 0
        for (ctx,) in conn.execute("SELECT ctx FROM sources WHERE status = 'active'"):
            total += int(json.loads(ctx or "{}").get("line_no", 0))
        return total
    except sqlite3.Error:
        return 0
    finally:
        conn.close()


def _annotations(path: Path) -> int:
    """A small COCO file where a few images only carry classes outside the configured ones."""
    rng = random.Random(7)
    names = ["person", "car", "bicycle", "traffic light", "dog"]
    cats = [{"id": i + 1, "name": n} for i, n in enumerate(names)]
    images: list[dict[str, object]] = []
    anns: list[dict[str, object]] = []
    empty = 0
    for img in range(1, 201):
        images.append({"id": img, "file_name": f"{img:06d}.jpg", "width": 1333, "height": 800})
        out_of_range = img % 37 == 0  # only 'traffic light' / 'dog': outside the 3 classes
        degenerate = img % 53 == 0
        for _ in range(rng.randint(1, 3)):
            cat = rng.choice([4, 5]) if out_of_range else rng.randint(1, 3)
            w, h = (0.0, 12.0) if degenerate else (rng.uniform(20, 200), rng.uniform(20, 200))
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": img,
                    "category_id": cat,
                    "bbox": [rng.uniform(0, 1000), rng.uniform(0, 500), w, h],
                    "area": w * h,
                    "iscrowd": 0,
                }
            )
        empty += out_of_range or degenerate
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return empty
