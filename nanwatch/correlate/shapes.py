"""Parameter shapes -> module names, from a checkpoint (read by ``checkpoint``, never torch).

A NaN finding often names a tensor vaguely (msprobe's squashed names) but always gives its
shape; the checkpoint of the same run says which parameters have that shape. During a run the
:class:`ShapeResolver` takes ``[shapes] checkpoint`` or the newest checkpoint in the run's folder
(mmengine's ``last_checkpoint`` first), indexes it once per (path, size, mtime), and gives the
candidate modules for a name and shape.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from .._dc import dataclass
from ..detect.msprobe.names import param_key, suffix_matches
from ..errors import SourceError
from ..sources.monitor import RANK_DIR, V2_RANK_DIR
from .checkpoint import read_checkpoint, read_with_torch, state_dict_of

log = logging.getLogger("nanwatch.shapes")

CHECKPOINT_EXTS = (".pth", ".pt", ".ckpt", ".bin", ".safetensors", ".tar")
_MAX_CANDIDATES = 20


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    dtype: str | None = None

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "module": self.module}


def index_checkpoint(
    path: str | os.PathLike[str], *, allow_torch: bool = False
) -> list[ParamShape]:
    """Every parameter (and buffer) of the model in a checkpoint, with its shape."""
    try:
        tree = read_checkpoint(path)
    except SourceError:
        if not allow_torch:
            raise
        tree = read_with_torch(os.fspath(path))
    return [ParamShape(k, v.shape, v.dtype) for k, v in state_dict_of(tree).items()]


def parse_shape(text: str) -> tuple[int, ...]:
    """'80,256' / '[80, 256]' / '80x256' -> (80, 256)."""
    t = text.strip().strip("[]()").replace("x", ",").replace("×", ",")
    try:
        return tuple(int(x) for x in t.split(",") if x.strip())
    except ValueError:
        raise SourceError(f"--shape {text!r}: expected integers such as 80,256") from None


# -- the index and its use during a run --------------------------------------------------------


class ShapeIndex:
    def __init__(self, path: str, params: list[ParamShape]) -> None:
        self.path = path
        self.params = params
        self._by_shape: dict[tuple[int, ...], list[ParamShape]] = {}
        self._by_key: dict[str, list[ParamShape]] = {}
        for p in params:
            self._by_shape.setdefault(p.shape, []).append(p)
            self._by_key.setdefault(param_key(p.name), []).append(p)

    def with_shape(self, shape: Iterable[int]) -> list[ParamShape]:
        return list(self._by_shape.get(tuple(shape), []))

    def resolve(self, tensor: str, shape: list[int] | None) -> dict[str, Any] | None:
        """Candidate modules for a tensor named vaguely (or not found) but with a known shape."""
        want = tuple(shape) if shape is not None else None
        exact = self._by_key.get(param_key(tensor), [])
        if any(want is None or p.shape == want for p in exact):
            return None  # the name itself is in the checkpoint: nothing to guess
        names = [p.name for p in self.params if want is None or p.shape == want]
        by_suffix = suffix_matches(tensor, names)
        if by_suffix:
            cands = [p for p in self.params if p.name in set(by_suffix)]
            why = "name tail and shape"
        elif want is not None:
            cands = self.with_shape(want)
            why = "shape"
        else:
            return None
        if not cands:
            return None
        return {
            "candidates": [p.module for p in cands[:_MAX_CANDIDATES]],
            "candidate_params": [p.name for p in cands[:_MAX_CANDIDATES]],
            "candidates_total": len(cands),
            "candidates_by": why,
            "ambiguous": len(cands) > 1,
            "checkpoint": self.path,
        }


_INDEX_CACHE: dict[tuple[str, int, int], ShapeIndex | None] = {}


def cached_index(path: str) -> ShapeIndex | None:
    """An index per checkpoint file (path, size, mtime); failures are cached too."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _INDEX_CACHE:
        try:
            _INDEX_CACHE[key] = ShapeIndex(path, index_checkpoint(path))
        except SourceError as e:
            log.info("%s", e)
            _INDEX_CACHE[key] = None
        while len(_INDEX_CACHE) > 32:
            _INDEX_CACHE.pop(next(iter(_INDEX_CACHE)))
    return _INDEX_CACHE[key]


_NO_CHECKPOINTS = frozenset(("anomaly_detected", "module_struct", "__pycache__", "node_modules"))


def _walk_checkpoints(folder: str, depth: int = 4, limit: int = 20000) -> Iterator[str]:
    stack = [(folder, 0)]
    seen = 0
    while stack:
        d, level = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            seen += 1
            if seen > limit:
                return
            try:
                if e.is_dir(follow_symlinks=False):
                    # monitor output holds thousands of CSVs and never a checkpoint
                    skip = e.name.startswith(".") or e.name in _NO_CHECKPOINTS
                    skip = skip or bool(RANK_DIR.match(e.name) or V2_RANK_DIR.match(e.name))
                    if level < depth and not skip:
                        stack.append((e.path, level + 1))
                elif e.name.endswith(CHECKPOINT_EXTS) and "optim" not in e.name:
                    yield e.path
            except OSError:
                continue


def find_checkpoint(folder: str) -> str | None:
    """The newest checkpoint in a run's folder (mmengine's ``last_checkpoint`` first)."""
    for marker in (os.path.join(folder, "last_checkpoint"),):
        try:
            with open(marker, encoding="utf-8") as f:
                named = f.read().strip()
        except OSError:
            continue
        named = named if os.path.isabs(named) else os.path.join(folder, named)
        if os.path.isfile(named):
            return named
    best: tuple[float, str] | None = None
    for p in _walk_checkpoints(folder):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if st.st_size < 64:
            continue
        if best is None or st.st_mtime > best[0]:
            best = (st.st_mtime, p)
    return best[1] if best else None


class ShapeResolver:
    """Candidate modules for shapes, from ``[shapes] checkpoint`` or the run's newest one."""

    RECHECK = 60.0  # seconds between looks for a newer checkpoint in a run's folder

    def __init__(self, checkpoint: str | None = None) -> None:
        self.checkpoint = checkpoint
        self._found: dict[str, tuple[float, str | None]] = {}

    def checkpoint_for(self, folder: str | None) -> str | None:
        if self.checkpoint:
            return self.checkpoint
        if not folder:
            return None
        now = time.monotonic()
        hit = self._found.get(folder)
        if hit is None or now - hit[0] > self.RECHECK:
            hit = (now, find_checkpoint(folder))
            self._found[folder] = hit
        return hit[1]

    def lookup(
        self, folder: str | None, tensor: str, shape: list[int] | None
    ) -> dict[str, Any] | None:
        path = self.checkpoint_for(folder)
        if path is None:
            return None
        index = cached_index(path)
        return index.resolve(tensor, shape) if index is not None else None
