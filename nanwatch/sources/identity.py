"""Run identity across nodes: the ``job`` and ``run`` every node of one launch agrees on.

A 64-node job runs 64 daemons; each one only sees its own node's logs, yet their alerts must
carry the same ``job`` and ``run`` labels so Alertmanager can group them and let the rank that
failed first mute the others' timeouts. :func:`derive` is a pure function of what a node knows:

- the config: ``[cluster] job``, ``run``, ``node`` (node defaults to the host name);
- the run's facts from the in-process hook (``runs.facts``: ``job.slurm_job_id``, ...);
- what the logs printed (``runs.facts.launch``, from the ``parsers/launch.toml`` context rules:
  torchrun's launch configs and rendezvous result, scheduler environment dumps, slurmstepd,
  mmengine's ``Exp name``), and the run's mmengine launch folder.

``job`` is the first known of, in this order (a tier is used whatever source tells it, the
hook before the logs): the config; the SLURM job id; the MindCluster job; the Volcano job; the
torchelastic run id (``none``, torchrun's default, does not count); ``MASTER_ADDR:MASTER_PORT``
(or torchrun's rendezvous endpoint; a loopback one is qualified by the node: such a launch
never spans nodes); the mmengine experiment and its timestamp; else the local
run name, which other nodes may not share. ``run`` (one launch of the job) is the config's, else
the mmengine experiment and timestamp (mmengine broadcasts rank 0's timestamp, so every node
names its log folder alike), else the job. Every node derives the same values for the same
launch as long as it sees the same tier: the hook or the config make that certain.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .._dc import dataclass
from ..config import ClusterConfig

_MMENGINE_TS = re.compile(r"^\d{8}_\d{6}$")
_NONE = {"", "none", "null", "unknown"}


@dataclass(frozen=True)
class Identity:
    job: str
    run: str
    node: str
    source: str  # what named the job: config, slurm, mindx, volcano, torchelastic, master, ...


def this_node(configured: str | None = None) -> str:
    """``[cluster] node``, else this host's name."""
    import socket  # the host name is asked for once

    return configured or socket.gethostname() or "localhost"


def _loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    return host in ("localhost", "::1", "0.0.0.0") or host.startswith("127.")


def _get(facts: Mapping[str, object], section: str, key: str) -> str | None:
    part = facts.get(section)
    value = part.get(key) if isinstance(part, dict) else None
    if value is None:
        return None
    text = str(value).strip()
    return None if text.lower() in _NONE else text


def _first(facts: Mapping[str, object], key: str) -> str | None:
    """The hook's value (``facts.job``), else what the logs printed (``facts.launch``)."""
    return _get(facts, "job", key) or _get(facts, "launch", key)


def mmengine_run(
    experiment: str | None, launch: str | None, facts: Mapping[str, object]
) -> str | None:
    """mmengine's ``Exp name``: ``<experiment>_<timestamp>`` from the launch folder, else the
    name it printed. The folder is known from the first byte on, so it is preferred."""
    stamp = (launch or "").rstrip("/").rsplit("/", 1)[-1]
    if experiment and _MMENGINE_TS.match(stamp):
        return f"{experiment}_{stamp}"
    return _get(facts, "launch", "mmengine_exp")


def derive(
    *,
    job: str | None = None,
    run: str | None = None,
    node: str | None = None,
    facts: Mapping[str, object] | None = None,
    local_name: str = "",
    experiment: str | None = None,
    launch: str | None = None,
) -> Identity:
    """The cluster-wide identity of one local run (see the module docstring)."""
    facts = facts or {}
    mm = mmengine_run(experiment, launch, facts)
    found: tuple[str, str] | None = None
    if job:
        found = ("config", job)
    else:
        master = _first(facts, "master_addr")
        port = _first(facts, "master_port")
        endpoint = f"{master}:{port}" if master and port else _first(facts, "rdzv_endpoint")
        if endpoint and _loopback(endpoint.rsplit(":", 1)[0]):
            # a single-node launch: every such launch is "localhost:29500", on every node
            endpoint = f"{endpoint}@{this_node(node)}"
        tiers: Iterable[tuple[str, str | None]] = (
            ("slurm", _first(facts, "slurm_job_id")),
            ("mindx", _first(facts, "mindx_job_name")),
            ("volcano", _first(facts, "volcano_job_name")),
            ("torchelastic", _first(facts, "torchelastic_run_id")),
            ("master", endpoint),
            ("mmengine", mm),
            ("config", run),
        )
        found = next(((src, v) for src, v in tiers if v), None)
    source, job_value = found or ("local", local_name or "unknown")
    return Identity(
        job=job_value,
        run=run or mm or job_value,
        node=this_node(node),
        source=source,
    )


def identity_of_run(
    *,
    name: str,
    experiment: str | None,
    launch: str | None,
    facts: Mapping[str, object],
    cluster: ClusterConfig,
    forced_run: str | None = None,
) -> Identity:
    """:func:`derive` for one stored run; ``forced_run`` (``--run NAME``) stands for
    ``[cluster] run``."""
    return derive(
        job=cluster.job,
        run=forced_run or cluster.run,
        node=cluster.node,
        facts=facts,
        local_name=name,
        experiment=experiment,
        launch=launch,
    )


def stored_names(ident: Identity) -> tuple[str | None, str | None]:
    """``runs.job`` and ``runs.cluster_run`` for an identity: both NULL when nothing
    cluster-wide names the run (alerts then use the local run name, and ``nanwatch merge``
    keeps such runs apart per node)."""
    return (None, None) if ident.source == "local" else (ident.job, ident.run)


def rank_fill(
    rank: int | None, local_rank: int | None, launch: Mapping[str, Any]
) -> tuple[int | None, int | None]:
    """Global and local rank from each other with torchrun's layout (``nproc_per_node`` ranks
    per node, node ``group_rank`` holding ranks ``group_rank * nproc ...``), when printed."""
    try:
        nproc = int(launch.get("nproc_per_node") or 0)
        group = launch.get("group_rank")
        group_rank = int(group) if group is not None and str(group) != "" else None
    except (TypeError, ValueError):
        return rank, local_rank
    if nproc <= 0:
        return rank, local_rank
    if local_rank is not None and group_rank:
        base = group_rank * nproc
        # the engine lets a local rank stand in for a missing global one; on a node other than
        # the first, a global rank equal to the local one cannot be real
        if rank is None or rank == local_rank:
            rank = base + local_rank
    if rank is not None and local_rank is None:
        local_rank = rank % nproc
    return rank, local_rank
