"""Two nanwatch daemons as two nodes of one job, and a real Prometheus Alertmanager.

Alertmanager runs on loopback with the shipped ``systemd/alertmanager-example.yml`` (a copy whose
Slack receiver posts to a local catcher, with seconds instead of minutes between Slack
notifications). Node A's rank 3 runs out of memory in validation; node B's ranks time out in
HCCL naming remote rank 3. Through Alertmanager's API: the OOM alert fires, node B's timeout
alert is inhibited by it (the same job and run, derived by each node from its own logs), Slack
hears of the OOM only. Then both incidents resolve under `watch` and the alerts end.

Needs the Debian package prometheus-alertmanager (`make sysdeps` installs it when run as root);
skipped with a message where it is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..am_server import Catcher
from ..cluster_logs import RUN, RUN_ID, write_nodes
from ..conftest import NANWATCH, ROOT, nanwatch, wait_for
from ..sources.test_sources import nan_line

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "systemd" / "alertmanager-example.yml"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
AMTOOL = shutil.which("amtool")
SKIP = "prometheus-alertmanager is not installed (as root, `make sysdeps` installs it)"


def test_shipped_config_groups_by_job_and_inhibits_symptoms() -> None:
    conf = yaml.safe_load(EXAMPLE.read_text())
    assert conf["route"]["group_by"] == ["job", "run"]
    assert any("job=~" in m for r in conf["route"]["routes"] for m in r.get("matchers", []))
    (rule,) = conf["inhibit_rules"]
    assert rule["equal"] == ["job", "run"]
    assert rule["source_matchers"] == ['kind=~"oom|process_failure"']
    assert rule["target_matchers"] == ['kind=~"comm_timeout|comm_error"']
    assert all(r.get("slack_configs") or r.get("wechat_configs") for r in conf["receivers"])
    # a Slack app's webhook reaches one channel: every Slack receiver has a webhook of its own
    hooks = [c["api_url_file"] for r in conf["receivers"] for c in r.get("slack_configs", [])]
    assert len(hooks) == len(set(hooks)) >= 2
    if AMTOOL is None:
        pytest.skip("amtool is not installed: the structure was checked, not the syntax")
    out = subprocess.run(
        [AMTOOL, "check-config", str(EXAMPLE)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Alertmanager:
    def __init__(self, url: str, slack: Catcher) -> None:
        self.url = url
        self.slack = slack

    def alerts(self, **params: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode(params)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{self.url}/api/v2/alerts?{query}", timeout=5) as resp:
            return list(json.load(resp))

    def slack_texts(self) -> list[str]:
        with self.slack.lock:
            return [
                json.dumps(body) for path, body in self.slack.posts if path.startswith("/slack")
            ]


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    if ALERTMANAGER is None:
        pytest.skip(SKIP)
    slack = Catcher().start()
    hook = tmp_path / "slack-webhook"
    hook.write_text(f"{slack.url}/slack\n")
    llm_hook = tmp_path / "slack-webhook-llm-oncall"
    llm_hook.write_text(f"{slack.url}/slack-llm\n")
    text = EXAMPLE.read_text()
    # the same routes, inhibition and receivers; Slack on loopback, seconds instead of minutes
    for old, new in (
        ("/etc/alertmanager/slack-webhook-llm-oncall", str(llm_hook)),
        ("/etc/alertmanager/slack-webhook\n", f"{hook}\n"),
        ("group_wait: 30s", "group_wait: 1s"),
        ("group_interval: 5m", "group_interval: 1s"),
    ):
        assert old in text
        text = text.replace(old, new)
    conf = tmp_path / "alertmanager.yml"
    conf.write_text(text)
    port = _free_port()
    log = open(tmp_path / "alertmanager.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            ALERTMANAGER,
            f"--config.file={conf}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",  # one instance: no gossip port
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "alertmanager.log").read_text()
            try:
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(f"{url}/-/ready", timeout=1) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for(ready, timeout=30, what="Alertmanager ready")
        yield Alertmanager(url, slack)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        slack.stop()


def _config(path: Path, node: str, logs: Path, am: str, resolve_after: str) -> None:
    path.write_text(
        f'[sources]\npaths = ["{logs}"]\nmode = "poll"\npoll_interval = "0.2s"\n'
        f'[alerts]\nresolve_after = "{resolve_after}"\n'
        f'[alertmanager]\nurl = "{am}"\n'
        f'[cluster]\nnode = "{node}"\n'
    )


def test_oom_on_one_node_inhibits_timeouts_on_the_other(
    alertmanager: Alertmanager, tmp_path: Path
) -> None:
    nodes = write_nodes(tmp_path / "logs")
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    logs_out = {name: open(tmp_path / f"{name}.log", "wb") for name in nodes}  # noqa: SIM115
    configs = {name: tmp_path / f"{name}.toml" for name in nodes}
    job = f'job="{RUN_ID}"'
    try:
        for name, logs in nodes.items():
            _config(configs[name], name, logs, alertmanager.url, "1h")
            daemons[name] = subprocess.Popen(
                [*NANWATCH, "watch", "--quiet", "--config", str(configs[name])],
                env={**os.environ, "NANWATCH_DB": str(tmp_path / f"{name}.db")},
                stdout=subprocess.DEVNULL,
                stderr=logs_out[name],
            )

        wait_for(lambda: len(alertmanager.alerts(filter=job)) == 2, timeout=40, what="2 alerts")
        by_node = {a["labels"]["node"]: a for a in alertmanager.alerts(filter=job)}
        oom, timeouts = by_node["node-a"], by_node["node-b"]
        # each node named the launch alike from its own logs
        assert oom["labels"]["run"] == timeouts["labels"]["run"] == RUN
        assert (oom["labels"]["kind"], oom["labels"]["rank"]) == ("oom", "3")
        assert oom["labels"]["cause_rank"] == timeouts["labels"]["cause_rank"] == "3"
        assert oom["status"]["state"] == "active" and not oom["status"]["inhibitedBy"]
        assert timeouts["labels"]["kind"] == "comm_timeout"
        assert timeouts["status"]["state"] == "suppressed"
        assert timeouts["status"]["inhibitedBy"] == [oom["fingerprint"]]
        # the API's own filters agree: only the OOM is left when inhibited alerts are hidden
        shown = alertmanager.alerts(filter=job, inhibited="false")
        assert [a["labels"]["kind"] for a in shown] == ["oom"]
        # Slack hears of the OOM (with its story), never of the inhibited timeouts
        wait_for(lambda: bool(alertmanager.slack_texts()), timeout=20, what="a Slack post")
        first = alertmanager.slack_texts()[0]
        assert "Out of memory on rank 3 in validation" in first and "node-a" in first
        assert "node-b" not in first and "nanwatch show 1" in first

        # both incidents resolve under watch (resolve_after, shortened by a reload)
        for name, logs in nodes.items():
            _config(configs[name], name, logs, alertmanager.url, "1s")
            daemons[name].send_signal(signal.SIGHUP)
        wait_for(lambda: not alertmanager.alerts(filter=job), timeout=30, what="alerts ended")
        wait_for(
            lambda: any("RESOLVED" in t for t in alertmanager.slack_texts()),
            timeout=20,
            what="Slack's resolved post",
        )
    finally:
        for proc in daemons.values():
            proc.send_signal(signal.SIGTERM)
        for f in logs_out.values():
            f.close()
        for name, proc in daemons.items():
            assert proc.wait(30) == 0, (tmp_path / f"{name}.log").read_text()
    for name in nodes:
        out = subprocess.run(
            [*NANWATCH, "incidents", "--json", "--db", str(tmp_path / f"{name}.db")],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        (inc,) = [json.loads(line) for line in out.stdout.splitlines()]
        assert inc["status"] == "resolved" and inc["job"] == RUN_ID


def test_doctor_finds_the_real_alertmanager(alertmanager: Alertmanager, tmp_path: Path) -> None:
    cfg = tmp_path / "n.toml"
    cfg.write_text(
        f'[sources]\npaths = ["{tmp_path}"]\n[alertmanager]\nurl = "{alertmanager.url}"\n'
    )
    out = subprocess.run(
        [*NANWATCH, "doctor", "--json", "--config", str(cfg), "--db", str(tmp_path / "nw.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    (check,) = [f for f in map(json.loads, out.stdout.splitlines()) if f["check"] == "alertmanager"]
    assert check["status"] == "ok" and "Alertmanager 0." in check["message"], check


LIVE = re.compile(r"<[!@#]|<https?:")  # Slack mentions (<!here>, <@U1>, <#C1>) and links


def test_hostile_names_reach_slack_escaped(alertmanager: Alertmanager, tmp_path: Path) -> None:
    """Folder, job and node names are chosen by whoever starts a run: through the shipped
    template they reach Slack as visible text, never as a ping or a link."""
    logs = tmp_path / "c<!here>|x"
    logs.mkdir()
    (logs / "rank0.log").write_text(nan_line(1) + nan_line(2))
    cfg = tmp_path / "n.toml"
    cfg.write_text(
        f'[alertmanager]\nurl = "{alertmanager.url}"\n'
        '[cluster]\njob = "j<!channel>&<@U024BE7LH>"\nnode = "n<!everyone><https://evil.example|x>"\n'
    )
    nanwatch("scan", "--notify", "--config", str(cfg), "--db", str(tmp_path / "nw.db"), str(logs))
    (alert,) = alertmanager.alerts()
    assert alert["labels"]["job"] == "j<!channel>&<@U024BE7LH>"  # labels stay plain
    wait_for(lambda: bool(alertmanager.slack_texts()), timeout=30, what="a Slack post")
    with alertmanager.slack.lock:
        (body,) = [b for path, b in alertmanager.slack.posts if path.startswith("/slack")]
    strings = _strings(body)
    assert not [s for s in strings if LIVE.search(s)], strings
    text = " ".join(strings)
    assert "j&lt;!channel&gt;&amp;&lt;@U024BE7LH&gt;" in text  # escaped, so Slack shows it
    assert "n&lt;!everyone&gt;&lt;https://evil.example|x&gt;" in text
    assert "&lt;!here&gt;|x" in text


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_each_route_reaches_its_own_webhook_with_its_lines_kept(
    alertmanager: Alertmanager, tmp_path: Path
) -> None:
    """An llm-* job reaches the llm-oncall webhook (a Slack app webhook ignores `channel:`);
    the default receiver's message keeps one line per line."""
    for job in ("llm-pretrain", "detector"):
        logs = tmp_path / job
        logs.mkdir()
        (logs / "rank0.log").write_text(nan_line(1) + nan_line(2))
        cfg = tmp_path / f"{job}.toml"
        cfg.write_text(f'[alertmanager]\nurl = "{alertmanager.url}"\n[cluster]\njob = "{job}"\n')
        db = tmp_path / f"{job}.db"
        nanwatch("scan", "--notify", "--config", str(cfg), "--db", str(db), str(logs))

    def posts() -> dict[str, list[Any]]:
        with alertmanager.slack.lock:
            got: dict[str, list[Any]] = {}
            for path, body in alertmanager.slack.posts:
                got.setdefault(path, []).append(body)
            return got

    wait_for(lambda: {"/slack", "/slack-llm"} <= set(posts()), timeout=30, what="both webhooks")
    (llm,) = posts()["/slack-llm"]
    assert "llm-pretrain" in json.dumps(llm) and "detector" not in json.dumps(llm)
    (default,) = posts()["/slack"]
    text = default["attachments"][0]["text"]
    assert "detector" in json.dumps(default) and "llm-pretrain" not in json.dumps(default)
    assert len(text.strip().splitlines()) >= 3, text  # summary, where, root cause, command
