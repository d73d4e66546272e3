"""The Alertmanager sink against a real HTTP server on loopback (tests/am_server.py).

In-process: a Pipeline reads the two-node logs of tests/cluster_logs.py and delivers through
the outbox; the real Alertmanager is driven in test_alertmanager_e2e.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import parse_config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.errors import ConfigError, DeliveryError
from nanwatch.events import parse_utc
from nanwatch.notify.alertmanager import RESEND, AlertmanagerSink, api_url, redact
from nanwatch.notify.outbox import Sender
from nanwatch.store import Store

from ..am_server import Catcher
from ..cluster_logs import RUN, RUN_ID, write_nodes


@pytest.fixture
def am() -> Iterator[Catcher]:
    with Catcher() as c:
        yield c


@pytest.fixture
def nodes(tmp_path: Path) -> dict[str, Path]:
    return write_nodes(tmp_path / "logs")


class Node:
    """One node's live pipeline, stepped and delivered by hand."""

    def __init__(self, tmp: Path, name: str, paths: list[Path], urls: list[str]) -> None:
        self.config = parse_config({"cluster": {"node": name}, "alertmanager": {"urls": urls}})
        self.store = Store.open(tmp / f"{name}.db")
        self.sink = AlertmanagerSink(urls, node=name, timeout=2.0)
        self.pipe = Pipeline(
            self.config, self.store, [str(p) for p in paths], live=True, sinks=[self.sink]
        )

    def step(self) -> None:
        self.pipe.step()
        assert self.pipe.deliver_all(deadline=20) == 0

    def deliver_at(self, now: float) -> None:
        """One delivery pass with the clock at ``now``: what is due then goes out."""
        assert self.pipe.outbox is not None
        sender = Sender(str(self.store.path), [self.sink], clock=lambda: now)
        reader = Store.open(self.store.path, readonly=True)
        try:
            assert sender.deliver_due(reader) >= 1
        finally:
            reader.close()
        self.pipe.outbox.record(sender.drain_results())
        assert self.pipe.outbox.pending() == 0

    def close(self) -> None:
        self.pipe.tracker.close()
        self.store.close()


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def make(name: str, paths: list[Path], urls: list[str]) -> Node:
        made.append(Node(tmp_path, name, paths, urls))
        return made[-1]

    yield make
    for n in made:
        n.close()


def test_each_incident_is_one_alert_with_labels_and_annotations(
    am: Catcher, nodes: dict[str, Path], node_factory: Any
) -> None:
    a = node_factory("node-a", [nodes["node-a"]], [am.url])
    b = node_factory("node-b", [nodes["node-b"]], [am.url])
    before = time.time()
    a.step()
    b.step()
    alerts = {x["labels"]["node"]: x for x in am.alerts()}
    assert set(alerts) == {"node-a", "node-b"}
    oom, orphan = alerts["node-a"], alerts["node-b"]
    assert oom["labels"] == {
        "alertname": "NanwatchOutOfMemory",
        "kind": "oom",
        "job": RUN_ID,
        "run": RUN,
        "node": "node-a",
        "rank": "3",
        "cause_rank": "3",  # a root cause: its own rank
        "severity": "critical",
        "incident": "1",
    }
    # the timeouts on node B name the rank they waited for: rank 3, on node A
    assert orphan["labels"]["kind"] == "comm_timeout"
    assert orphan["labels"]["cause_rank"] == "3"
    assert orphan["labels"]["rank"] == "3"  # the origin: the rank that stopped responding
    assert (orphan["labels"]["job"], orphan["labels"]["run"]) == (RUN_ID, RUN)
    ann = oom["annotations"]
    assert ann["summary"].startswith("Out of memory on rank 3 in validation")
    assert "timeouts are a symptom" in ann["root_cause"]
    assert ann["command"] == "nanwatch show 1   (on node-a)"
    assert ann["ranks"] == "0-7"
    assert "waited for rank 3" in orphan["annotations"]["root_cause"]
    assert orphan["annotations"]["hint"].startswith("Collective timeout: find the rank")
    # firing: endsAt a few re-sends ahead, startsAt when nanwatch opened the incident
    ends = parse_utc(oom["endsAt"])
    assert before + 200 < ends < time.time() + 300
    assert before - 1 < parse_utc(oom["startsAt"]) <= time.time()


