"""A tiny real mmengine training on CPU whose loss turns NaN at a known iteration.

Usage: python mmengine_train.py WORK_DIR POISON_INDEX [EPOCHS]

Sample POISON_INDEX (0-based) of a 16-sample dataset carries an inf feature; with batch size 1
and no shuffling it is iteration POISON_INDEX + 1 of epoch 1, where the loss becomes NaN.
"""

from __future__ import annotations

import math
import sys

import torch
from mmengine.dataset import DefaultSampler  # noqa: F401 - registers the sampler
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch.utils.data import Dataset


class Toy(Dataset):  # type: ignore[type-arg]
    def __init__(self, poison: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(16, 4, generator=g)
        self.y = torch.randn(16, 1, generator=g)
        if poison >= 0:
            self.x[poison, 0] = math.inf

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mode: str = "tensor"):  # type: ignore[override]
        out = self.fc(x)
        if mode == "loss":
            return {"loss": torch.nn.functional.mse_loss(out, y) * 0 + (out - y).pow(2).mean()}
        return out


def main() -> None:
    work_dir, poison = sys.argv[1], int(sys.argv[2])
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    runner = Runner(
        model=Net(),
        work_dir=work_dir,
        train_dataloader=dict(
            dataset=Toy(poison),
            sampler=dict(type="DefaultSampler", shuffle=False),
            batch_size=1,
            num_workers=0,
            collate_fn=dict(type="default_collate"),
        ),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)),
        train_cfg=dict(by_epoch=True, max_epochs=epochs),
        default_hooks=dict(
            logger=dict(type="LoggerHook", interval=1),
            checkpoint=dict(type="CheckpointHook", interval=1),
        ),
        randomness=dict(seed=0),
    )
    runner.train()


if __name__ == "__main__":
    main()
