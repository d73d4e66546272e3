"""Parameter shapes -> module names, read from a checkpoint without torch.

A NaN finding often names a tensor only vaguely (msprobe's squashed names) but always gives its
shape; the checkpoint of the same run says which parameters have that shape. Reading it must
not load tensors, import torch (the daemon never does) or run code from the file, so the
pickle inside the checkpoint is read by an unpickler that knows only what torch writes for
tensors and replaces every other class by an inert stand-in:

- torch's zip format (``torch.save`` since 1.6: ``*/data.pkl`` + storages), also used by
  mmengine (``{'meta', 'state_dict', 'optimizer', ...}``), Lightning (``{'state_dict', ...}``),
  DeepSpeed (``mp_rank_00_model_states.pt``: ``{'module': ...}``) and plain state dicts;
- torch's legacy format (a sequence of pickles) and ``.safetensors`` (a JSON header).

Only if that fails, and torch is installed, does the CLI (never the daemon) fall back to
``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

import codecs
import io
import json
import logging
import os
import pickle
import struct
import time
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from .detect.msprobe.names import param_key, suffix_matches
from .errors import SourceError
from .sources.monitor import RANK_DIR, V2_RANK_DIR

log = logging.getLogger("nanwatch.shapes")

CHECKPOINT_EXTS = (".pth", ".pt", ".ckpt", ".bin", ".safetensors", ".tar")
MAX_PICKLE = 512 << 20
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
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


# -- the restricted unpickler -------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: str | None


class _Storage:
    def __init__(self, dtype: str | None) -> None:
        self.dtype = dtype


class _StorageType:
    def __init__(self, name: str) -> None:
        self.dtype = _STORAGE_DTYPES.get(name)


class _DType:
    def __init__(self, name: str) -> None:
        self.name = name


class _Opaque:
    """Stands in for any class the checkpoint names: accepts anything, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._items: dict[Any, Any] = {}
        self._state: Any = None

    def __setstate__(self, state: Any) -> None:
        self._state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self._items[key] = value

    def append(self, value: Any) -> None:
        self._items[len(self._items)] = value

    def extend(self, values: Iterable[Any]) -> None:
        for v in values:
            self.append(v)


