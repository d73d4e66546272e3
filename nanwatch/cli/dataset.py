"""`nanwatch check-dataset`: images whose ground truth will be empty after filtering."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import emit_json, handle_errors, json_option
from ._progress import Progress


@click.command("check-dataset")
@click.option(
    "--classes",
    default=None,
    metavar="A,B,...",
    help="The configured classes (metainfo classes); default: every category in the file.",
)
@click.option(
    "--limit",
    type=int,
    default=50,
    show_default=True,
    help="How many images to list in the table (the JSON form lists them all).",
)
@json_option
@click.argument("annotations", type=click.Path(dir_okay=False, path_type=Path))
@handle_errors
def check_dataset(classes: str | None, limit: int, as_json: bool, annotations: Path) -> None:
    """List the images of a COCO annotation file whose ground truth will be empty after
    mmdet-style filtering, with the reason: no annotations, every category outside the
    classes, or only degenerate boxes (w < 1, h < 1, area <= 0, outside the image, crowd or
    ignored). Also counts the out-of-range annotations per category.

    Empty ground truth reaches the model as an empty gt_labels tensor; label embeddings (DINO /
    DN-DETR denoising queries) then get an empty input, which gives NaN in backward on
    CANN < 8.0.0.

    \b
    Examples:
      nanwatch check-dataset data/coco/annotations/instances_train2017.json
      nanwatch check-dataset train.json --classes person,car,bicycle --json | jq .reasons
    """
    from ..correlate.dataset import check
    from ..render import table

    names = [c.strip() for c in classes.split(",") if c.strip()] if classes else None
    size = annotations.stat().st_size if annotations.exists() else 0
    bar = Progress(size, f"Reading {annotations.name}", enabled=not as_json, unit="file")
    read = [0]

    def progress(n: int) -> None:
        read[0] += n
        bar.update(read[0], 1)

    try:
        report = check(annotations, names, progress=progress)
    finally:
        bar.close()
    if as_json:
        emit_json(report.as_json())
        return
    n = len(report.empty_gt_images)
    click.echo(
        f"{annotations}: {report.images_total} images, {report.annotations_total} "
        f"annotations; {n} image(s) will have empty ground truth."
    )
    if report.unknown_classes:
        click.echo("Classes not in the file's categories: " + ", ".join(report.unknown_classes))
    for reason, count in report.reasons.items():
        click.echo(f"  {count:>7}  {reason}")
    if report.empty_gt_images:
        rows = [
            (i["image_id"], i["file_name"], i["reason"]) for i in report.empty_gt_images[:limit]
        ]
        click.echo(table(rows, ["IMAGE_ID", "FILE", "REASON"], max_width=70))
        if n > limit:
            click.echo(f"... {n - limit} more (--limit, or --json for all)")
    if report.out_of_range:
        click.echo("Out-of-range annotations per category:")
        click.echo(
            table(
                [
                    (c["category_id"], c["name"] or "(not in categories)", c["annotations"])
                    for c in report.out_of_range
                ],
                ["CATEGORY_ID", "NAME", "ANNOTATIONS"],
            )
        )