def test_open_alerts_are_re_sent_and_resolution_ends_them(
    am: Catcher, nodes: dict[str, Path], node_factory: Any
) -> None:
    a = node_factory("node-a", [nodes["node-a"]], [am.url])
    a.step()
    assert len(am.alerts()) == 1
    outbox = a.pipe.outbox
    assert outbox is not None
    assert outbox.enqueue_reminders() == 0  # just sent
    later = time.time() + RESEND + 1
    assert outbox.enqueue_reminders(now=later) == 1
    a.deliver_at(later)
    first, again = am.alerts()
    assert again["labels"] == first["labels"]
    assert parse_utc(again["endsAt"]) > time.time() + 200  # still firing
    # the incident resolves (no news for resolve_after under watch): its alert ends
    a.pipe.correlator.resolve_after = 0.001
    a.step()
    last = am.alerts()[-1]
    assert last["labels"] == first["labels"]
    resolved = a.store._conn.execute("SELECT resolved_at FROM incidents").fetchone()[0]
    assert last["endsAt"] == resolved
    assert parse_utc(last["endsAt"]) <= time.time()
    assert outbox.enqueue_reminders(now=time.time() + RESEND + 1) == 0  # nothing open


def test_a_scan_never_ends_an_alert(am: Catcher, nodes: dict[str, Path], tmp_path: Path) -> None:
    from ..conftest import nanwatch

    cfg = tmp_path / "n.toml"
    cfg.write_text(f'[alertmanager]\nurl = "{am.url}"\n[cluster]\nnode = "node-a"\n')
    db = str(tmp_path / "scan.db")
    nanwatch("scan", "--notify", "--config", str(cfg), "--db", db, str(nodes["node-a"]))
    (alert,) = am.alerts()
    assert parse_utc(alert["endsAt"]) > time.time() + 200
    nanwatch("scan", "--notify", "--config", str(cfg), "--db", db, str(nodes["node-a"]))
    assert len(am.alerts()) == 1  # nothing new, nothing ended
    plain = str(tmp_path / "plain.db")
    nanwatch("scan", "--config", str(cfg), "--db", plain, str(nodes["node-a"]))
    assert len(am.alerts()) == 1  # without --notify nothing is queued


def test_an_orphan_merged_into_its_root_ends_its_alert(
    am: Catcher, nodes: dict[str, Path], node_factory: Any, tmp_path: Path
) -> None:
    """On one node the timeouts are read first (an orphan incident, alerted), then the OOM's
    log appears: the OOM absorbs the orphan, whose alert ends."""
    logs = tmp_path / "one" / "work_dirs" / "dino" / "20261130_101500"
    logs.mkdir(parents=True)
    src = nodes["node-a"] / "20261130_101500"
    for r in (0, 1, 2):
        (logs / f"rank{r}.log").write_bytes((src / f"rank{r}.log").read_bytes())
    a = node_factory("node-a", [logs.parent], [am.url])
    a.step()
    (orphan,) = am.alerts()
    assert orphan["labels"]["kind"] == "comm_timeout"
    (logs / "rank3.log").write_bytes((src / "rank3.log").read_bytes())
    a.step()
    by_kind = {x["labels"]["kind"]: x for x in am.alerts()[1:]}
    assert parse_utc(by_kind["comm_timeout"]["endsAt"]) <= time.time()  # merged: ended
    assert parse_utc(by_kind["oom"]["endsAt"]) > time.time() + 200


def test_labels_that_change_end_the_old_alert(
    am: Catcher, nodes: dict[str, Path], node_factory: Any
) -> None:
    a = node_factory("node-a", [nodes["node-a"]], [am.url])
    a.step()
    (first,) = am.alerts()
    # the launcher's log prints the SLURM job id later: a tier above torchrun's run id
    with open(nodes["node-a"] / "20261130_101500" / "torchrun.log", "a") as f:
        f.write("SLURM_JOB_ID=4261046\n")
    a.step()  # identity refreshed; the incident itself did not change
    assert a.pipe.outbox is not None
    later = time.time() + RESEND + 1
    assert a.pipe.outbox.enqueue_reminders(now=later) == 1  # the next re-send
    a.deliver_at(later)
    old, new = am.alerts()[1:]
    assert old["labels"] == first["labels"] and parse_utc(old["endsAt"]) <= time.time()
    assert new["labels"]["job"] == "4261046"
    assert parse_utc(new["endsAt"]) > time.time() + 200


