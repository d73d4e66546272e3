"""`nanwatch demo`: the seed case replayed live while `watch` follows it."""

from __future__ import annotations

import datetime as _dt
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import click

from ._common import handle_errors, out_color, out_width, setup_logging


@click.command()
@click.option(
    "--speed",
    type=float,
    default=30.0,
    show_default=True,
    help="How much faster than real time the runs are replayed (0: without pauses).",
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
    """Replay the case nanwatch exists for into a fresh database in a temporary folder (never
    your own database), detecting and printing as it goes:

    \b
    1. run A: an 8-rank DINO training on NPUs; rank 3 runs out of memory in validation and
       the seven other ranks die in HCCL timeouts (EI0002) 30 minutes later;
    2. run B: the same experiment relaunched with validation off: every step is 3.3x slower,
       and the loss turns NaN on rank 6 first;
    3. the annotation file is checked for images that reach the model with empty labels.

    Incidents are printed as they are detected; at the end `nanwatch incidents` is shown,
    with the commands to explore the database further. Long waits are compressed. The replay
    reads and correlates at fixed points, so it tells the same story every time.

    \b
    Example:
      nanwatch demo
      nanwatch demo --speed 300 --dir /tmp/nanwatch-demo
    """
    setup_logging(verbose, quiet_default=True)
    base = directory or Path(tempfile.mkdtemp(prefix="nanwatch-demo-"))
    pause: Callable[[float], None] | None = None
    if speed > 0:
        pause = lambda seconds: time.sleep(min(seconds / speed, MAX_PAUSE))  # noqa: E731
    replay(base, sys.stdout, pause=pause, width=out_width(), color=out_color())


MAX_PAUSE = 1.0  # real seconds a quiet stretch (the 1800 s before a timeout) lasts at most


def replay(
    base: Path,
    out: TextIO,
    *,
    pause: Callable[[float], None] | None = None,
    width: int | None = None,
    color: bool = False,
) -> Path:
    """The demo: write both runs under ``base`` in a fixed order, read and correlate them at
    fixed points (:meth:`TrainingRun.feed`), print what the console sink prints, then the
    incidents table and the dataset check. ``pause(simulated seconds)`` paces it; returns
    the database's path."""
    from ..config import Config
    from ..correlate.dataset import check
    from ..daemon.pipeline import Pipeline
    from ..demo.simulate import TrainingRun, demo_scenario
    from ..events import format_utc
    from ..notify.console import ConsoleSink
    from ..notify.outbox import Sender
    from ..query import list_incidents
    from ..store import Store
    from .tables import incidents_table

    base.mkdir(parents=True, exist_ok=True)
    db_path = base / "nanwatch.db"
    run_a, run_b = demo_scenario(base)
    run_a.work_dir.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    say(f"nanwatch demo: database {db_path}")
    say(f"nanwatch demo: watching {run_a.work_dir}")
    store = Store.open(db_path)
    sink = ConsoleSink(out, color=color)
    # a scan-like pipeline (no watcher thread, no waits that depend on the clock) stepped by
    # the replay itself: the same bytes are read and correlated at the same points every time
    pipe = Pipeline(Config(), store, [str(run_a.work_dir)], live=False, sinks=[sink])
    sender = Sender(str(store.path), [sink])
    reader = Store.open(db_path, readonly=True)

    last = [0.0]

    def stepper(run: TrainingRun) -> Callable[[float], None]:
        def at_point(t: float) -> None:
            if pause is not None:
                pause(max(0.0, t - last[0]))
            last[0] = t
            # lines read now count as read at the replay's simulated time, not the clock's
            pipe.now_utc = lambda: format_utc((run.start + _dt.timedelta(seconds=t)).timestamp())
            pipe.step()
            sender.deliver_due(reader)
            pipe._record(sender.drain_results())

        return at_point

    try:
        say(f"\n==> Run A ({run_a.timestamp}): 8 ranks train; validation starts after epoch 2")
        run_a.feed(stepper(run_a))
        last[0] = 0.0
        say(f"\n==> Run B ({run_b.timestamp}): relaunched with validation off")
        run_b.feed(stepper(run_b))
        pipe.tracker.close()
        incidents = list_incidents(reader)
    finally:
        reader.close()
        store.close()
    say("\n$ nanwatch incidents")
    say(incidents_table(incidents, width=width, color=color) if incidents else "No incidents.")

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
    return db_path


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
