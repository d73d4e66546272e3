"""What a training process knows about itself (for ``nanwatch.probe``).

Only modules the job has imported already are looked at (``sys.modules``): collecting facts
never imports torch, torch_npu or a framework, and never touches a device beyond asking the
allocator for its counters.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Mapping
from typing import Any

# job identity across nodes: (key in facts.job, environment variables, as int)
_JOB_ENV: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("slurm_job_id", ("SLURM_JOB_ID", "SLURM_JOBID"), False),
    ("slurm_job_name", ("SLURM_JOB_NAME",), False),
    ("slurm_step_id", ("SLURM_STEP_ID",), False),
    ("torchelastic_run_id", ("TORCHELASTIC_RUN_ID",), False),
    ("master_addr", ("MASTER_ADDR",), False),
    ("master_port", ("MASTER_PORT",), True),
    ("group_rank", ("GROUP_RANK",), True),  # torchrun's node rank
    # MindCluster (Ascend Operator) injects the task id of the job into every container
    ("mindx_task_id", ("MINDX_TASK_ID",), False),
    # Volcano-scheduled jobs: the task index; ModelArts names the Volcano job in MA_VJ_NAME
    ("volcano_job_name", ("MA_VJ_NAME",), False),
    ("volcano_task_index", ("VC_TASK_INDEX", "VK_TASK_INDEX"), True),
)
# collective timeouts in force (seconds)
_TIMEOUT_ENV = (
    "HCCL_EXEC_TIMEOUT",
    "HCCL_CONNECT_TIMEOUT",
    "NCCL_TIMEOUT",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
)
_DETERMINISM_ENV = ("HCCL_DETERMINISTIC", "CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")
# module name -> distribution name, for versions of packages installed but not imported
_PACKAGES = {
    "torch": "torch",
    "torch_npu": "torch-npu",
    "mmengine": "mmengine",
    "mmcv": "mmcv",
    "mmdet": "mmdet",
    "msprobe": "mindstudio-probe",
}
_STATS = {
    "allocated": "allocated_bytes.all.current",
    "reserved": "reserved_bytes.all.current",
    "active": "active_bytes.all.current",
    "inactive_split": "inactive_split_bytes.all.current",
    "peak_allocated": "allocated_bytes.all.peak",
    "peak_reserved": "reserved_bytes.all.peak",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}


def collect_facts(
    *,
    work_dir: str | None = None,
    extra: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """This process's facts in the schema of ``runs.facts`` (keys absent when unknown)."""
    env = os.environ if environ is None else environ
    facts: dict[str, Any] = {}
    rank, local_rank, world = _dist_identity(env)
    for key, value in (("rank", rank), ("local_rank", local_rank), ("world_size", world)):
        if value is not None:
            facts[key] = value
    facts["node"] = socket.gethostname()
    facts["pid"] = os.getpid()
    job = {}
    for key, names, as_int in _JOB_ENV:
        raw = next((env[n] for n in names if env.get(n)), None)
        if raw is not None:
            job[key] = _int(raw) if as_int and _int(raw) is not None else raw
    if job:
        facts["job"] = job
    facts["versions"] = _versions()
    if "cann" not in facts["versions"]:
        # say what is not known and why, so hints can ask for it instead of guessing
        facts["unknown"] = {"cann": _cann_unknown_why()}
    facts["device"] = _device()
    if work_dir:
        facts["work_dir"] = os.path.abspath(work_dir)
    backend, pg_timeout = _process_group()
    if backend:
        facts["backend"] = backend
    timeouts: dict[str, Any] = {}
    for name in _TIMEOUT_ENV:
        v = _number(env.get(name))
        if v is not None:
            timeouts[name] = v
    if pg_timeout is not None:
        timeouts["pg_timeout"] = pg_timeout
    if timeouts:
        facts["timeouts"] = timeouts
    facts["determinism"] = _determinism(env)
    for key, value in (extra or {}).items():
        if isinstance(value, Mapping) and isinstance(facts.get(key), dict):
            facts[key].update({k: v for k, v in value.items() if v is not None})
        elif value is not None:
            facts[key] = value
    return facts


