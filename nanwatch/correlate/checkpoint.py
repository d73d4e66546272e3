"""Reading a checkpoint's object tree without torch and without running anything from it.

The pickle inside a checkpoint is read by an unpickler that knows only what torch writes for
tensors (their rebuild functions, storages, dtypes) and replaces every other class or function by
an inert stand-in, so tensors become their shape and dtype and nothing from the file executes:

- torch's zip format (``torch.save`` since 1.6: ``*/data.pkl`` + storages, never read), also used
  by mmengine (``{'meta', 'state_dict', 'optimizer', ...}``), Lightning (``{'state_dict', ...}``),
  DeepSpeed (``mp_rank_00_model_states.pt``: ``{'module': ...}``) and plain state dicts;
- torch's legacy format (a sequence of pickles before the raw storages);
- ``.safetensors`` (a JSON header).

:func:`state_dict_of` finds the model's parameters in any of those layouts (never the optimizer
state). Only the CLI, if this fails and torch is installed, falls back to ``torch.load`` with
``weights_only=True`` (and ``mmap=True`` where the format allows).
"""

from __future__ import annotations

import codecs
import io
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Iterable, Mapping
from typing import IO, Any

from .._dc import dataclass
from ..errors import SourceError

MAX_PICKLE = 512 << 20
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


@dataclass(frozen=True)
class TensorMeta:
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


def _rebuild_v2(storage: Any, offset: Any, size: Any, *rest: Any) -> TensorMeta:
    return TensorMeta(_shape_of(size), _dtype_name(storage))


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, rg: Any, hooks: Any,
                dtype: Any = None, *rest: Any) -> TensorMeta:  # fmt: skip
    return TensorMeta(_shape_of(size), _dtype_name(dtype) or _dtype_name(storage))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_meta(dtype: Any, size: Any, *rest: Any) -> TensorMeta:
    return TensorMeta(_shape_of(size), _dtype_name(dtype))


def _rebuild_wrapper(cls: Any, dtype: Any, size: Any, *rest: Any) -> TensorMeta:
    return TensorMeta(_shape_of(size), _dtype_name(dtype))


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
    if func in _REBUILD.values():
        return func(*args)
    return _opaque("torch", "Tensor")()


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    return cls() if isinstance(cls, type) and issubclass(cls, _Opaque) else _Opaque()


def _safe_getattr(obj: Any, name: str, *default: Any) -> Any:
    return _opaque("getattr", str(name))


_REBUILD: dict[str, Any] = {
    "_rebuild_tensor": lambda storage, offset, size, stride: TensorMeta(
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


def _read_safetensors(path: str) -> dict[str, TensorMeta]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise SourceError(f"{path}: not a readable safetensors file ({e})") from None
    return {
        k: TensorMeta(_shape_of(v.get("shape", ())), str(v.get("dtype", "")).lower() or None)
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
    return sum(isinstance(v, TensorMeta) for v in m.values()) / len(m)


# where the model's parameters live, by layout: mmengine/Lightning, DeepSpeed, many repos
_STATE_KEYS = ("state_dict", "module", "model", "model_state_dict", "model_state", "net")
_NOT_MODEL = ("optimizer", "optimizer_states", "optim", "lr_scheduler", "scheduler", "ema")


def state_dict_of(obj: Any) -> dict[str, TensorMeta]:
    """The model's parameters in a checkpoint's object tree (plain, mmengine, Lightning, DS)."""
    m = _as_mapping(obj)
    if m is None:
        return {}
    if _tensor_share(m) >= 0.5:
        return {str(k): v for k, v in m.items() if isinstance(v, TensorMeta)}
    for key in _STATE_KEYS:
        sub = _as_mapping(m.get(key))
        if sub is not None:
            found = state_dict_of(sub)
            if found:
                return found
    best: dict[str, TensorMeta] = {}
    for key, value in m.items():
        if str(key).lower().startswith(_NOT_MODEL):
            continue
        found = state_dict_of(value)
        if len(found) > len(best):
            best = found
    return best


def read_with_torch(path: str) -> Any:
    """Last resort for the CLI: torch itself, safely (weights only, memory-mapped)."""
    not_one = (
        f"{path}: not a checkpoint: neither a torch zip or pickle file nor safetensors "
        "(a partial download, or another kind of file?)"
    )
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError as e:
        raise SourceError(f"{path}: cannot read the checkpoint ({e.strerror})") from None
    # torch.save writes a zip (PK) or, in the legacy format, pickles (protocol 2+: 0x80)
    if head[:1] != b"\x80" and head != b"PK":
        raise SourceError(not_one)
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
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise SourceError(f"{not_one}; torch says: {first}") from None

    def convert(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return TensorMeta(tuple(o.shape), str(o.dtype).replace("torch.", ""))
        if isinstance(o, Mapping):
            return {k: convert(v) for k, v in o.items()}
        return o

    return convert(obj)