class _ODict(dict[Any, Any]):
    """OrderedDict as pickled by torch (it sets a ``_metadata`` attribute)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
_OPAQUE_TYPES: dict[tuple[str, str], type] = {}


def _opaque(module: str, name: str) -> type:
    t = _OPAQUE_TYPES.get((module, name))
    if t is None:
        t = _OPAQUE_TYPES[(module, name)] = type(name, (_Opaque,), {"__module__": "stub"})
    return t


def _dtype_name(d: Any) -> str | None:
    if isinstance(d, _DType):
        return d.name
    return d.dtype if isinstance(d, (_Storage, _StorageType)) else None


def _shape_of(size: Any) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in size)
    except (TypeError, ValueError):
        return ()


def _rebuild_v2(storage: Any, offset: Any, size: Any, *rest: Any) -> _TensorMeta:
    return _TensorMeta(_shape_of(size), _dtype_name(storage))


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, rg: Any, hooks: Any,
                dtype: Any = None, *rest: Any) -> _TensorMeta:  # fmt: skip
    return _TensorMeta(_shape_of(size), _dtype_name(dtype) or _dtype_name(storage))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_meta(dtype: Any, size: Any, *rest: Any) -> _TensorMeta:
    return _TensorMeta(_shape_of(size), _dtype_name(dtype))


def _rebuild_wrapper(cls: Any, dtype: Any, size: Any, *rest: Any) -> _TensorMeta:
    return _TensorMeta(_shape_of(size), _dtype_name(dtype))


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
    if func in _REBUILD.values():
        return func(*args)
    return _opaque("torch", "Tensor")()


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    return cls() if isinstance(cls, type) and issubclass(cls, _Opaque) else _Opaque()


def _safe_getattr(obj: Any, name: str, *default: Any) -> Any:
    return _opaque("getattr", str(name))


_REBUILD: dict[str, Any] = {
    "_rebuild_tensor": lambda storage, offset, size, stride: _TensorMeta(
        _shape_of(size), _dtype_name(storage)
    ),
    "_rebuild_tensor_v2": _rebuild_v2,
    "_rebuild_tensor_v3": _rebuild_v3,
    "_rebuild_parameter": _rebuild_parameter,
    "_rebuild_parameter_with_state": _rebuild_parameter,
    "_rebuild_qtensor": _rebuild_v2,
    "_rebuild_meta_tensor_no_storage": _rebuild_meta,
    "_rebuild_wrapper_subclass": _rebuild_wrapper,
}
_SAFE: dict[str, Any] = {
    "collections.OrderedDict": _ODict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.slice": slice,
    "builtins.range": range,
    "builtins.complex": complex,
    "builtins.bytearray": bytearray,
    "builtins.getattr": _safe_getattr,
    "_codecs.encode": lambda text, enc="utf-8": codecs.encode(str(text), str(enc)),
    "copy_reg._reconstructor": _reconstructor,
    "copyreg._reconstructor": _reconstructor,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
    "torch._tensor._rebuild_from_type": _rebuild_from_type,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        module = {"__builtin__": "builtins"}.get(module, module)
        full = f"{module}.{name}"
        if full in _SAFE:
            return _SAFE[full]
        if module == "torch._utils" and name in _REBUILD:
            return _REBUILD[name]
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(name)
        if module == "torch" and name[:1].islower():
            return _DType(name)  # torch.float32 and friends
        return _opaque(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 2 and pid[0] == "storage":
            return _Storage(_dtype_name(pid[1]))
        return _Opaque()


def _unpickle(data: bytes | IO[bytes]) -> Any:
    f: IO[bytes] = io.BytesIO(data) if isinstance(data, bytes) else data
    return _Unpickler(f).load()


# -- checkpoint formats -------------------------------------------------------------------------


def read_checkpoint(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's object tree with tensors replaced by their shape and dtype."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise SourceError(f"{p}: cannot read the checkpoint ({e.strerror})") from None
    if p.endswith(".safetensors") or (
        len(head) >= 10 and head[8:10] == b'{"' and int.from_bytes(head[:8], "little") < 1 << 30
    ):
        return _read_safetensors(p)
    if zipfile.is_zipfile(p):
        return _read_zip(p)
    return _read_legacy(p)


def _read_zip(path: str) -> Any:
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            if not names:
                raise SourceError(f"{path}: a zip file without data.pkl: not a torch checkpoint")
            info = z.getinfo(min(names, key=len))
            if info.file_size > MAX_PICKLE:
                raise SourceError(f"{path}: data.pkl is {info.file_size} bytes; too big to index")
            data = z.read(info)
    except (zipfile.BadZipFile, OSError) as e:
        raise SourceError(
            f"{path}: not a readable checkpoint ({e}); is it still being written?"
        ) from None
    try:
        return _unpickle(data)
    except Exception as e:  # any malformed pickle: the file is data, not a crash
        raise SourceError(f"{path}: cannot read the checkpoint's index ({e})") from None


def _read_legacy(path: str) -> Any:
    try:
        # the pickles come first; the raw storages after them are never read
        with open(path, "rb") as f:
            if _unpickle(f) != _LEGACY_MAGIC:
                raise SourceError(f"{path}: not a torch checkpoint (neither zip nor legacy format)")
            _unpickle(f)  # protocol version
            _unpickle(f)  # sys info
            return _unpickle(f)
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"{path}: cannot read the checkpoint ({e})") from None


def _read_safetensors(path: str) -> dict[str, _TensorMeta]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise SourceError(f"{path}: not a readable safetensors file ({e})") from None
    return {
        k: _TensorMeta(_shape_of(v.get("shape", ())), str(v.get("dtype", "")).lower() or None)
        for k, v in header.items()
        if isinstance(v, dict) and "shape" in v
    }


def _as_mapping(obj: Any) -> Mapping[Any, Any] | None:
    if isinstance(obj, Mapping):
        return obj
    if isinstance(obj, _Opaque):
        if obj._items:
            return obj._items
        if isinstance(obj._state, Mapping):
            return obj._state
    return None


def _tensor_share(m: Mapping[Any, Any]) -> float:
    if not m:
        return 0.0
    return sum(isinstance(v, _TensorMeta) for v in m.values()) / len(m)


# where the model's parameters live, by layout: mmengine/Lightning, DeepSpeed, many repos
_STATE_KEYS = ("state_dict", "module", "model", "model_state_dict", "model_state", "net")
_NOT_MODEL = ("optimizer", "optimizer_states", "optim", "lr_scheduler", "scheduler", "ema")


def state_dict_of(obj: Any) -> dict[str, _TensorMeta]:
    """The model's parameters in a checkpoint's object tree (plain, mmengine, Lightning, DS)."""
    m = _as_mapping(obj)
    if m is None:
        return {}
    if _tensor_share(m) >= 0.5:
        return {str(k): v for k, v in m.items() if isinstance(v, _TensorMeta)}
    for key in _STATE_KEYS:
        sub = _as_mapping(m.get(key))
        if sub is not None:
            found = state_dict_of(sub)
            if found:
                return found
    best: dict[str, _TensorMeta] = {}
    for key, value in m.items():
        if str(key).lower().startswith(_NOT_MODEL):
            continue
        found = state_dict_of(value)
        if len(found) > len(best):
            best = found
    return best


def index_checkpoint(
    path: str | os.PathLike[str], *, allow_torch: bool = False
) -> list[ParamShape]:
    """Every parameter (and buffer) of the model in a checkpoint, with its shape."""
    try:
        tree = read_checkpoint(path)
    except SourceError:
        if not allow_torch:
            raise
        tree = _read_with_torch(os.fspath(path))
    return [ParamShape(k, v.shape, v.dtype) for k, v in state_dict_of(tree).items()]


def _read_with_torch(path: str) -> Any:
    """Last resort for the CLI: torch itself, safely (weights only, memory-mapped)."""
    try:
        import torch
    except ImportError:
        raise SourceError(
            f"{path}: cannot read this checkpoint without torch; install nanwatch[shapes]"
        ) from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise SourceError(f"{path}: torch cannot read it safely either ({e})") from None

    def convert(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return _TensorMeta(tuple(o.shape), str(o.dtype).replace("torch.", ""))
        if isinstance(o, Mapping):
            return {k: convert(v) for k, v in o.items()}
        return o

    return convert(obj)


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