def _dist_identity(env: Mapping[str, str]) -> tuple[int | None, int | None, int | None]:
    rank = world = None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # a half-initialised group: fall back to the environment
        rank = world = None
    if rank is None:
        rank = _int(env.get("RANK")) if env.get("RANK") else _int(env.get("SLURM_PROCID"))
    if world is None:
        world = (
            _int(env.get("WORLD_SIZE")) if env.get("WORLD_SIZE") else _int(env.get("SLURM_NTASKS"))
        )
    local = _int(env.get("LOCAL_RANK")) if env.get("LOCAL_RANK") else _int(env.get("SLURM_LOCALID"))
    return rank, local, world


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    for mod, dist in _PACKAGES.items():
        m = sys.modules.get(mod)
        v = getattr(m, "__version__", None) if m is not None else None
        if v is None and mod not in ("torch", "torch_npu"):
            v = _installed(dist)
        if v is not None:
            out[mod] = str(v)
    # CANN only through torch_npu, and only when the job loaded it (else ``unknown.cann``)
    cann = _cann() if "torch_npu" in sys.modules else None
    if cann:
        out["cann"] = cann
    return out


def _cann_unknown_why() -> str:
    if "torch_npu" not in sys.modules:
        return "torch_npu is not imported by the job"
    return "torch_npu does not report it (torch.version.cann is empty)"


def _installed(dist: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _cann() -> str | None:
    torch = sys.modules.get("torch")
    v = getattr(getattr(torch, "version", None), "cann", None)
    if not v or str(v).strip().lower() in ("not known", "none", ""):
        # torch_npu's own query (answers only from CANN 8.1.RC1 on; empty before)
        utils = getattr(sys.modules.get("torch_npu"), "utils", None)
        get = getattr(utils, "get_cann_version", None)
        try:
            v = get(module="CANN") if callable(get) else None
        except Exception:
            v = None
    return str(v).strip() if v else None


def _device() -> dict[str, Any]:
    torch: Any = sys.modules.get("torch")
    try:
        if "torch_npu" in sys.modules and hasattr(torch, "npu"):
            return {"type": "npu", "count": int(torch.npu.device_count())}
        if torch is not None and torch.cuda.is_available():
            return {"type": "cuda", "count": int(torch.cuda.device_count())}
    except Exception:
        pass
    return {"type": "cpu"}


def _process_group() -> tuple[str | None, float | None]:
    """The default process group's backend and timeout (seconds), when it exists."""
    dist = sys.modules.get("torch.distributed")
    torch = sys.modules.get("torch")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None, None
        backend = str(dist.get_backend())
        pg = dist.group.WORLD
    except Exception:
        return None, None
    for dev in ("npu", "cuda", "cpu"):
        try:
            opts = pg._get_backend(torch.device(dev)).options  # type: ignore[union-attr]
            return backend, _number(opts._timeout.total_seconds())
        except Exception:  # no backend for this device (or an older torch)
            continue
    try:
        return backend, _number(pg.options._timeout.total_seconds())
    except Exception:
        return backend, None


def _determinism(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            out["deterministic_algorithms"] = bool(torch.are_deterministic_algorithms_enabled())
            out["cudnn_deterministic"] = bool(torch.backends.cudnn.deterministic)
            out["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
        except Exception:
            pass
    for name in _DETERMINISM_ENV:
        if env.get(name):
            out[name] = env[name]
    return out


def memory_stats() -> dict[str, Any]:
    """The allocator's counters of the current device (torch_npu, else CUDA), if any."""
    torch: Any = sys.modules.get("torch")
    mod: Any = None
    kind = None
    try:
        if "torch_npu" in sys.modules and hasattr(torch, "npu"):
            mod, kind = torch.npu, "npu"
        elif torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            mod, kind = torch.cuda, "cuda"
    except Exception:
        mod = None
    if mod is None:
        return {}
    out: dict[str, Any] = {"device": kind}
    try:
        out["device_index"] = int(mod.current_device())
        out.update(stats_fields(mod.memory_stats()))
        free, total = mod.mem_get_info()
        out["total"], out["free"] = int(total), int(free)
    except Exception:  # whatever could be read is reported
        pass
    return out


def stats_fields(stats: Mapping[str, Any]) -> dict[str, int]:
    """``torch.cuda.memory_stats()`` / ``torch.npu.memory_stats()`` -> the summary fields."""
    return {k: int(stats[src]) for k, src in _STATS.items() if src in stats}


def _int(v: Any) -> int | None:
    try:
        return int(str(v).strip())
    except (TypeError, ValueError):
        return None


def _number(v: Any) -> int | float | None:
    if v is None:
        return None
    try:
        f = float(str(v).strip())
    except ValueError:
        return None
    return int(f) if f.is_integer() else f
