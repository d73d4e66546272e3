"""A tiny DDP training on CPU (gloo) watched by msprobe's TrainerMon; one rank's backward goes NaN.

    python msprobe_train.py OUT --ranks 2 --steps 6 --nan-rank 1 --nan-step 3 --nan-in embedding

Writes msprobe's monitor output to OUT/monitor_output (CSV per step, anomaly dumps, alert lines
on stdout). At step --nan-step, on rank --nan-rank only, the module --nan-in produces NaN in its
own backward while its forward and the gradient arriving at its output stay finite:

- ``embedding``: the batch repeats a token where an auxiliary term takes sqrt(|w[a] - w[b]|^2)
  (weight 0): sqrt at 0 has an infinite derivative, so the weight gradient is NaN (like an
  embedding whose backward breaks on an empty input);
- ``layers.1``: the same kind of term on the layer's output columns, so its input, weight and
  bias gradients are NaN;
- ``forward``: layers.0's output becomes NaN in the forward pass.

``--acc N`` accumulates gradients over N micro-batches (the NaN comes in the last one) and
``--mbs`` asks msprobe for per-micro-batch unreduced gradients; ``--no-xy`` turns activation
monitoring off.

DDP's all-reduce then spreads the NaN to every rank's reduced gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--nan-step", type=int, default=3)
    p.add_argument("--nan-in", choices=("embedding", "layers.1", "forward"), default="embedding")
    p.add_argument("--acc", type=int, default=1, help="micro-batches per step")
    p.add_argument("--mbs", action="store_true", help="monitor_mbs_grad")
    p.add_argument("--no-xy", action="store_true", help="no activation monitoring")
    p.add_argument("--squash", action="store_true", help="msprobe's old squash_name naming")
    p.add_argument("--per-record", type=int, default=1, help="step_count_per_record")
    p.add_argument("--pause", type=float, default=0.0, help="seconds between steps")
    p.add_argument("--port", type=int, default=29533)
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> dict[str, object]:
    return {
        "targets": {},
        "xy_distribution": not args.no_xy,
        "all_xy": not args.no_xy,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "alert": {
            "rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1e10}}],
            "dump": True,
        },
        "format": "csv",
        "ops": ["norm", "min", "max", "mean", "nans", "zeros"],
        "eps": 1e-8,
        "ndigits": 8,
        "step_count_per_record": args.per_record,
        "squash_name": bool(args.squash),
        "monitor_mbs_grad": bool(args.mbs),
    }


def worker(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    from msprobe.pytorch import TrainerMon

    class Embedding(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out = super().forward(ids)
            d = (self.weight[ids[0, 0]] - self.weight[ids[0, 1]]).pow(2).sum()
            return out + 0.0 * torch.sqrt(d)

    class Linear(nn.Linear):
        poison = False
        poison_forward = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            if self.poison_forward:
                y = y * torch.tensor(float("nan"))
            d = ((y[..., 0] - y[..., 1]) * (0.0 if self.poison else 1.0)).pow(2).sum()
            return y + 0.0 * torch.sqrt(d)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = Embedding(16, 8)
            self.layers = nn.ModuleList([Linear(8, 8), Linear(8, 8)])
            self.output_layer = nn.Linear(8, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embedding(ids)
            for layer in self.layers:
                h = torch.tanh(layer(h))
            return self.output_layer(h.mean(dim=1))

    torch.manual_seed(0)
    model = DDP(Model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = TrainerMon(str(args.out / "monitor_config.json"), params_have_main_grad=False)
    mon.set_monitor(model, optimizer=opt, grad_acc_steps=args.acc)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        opt.zero_grad()
        for micro in range(args.acc):
            ids = torch.randint(0, 16, (4, 4), generator=gen)
            if ids[0, 0] == ids[0, 1]:
                ids[0, 1] = (ids[0, 0] + 1) % 16
            labels = torch.randint(0, 4, (4,), generator=gen)
            poisoned = rank == args.nan_rank and step == args.nan_step and micro == args.acc - 1
            if poisoned and args.nan_in == "embedding":
                ids[0, 1] = ids[0, 0]
            model.module.layers[1].poison = poisoned and args.nan_in == "layers.1"
            model.module.layers[0].poison_forward = poisoned and args.nan_in == "forward"
            loss = F.cross_entropy(model(ids), labels) / args.acc
            loss.backward()
        opt.step()
        # the framework's own numbering: iterations from 1 (msprobe counts steps from 0)
        print(f"[train] iter {step + 1} rank {rank} loss: {loss.item():.6f}", flush=True)
        if args.pause:
            time.sleep(args.pause)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "monitor_config.json").write_text(json.dumps(config(args), indent=1))
    os.environ["MONITOR_OUTPUT_DIR"] = str(args.out / "monitor_output")
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(args,), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1:])
