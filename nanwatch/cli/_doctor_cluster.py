"""`nanwatch doctor`, this node among many: its name in alerts, and the Alertmanagers it
reports to (each configured URL must answer Alertmanager's API)."""

from __future__ import annotations

import json
from typing import Any

from .doctor import Finding


def check_cluster(config: Any) -> Finding:
    from ..sources.identity import this_node

    c = config.cluster
    node = this_node(c.node)
    where = "[cluster] node" if c.node else "the host name; [cluster] node overrides it"
    if c.job or c.run:
        what = ", ".join(f"{k} {v!r}" for k, v in (("job", c.job), ("run", c.run)) if v)
        return Finding(
            "cluster",
            "ok",
            f"node {node!r} ({where}); {what} from [cluster]: every run this node follows "
            "carries it",
        )
    return Finding(
        "cluster",
        "ok",
        f"node {node!r} ({where}); job and run come from each run's launcher output "
        "(SLURM, torchrun, MindCluster/Volcano, mmengine) or the in-process hook",
    )


def check_alertmanager(config: Any) -> list[Finding]:
    from ..notify.alertmanager import redact, request

    urls = config.alertmanager.urls
    if not urls:
        return [Finding("alertmanager", "skip", "no [alertmanager] url: nothing to check")]
    out = []
    for url in urls:
        base = url.rstrip("/")
        if base.endswith("/api/v2/alerts"):
            base = base[: -len("/api/v2/alerts")]
        shown = redact(base)
        try:
            code, body = request(base + "/api/v2/status", timeout=5.0)
        except (OSError, ValueError) as e:
            out.append(
                Finding(
                    "alertmanager",
                    "fail",
                    f"cannot reach {shown}: {getattr(e, 'reason', None) or e}",
                    "check the address and port (Alertmanager's --web.listen-address), the "
                    "firewall between this node and it, and HTTP_PROXY/NO_PROXY in the unit's "
                    "environment",
                )
            )
            continue
        if code in (401, 403):
            out.append(
                Finding(
                    "alertmanager",
                    "fail",
                    f"{shown} refused nanwatch (HTTP {code})",
                    "give the credentials its proxy expects in the URL "
                    "(http://user:password@host:9093; keep the config mode 0640)",
                )
            )
            continue
        try:
            status = json.loads(body) if code == 200 else None
        except ValueError:
            status = None
        if not isinstance(status, dict) or "versionInfo" not in status:
            out.append(
                Finding(
                    "alertmanager",
                    "fail",
                    f"{shown}/api/v2/status answered HTTP {code}, not as Alertmanager does",
                    "point [alertmanager] url at Alertmanager's base address, e.g. "
                    "http://alertmanager:9093",
                )
            )
            continue
        version = (status.get("versionInfo") or {}).get("version", "?")
        cluster = status.get("cluster") or {}
        peers = len(cluster.get("peers") or [])
        gossip = (
            f"cluster {cluster.get('status')}, {peers} peer(s)"
            if cluster.get("status") != "disabled"
            else "no cluster"
        )
        out.append(Finding("alertmanager", "ok", f"{shown}: Alertmanager {version} ({gossip})"))
    return out