def test_ha_pair_one_down_still_delivers(
    am: Catcher, caplog: pytest.LogCaptureFixture, nodes: dict[str, Path], node_factory: Any
) -> None:
    with Catcher() as down:
        dead = down.url
    a = node_factory("node-a", [nodes["node-a"]], [dead, am.url])
    with caplog.at_level(logging.WARNING, logger="nanwatch.notify.alertmanager"):
        a.step()
    assert len(am.alerts()) == 1
    assert "the others took the alert" in caplog.text


def test_no_alertmanager_is_retried_a_refused_alert_is_given_up(am: Catcher) -> None:
    with Catcher() as down:
        dead = down.url
    alert = [{"labels": {"alertname": "X"}}]
    with pytest.raises(DeliveryError) as e:
        AlertmanagerSink([dead], timeout=1.0).post(alert)
    assert not e.value.permanent and e.value.retry_after is not None
    am.faults = [503]
    with pytest.raises(DeliveryError) as e:
        AlertmanagerSink([am.url]).post(alert)
    assert not e.value.permanent and "HTTP 503" in str(e.value)
    am.faults = [400]
    with pytest.raises(DeliveryError) as e:
        AlertmanagerSink([am.url]).post(alert)
    assert e.value.permanent and "refused" in str(e.value)
    AlertmanagerSink([am.url]).post(alert)
    assert am.alerts() == alert


def test_urls_and_credentials() -> None:
    assert api_url("http://am:9093") == "http://am:9093/api/v2/alerts"
    assert api_url("http://am:9093/api/v2/alerts/") == "http://am:9093/api/v2/alerts"
    assert redact("http://bob:s3cret@am:9093/api/v2/alerts") == "http://***@am:9093/api/v2/alerts"
    with pytest.raises(ConfigError, match="not an http"):
        parse_config({"alertmanager": {"url": "am:9093"}})
    cfg = parse_config({"alertmanager": {"urls": ["http://am-1:9093", "http://am-2:9093"]}})
    assert cfg.alertmanager.urls == ("http://am-1:9093", "http://am-2:9093")


def test_basic_auth_from_the_url_never_in_errors(am: Catcher) -> None:
    with Catcher() as down:
        port = down.port
    url = f"http://bob:s3cret@127.0.0.1:{port}"
    with pytest.raises(DeliveryError) as e:
        AlertmanagerSink([url], timeout=1.0).post([{"labels": {"alertname": "X"}}])
    assert "s3cret" not in str(e.value) and "***@127.0.0.1" in str(e.value)


def test_doctor_checks_every_alertmanager_url(am: Catcher, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from nanwatch.cli import cli

    with Catcher() as down:
        dead = down.url
    cfg = tmp_path / "n.toml"
    cfg.write_text(
        f'[sources]\npaths = ["{tmp_path}"]\n'
        f'[alertmanager]\nurls = ["{dead}", "http://bob:s3cret@127.0.0.1:{am.port}"]\n'
        '[cluster]\nnode = "node-a"\n'
    )
    db = tmp_path / "db" / "nw.db"
    result = CliRunner().invoke(cli, ["doctor", "--json", "--config", str(cfg), "--db", str(db)])
    assert result.exit_code == 1
    assert "s3cret" not in result.output
    findings = [json.loads(line) for line in result.output.splitlines()]
    checks = [f for f in findings if f["check"] == "alertmanager"]
    assert [f["status"] for f in checks] == ["fail", "fail"]
    assert f"cannot reach {dead}" in checks[0]["message"] and checks[0]["fix"]
    # something answers there, but not Alertmanager's API
    assert "not as Alertmanager does" in checks[1]["message"]
    (cluster,) = [f for f in findings if f["check"] == "cluster"]
    assert "node 'node-a'" in cluster["message"]
