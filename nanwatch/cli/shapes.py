"""`nanwatch shapes`: which parameters of a checkpoint have a shape (and so which modules)."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import emit_json, handle_errors, json_option


@click.command()
@click.option(
    "--shape",
    "shape",
    default=None,
    metavar="DIMS",
    help="Only parameters of this shape, e.g. 80,256 (also [80, 256] or 80x256).",
)
@json_option
@click.argument("checkpoint", type=click.Path(path_type=Path, dir_okay=False))
@handle_errors
def shapes(checkpoint: Path, shape: str | None, as_json: bool) -> None:
    """List a checkpoint's parameters with their shapes and modules.

    Reads plain state dicts and mmengine, Lightning and DeepSpeed checkpoints (also the legacy
    torch format and .safetensors) without loading tensors or running code from the file; the
    optimizer state is not listed. A NaN finding gives a tensor's shape: this says which modules
    it can belong to. --json prints one object per line: name, shape, module.

    \b
    Examples:
      nanwatch shapes work_dirs/dino/epoch_12.pth --shape 80,256
      nanwatch shapes model.safetensors --json | jq -r .module
    """
    from ..correlate.shapes import index_checkpoint, parse_shape
    from ..errors import SourceError

    if not checkpoint.exists():
        raise SourceError(f"{checkpoint}: no such checkpoint; check the path")
    params = index_checkpoint(checkpoint, allow_torch=True)
    if shape is not None:
        want = parse_shape(shape)
        params = [p for p in params if p.shape == want]
    if as_json:
        for p in params:
            emit_json(p.as_dict())
        return
    if not params:
        what = f"of shape [{shape}]" if shape else "at all"
        click.echo(f"No parameters {what} in {checkpoint}.")
        return
    from ..render import table

    rows = [(p.name, "[" + ", ".join(map(str, p.shape)) + "]", p.module) for p in params]
    click.echo(table(rows, ("name", "shape", "module")))
    if shape is not None and len(params) > 1:
        click.echo(f"{len(params)} parameters share this shape: the shape alone is ambiguous.")
