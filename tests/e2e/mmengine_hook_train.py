"""A tiny real mmengine "detector" training on CPU with NanwatchHook, run by torchrun.

Usage: torchrun --nproc-per-node 2 mmengine_hook_train.py WORK_DIR

The config (``mmengine_hook_cfg.py``) turns the hook on with its two lines. The dataset has 40
samples built the way mmdet's ``PackDetInputs`` builds them: a data sample whose
``gt_instances.labels`` holds the labels and whose metainfo has ``img_path``/``img_id``.
Two images have empty ground truth. With 2 ranks, batch size 2 and no shuffling (mmengine's
DefaultSampler gives rank r the samples r, r+2, ...), rank r's iteration k holds samples
4(k-1)+r and 4(k-1)+r+2:

- sample 25 (EMPTY[0]) is rank 1's iteration 7, sample 34 (EMPTY[1]) rank 0's iteration 9;
- sample 36 (POISON) has a NaN feature: rank 0's iteration 10, where the loss turns NaN.

Validation follows the epoch (the hook marks its start and end).
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.dataset import DefaultSampler  # noqa: F401 - registers the sampler
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, METRICS, MODELS
from mmengine.runner import Runner
from mmengine.structures import BaseDataElement, InstanceData
from torch.utils.data import Dataset

N = 40
EMPTY = (25, 34)
POISON = 36


def image_path(i: int) -> str:
    return f"data/coco/train2017/{i:012d}.jpg"


@DATASETS.register_module()
class ToyDetDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 4, generator=g)
        self.x[POISON, 0] = math.nan

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, object]:
        n = 0 if i in EMPTY else 1 + i % 3
        sample = BaseDataElement(metainfo=dict(img_id=i, img_path=image_path(i)))
        sample.gt_instances = InstanceData(
            labels=torch.arange(n, dtype=torch.long), bboxes=torch.ones(n, 4)
        )
        return {"inputs": self.x[i], "data_samples": sample}


@MODELS.register_module()
class ToyDetector(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, inputs, data_samples=None, mode="tensor"):  # type: ignore[no-untyped-def]
        out = self.fc(torch.stack(inputs)).squeeze(-1)
        if mode != "loss":
            return out
        target = torch.tensor([float(len(s.gt_instances.labels)) for s in data_samples])
        return {"loss": (out - target).pow(2).mean()}


@METRICS.register_module()
class ToyCount(BaseMetric):
    """Validation after the epoch: the hook marks its start and end."""

    def process(self, data_batch, data_samples) -> None:  # type: ignore[no-untyped-def]
        self.results.append(len(data_samples))

    def compute_metrics(self, results: list[int]) -> dict[str, float]:
        return {"samples": float(sum(results))}


def main() -> None:
    work_dir = sys.argv[1]
    # CPU training: a gloo group made here (mmengine's pytorch launcher would pick a GPU)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    cfg = Config.fromfile(str(Path(__file__).with_name("mmengine_hook_cfg.py")))
    cfg.work_dir = work_dir
    cfg.launcher = "pytorch"
    cfg.env_cfg = dict(dist_cfg=dict(backend="gloo"))
    cfg.model_wrapper_cfg = dict(type="MMDistributedDataParallel", device_ids=None)
    Runner.from_cfg(cfg).train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
