"""The Slack sink against a real HTTP server on loopback, driven through slack_sdk.

In-process: a Pipeline reads real log files, the outbox and a Sender deliver to
``tests/slack_server.py`` through ``base_url``; nothing of slack_sdk is patched.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import AlertsConfig, Config, parse_config
from nanwatch.correlate import Change
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.demo.simulate import seed_scenario
from nanwatch.errors import ConfigError
from nanwatch.notify.outbox import Sender
from nanwatch.notify.silences import add_silence
from nanwatch.notify.slack import SlackSettings, SlackSink, _csv_row, slack_settings
from nanwatch.notify.slack_text import (
    FIELD_MAX,
    HEADER_MAX,
    PARENT_VISIBLE,
    SECTION_MAX,
    details_text,
    parent_blocks,
    visible_chars,
)
from nanwatch.store import Store

from ..slack_server import TOKEN, SlackServer
from ..sources.test_sources import nan_line

MENTIONS = " <!channel> <!here> <@U024BE7LH> <https://evil.example/x|click here> & co"


@pytest.fixture
def slack() -> Iterator[SlackServer]:
    with SlackServer() as srv:
        yield srv


class Clock:
    """The wall clock, moved ahead by hand: what would take a wait takes ``advance``."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead

    def advance(self, seconds: float) -> None:
        self.ahead += seconds


def sink_for(
    srv: SlackServer,
    *,
    webhook: bool = False,
    plots: bool = False,
    clock: Clock | None = None,
    **alerts: float,
) -> SlackSink:
    timers = {"group_wait": 0.0, "group_interval": 0.3, "repeat_interval": 0.0, **alerts}
    settings = (
        SlackSettings(webhook_url=srv.webhook_url)
        if webhook
        else SlackSettings(channel="#alerts", base_url=srv.base_url, token=TOKEN)
    )
    return SlackSink(
        settings, AlertsConfig(**timers), pace=0.05, plots=plots, clock=clock or time.time
    )


class Rig:
    """A live pipeline on a log folder, stepped by hand, with a sender pumped by hand; the
    outbox, the sender and the sink share one clock."""

    def __init__(
        self, tmp: Path, sink: SlackSink, *, live: bool = True, clock: Clock | None = None
    ) -> None:
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.db = tmp / "nw.db"
        self.store = Store.open(self.db)
        self.pipe = Pipeline(
            Config(), self.store, [str(self.logs)], run="job", live=live, sinks=[sink]
        )
        self.clock = clock or Clock()
        assert self.pipe.outbox is not None
        self.pipe.outbox.clock = self.clock
        self.sender = Sender(str(self.db), [sink], clock=self.clock)
        self.reader = Store.open(self.db, readonly=True)
        self.lines: dict[int, int] = {}

    def nan(self, rank: int, n: int = 1, extra: str = "") -> None:
        start = self.lines.get(rank, 0)
        with open(self.logs / f"rank{rank}.log", "a", encoding="utf-8") as f:
            for i in range(start + 1, start + n + 1):
                f.write(nan_line(i).rstrip("\n") + extra + "\n")
        self.lines[rank] = start + n

    def step(self) -> list[Change]:
        return self.pipe.step()

    def pump(self, until: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sender.deliver_due(self.reader)
            assert self.pipe.outbox is not None
            self.pipe.outbox.record(self.sender.drain_results())
            if until():
                return
            time.sleep(0.05)
        raise AssertionError("timed out pumping the outbox")

    def settle(self, seconds: float) -> None:
        """Keep delivering for a while (to see that nothing more is sent)."""
        end = time.monotonic() + seconds
        self.pump(lambda: time.monotonic() >= end, timeout=seconds + 5)

    def pending(self) -> int:
        assert self.pipe.outbox is not None
        return self.pipe.outbox.pending()

    def outbox(self) -> list[tuple[str, str | None, str | None]]:
        return list(self.store._conn.execute("SELECT action, delivered_at, last_error FROM outbox"))

    def close(self) -> None:
        self.reader.close()
        self.pipe.tracker.close()
        self.store.close()


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(sink: SlackSink, **kw: Any) -> Rig:
        rigs.append(Rig(tmp_path, sink, **kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def request_texts(srv: SlackServer) -> str:
    with srv.lock:
        return "\n".join(json.dumps(c.params, ensure_ascii=False) for c in srv.calls)


# --- text ---------------------------------------------------------------------------------------


def test_blocks_escape_log_text_and_stay_within_limits() -> None:
    inc = {
        "id": 7,
        "kind": "nan",
        "status": "open",
        "title": "x" * 500 + MENTIONS,
        "run": "<!channel>" * 300,
        "ranks": list(range(0, 8000, 2)),
        "event_count": 3,
        "origin": {"rank": 6, "step": 10, "tensor": "<@U1>" * 900},
        "hints": [{"title": "CANN < 8.0.0", "text": "a & b " * 2000, "commands": ["x" * 9000]}],
        "detail": {"root_cause": "<!here> " * 1000},
    }
    blocks = parent_blocks(inc, first_line="loss: nan" + MENTIONS * 300)
    details = details_text(inc, first_line="loss: nan" + MENTIONS * 300)
    text = json.dumps(blocks)
    for raw in ("<!channel>", "<!here>", "<@U", "<https://"):
        assert raw not in text and raw not in details
    assert "&lt;!here&gt;" in text  # the root cause, shown as text
    assert "&lt;!channel&gt;" in details and "&amp; co" in details
    assert blocks[0]["text"]["type"] == "plain_text"
    assert len(blocks[0]["text"]["text"]) <= HEADER_MAX
    assert visible_chars(blocks) <= PARENT_VISIBLE
    assert len(details) <= SECTION_MAX
    for b in blocks:
        if b["type"] == "section" and "text" in b:
            assert len(b["text"]["text"]) <= SECTION_MAX
            assert b["text"]["verbatim"] is True
        for f in b.get("fields", []):
            assert len(f["text"]) <= FIELD_MAX
    # clipped text points to the full story and never ends inside an entity
    assert "nanwatch show 7" in text and "truncated: nanwatch show 7" in details
    for b in blocks:
        body = b.get("text", {}).get("text", "")
        assert not body.rstrip("`").endswith(("&", "&l", "&lt", "&a", "&am", "&amp"))


def test_parent_answers_what_where_why_next_within_800_characters() -> None:
    inc = {
        "id": 3,
        "kind": "nan",
        "status": "open",
        "severity": "critical",
        "title": "Non-finite label_embedding.weight first on rank 6, step 163 (run exp/b)",
        "run": "dino-4scale_r50_8xb2-12e_coco/20261201_090000",
        "node": "node-17",
        "ranks": list(range(8)),
        "event_count": 351,
        "first_time": "2026-12-01T09:08:08.000Z",
        "origin": {"rank": 6, "step": 163, "tensor": "label_embedding.weight"},
        "detail": {"root_cause": "the NaN was produced inside the backward of label_embedding"},
        "hints": [
            {"title": "CANN < 8.0.0", "text": "t" * 900, "commands": ["cat version.cfg"]},
            {"title": "empty gt", "text": "u" * 900, "commands": ["nanwatch check-dataset a.json"]},
            {"title": "third", "text": "v", "commands": ["echo third"]},
        ],
        "_root_where": "grad_unreduced_160-169.csv:35",
        "_config": "/etc/nanwatch/nanwatch.toml",
    }
    blocks = parent_blocks(inc)
    text = json.dumps(blocks, ensure_ascii=False)
    assert visible_chars(blocks) <= PARENT_VISIBLE
    header = blocks[0]["text"]["text"]
    assert header.startswith("#3 Non-finite") and "(run " not in header  # the run is a field
    for want in (
        "*nan*",
        "critical",
        "dino-4scale_r50_8xb2-12e_coco/20261201_090000",
        "host `node-17`",
        "rank 6",
        "grad_unreduced_160-169.csv:35",
        "*Root cause:* the NaN was produced",
        "`cat version.cfg`",
        "`nanwatch check-dataset a.json`",  # the second cause's action is not hidden
        "nanwatch show 3 --config /etc/nanwatch/nanwatch.toml",
    ):
        assert want in text, want
    assert "echo third" not in text and "t" * 50 not in text  # the thread has the rest
    details = details_text(inc)
    assert "echo third" in details and "*Known cause:* third" in details


def test_a_monitor_csv_row_is_shown_with_its_column_names() -> None:
    header = "vpp_stage,name,step,micro_step,norm,nans,shape"
    row = '0,module.label_embedding.weight,163,0,nan,1,"[80, 256]"'
    assert _csv_row(header, row) == (
        "vpp_stage=0; name=module.label_embedding.weight; step=163; micro_step=0; norm=nan; "
        "nans=1; shape=[80, 256]"
    )
    assert _csv_row("a,b", "1,2,3") == "1,2,3"  # a row that does not fit its header: as is


def test_slowdown_parent_states_baseline_to_current_and_the_baseline_run() -> None:
    inc = {
        "id": 2,
        "kind": "slowdown",
        "status": "open",
        "title": "Step time slowdown: 3.3x (run exp/b)",
        "run": "exp/b",
        "origin": {"ratio": 3.31, "baseline": 0.8646, "current": 2.8587, "against": "exp/a"},
    }
    text = json.dumps(parent_blocks(inc))
    assert "0.865 s -&gt; 2.86 s (3.31x) against the previous run exp/a" in text


# --- configuration ------------------------------------------------------------------------------


def test_slack_section_validation_names_key_and_fix(tmp_path: Path) -> None:
    cfg = tmp_path / "nw.toml"

    def err(section: dict[str, object]) -> str:
        with pytest.raises(ConfigError) as e:
            parse_config({"slack": section}, path=cfg)
        return str(e.value)

    assert "channel is missing" in err({"token_file": "t"})
    assert "keep one" in err({"channel": "#a", "token_file": "t", "webhook_url": "https://x/y"})
    assert "http(s) URL" in err({"channel": "#a", "base_url": "slack.com/api"})
    assert "unknown kind 'nann'" in err(
        {"channel": "#a", "routes": [{"kinds": ["nann"], "channel": "#b"}]}
    )
    assert "one channel only" in err(
        {"webhook_url": "https://hooks.example/x", "routes": [{"channel": "#b"}]}
    )


def test_token_from_file_or_env_never_world_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o644)
    cfg = parse_config({"slack": {"channel": "#a", "token_file": str(token)}}, path=tmp_path / "c")
    with pytest.raises(ConfigError) as e:
        slack_settings(cfg)
    assert "token_file" in str(e.value) and f"chmod 600 {token}" in str(e.value)
    token.chmod(0o600)
    settings = slack_settings(cfg)
    assert settings is not None and settings.token == TOKEN
    assert TOKEN not in repr(settings)

    missing = parse_config({"slack": {"channel": "#a", "token_file": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match=r"token_file .* no such file"):
        slack_settings(missing)

    env_only = parse_config({"slack": {"channel": "#a"}})
    with pytest.raises(ConfigError) as e:
        slack_settings(env_only)
    assert "token_file" in str(e.value) and "SLACK_BOT_TOKEN" in str(e.value)
    monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
    settings = slack_settings(env_only)
    assert settings is not None and settings.token == TOKEN


# --- delivery -----------------------------------------------------------------------------------


def test_one_parent_then_edits_and_thread_replies_for_news(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    rig = rig_factory(sink_for(slack, group_interval=0.5))
    rig.nan(0, 3, extra=MENTIONS)
    rig.step()
    rig.pump(lambda: len(slack.parents()) == 1)
    (parent,) = slack.parents()
    # where it was seen is the parent's (file:line); the log line is the thread's, as text
    assert "rank0.log:" in json.dumps(parent.blocks)
    rig.pump(lambda: len(slack.details(parent.ts)) == 1)
    assert "&lt;!channel&gt;" in slack.details(parent.ts)[0].text

    # a new rank: the parent is edited and the thread says so
    rig.nan(1)
    rig.step()
    rig.pump(lambda: len(slack.replies(parent.ts)) == 1)
    assert "ranks 1 affected" in slack.replies(parent.ts)[0].text
    assert parent.edits and "0-1" in json.dumps(parent.edits[-1]["blocks"])

    # two more changes inside group_interval: one edit and one reply for both
    edits = len(parent.edits)
    rig.nan(2)
    rig.step()
    rig.nan(3)
    rig.step()
    rig.pump(lambda: len(slack.replies(parent.ts)) == 2)
    reply = slack.replies(parent.ts)[1].text
    assert "ranks 2 affected" in reply and "ranks 3 affected" in reply
    assert len(parent.edits) == edits + 1
    assert rig.pending() == 0
    # at its first post and after every edit, the parent stays short
    for blocks in [parent.blocks, *(e["blocks"] for e in parent.edits)]:
        assert visible_chars(blocks) <= PARENT_VISIBLE

    # more lines on known ranks are no news: counts at most, never a post per line
    rig.nan(0, 20)
    rig.step()
    rig.settle(0.8)
    assert len(slack.parents()) == 1 and len(slack.replies(parent.ts)) == 2
    assert "<!channel>" not in request_texts(slack)


def test_resolution_edits_the_parent(slack: SlackServer, rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(sink_for(slack))
    rig.nan(0)
    (change,) = rig.step()
    rig.pump(lambda: len(slack.parents()) == 1)
    (parent,) = slack.parents()
    # the correlator's resolve action, as it will arrive through the outbox
    with rig.store.transaction():
        rig.store.execute(
            "UPDATE incidents SET status='resolved', resolved_at='2026-11-30T12:00:00.000Z', "
            "version=version+1 WHERE id=?",
            (change.incident_id,),
        )
    assert rig.pipe.outbox is not None
    rig.pipe.outbox.enqueue([Change(change.incident_id, "resolve", change.version + 1)])
    rig.pump(lambda: bool(slack.replies(parent.ts)))
    assert parent.blocks[0]["text"]["text"].startswith("Resolved: ")
    assert "Resolved at 2026-11-30T12:00:00.000Z" in slack.replies(parent.ts)[0].text
    assert len(slack.parents()) == 1


def test_group_wait_sends_the_state_at_send_time(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    rig = rig_factory(sink_for(slack, group_wait=0.6))
    rig.nan(0)
    rig.step()
    rig.pump(lambda: True)
    for rank in (1, 2, 3):  # the other ranks follow within group_wait
        rig.nan(rank)
        rig.step()
        rig.pump(lambda: True)
    assert slack.parents() == []
    rig.pump(lambda: len(slack.parents()) == 1)
    rig.settle(0.5)
    (parent,) = slack.parents()
    assert "ranks 0-3" in parent.text
    assert slack.replies(parent.ts) == [] and parent.edits == []
    assert rig.pending() == 0


def test_rate_limit_waits_retry_after_and_errors_are_sorted(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    slack.fail("chat.postMessage", status=429, retry_after=3)
    rig = rig_factory(sink_for(slack))
    rig.nan(0)
    rig.step()
    rig.pump(lambda: len(slack.parents()) == 1)
    first, second = slack.calls_to("chat.postMessage")[:2]
    assert first.status == 429 and second.status == 200
    assert second.at - first.at >= 3  # longer than the backoff alone


def test_not_in_channel_is_retried_slowly_with_the_fix(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    slack.fail("chat.postMessage", error="not_in_channel")
    rig = rig_factory(sink_for(slack))
    rig.nan(0)
    rig.step()
    rig.pump(lambda: rig.outbox()[0][2] is not None)
    ((_, delivered, error),) = rig.outbox()
    assert delivered is None and "/invite" in str(error)
    due = rig.store._conn.execute("SELECT due_at FROM outbox").fetchone()[0]
    assert due - time.time() > 200  # kept, tried again in minutes, not dropped


def test_refused_blocks_fall_back_to_text(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    slack.fail("chat.postMessage", error="invalid_blocks")
    rig = rig_factory(sink_for(slack))
    rig.nan(0)
    rig.step()
    rig.pump(lambda: len(slack.parents()) == 1 and rig.pending() == 0)
    (parent,) = slack.parents()
    assert parent.blocks is None and "#1 nan" in parent.text


def test_a_message_slack_can_never_take_is_given_up(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    slack.fail("chat.postMessage", error="invalid_arguments")
    rig = rig_factory(sink_for(slack))
    rig.nan(0)
    rig.step()
    rig.pump(lambda: rig.pending() == 0)
    ((_, delivered, error),) = rig.outbox()
    assert str(delivered).startswith("failed") and "invalid_arguments" in str(error)


def test_restart_edits_the_same_message(
    slack: SlackServer, rig_factory: Callable[..., Rig], tmp_path: Path
) -> None:
    rig = rig_factory(sink_for(slack))
    rig.nan(0)
    rig.step()
    rig.pump(lambda: len(slack.parents()) == 1)
    rig.close()
    # a new process: a new sink and sender, the same database
    again = Rig(tmp_path, sink_for(slack))
    try:
        again.lines = {0: 1}
        again.nan(1)
        again.step()
        (parent,) = slack.parents()
        again.pump(lambda: len(slack.replies(parent.ts)) == 1)
        assert len(slack.parents()) == 1 and parent.edits
    finally:
        again.close()


OOM_LINE = (
    "RuntimeError: NPU out of memory. Tried to allocate 20.00 MiB (NPU 1; 60.96 GiB total "
    "capacity; 86.81 MiB free).\n"
)


def _killed_after_posting(rig: Rig, slack: SlackServer) -> None:
    """An OOM's parent reached Slack, then the process died before its ts was stored."""
    with open(rig.logs / "rank1.log", "a", encoding="utf-8") as f:
        f.write(OOM_LINE)
    rig.step()
    before = len(slack.parents())
    deadline = time.monotonic() + 15
    while len(slack.parents()) == before and time.monotonic() < deadline:
        rig.sender.deliver_due(rig.reader)
        time.sleep(0.05)
    rig.sender.drain_results()  # never recorded: the kill
    assert len(slack.parents()) == before + 1
    rig.close()


def _first_incident(tmp_path: Path, slack: SlackServer) -> None:
    """A NaN incident, posted and stored: the database knows the channel's ID from it."""
    first = Rig(tmp_path, sink_for(slack))
    first.nan(0)
    first.step()
    first.pump(lambda: len(slack.parents()) == 1)
    first.close()


def test_a_message_posted_just_before_a_kill_is_found_not_posted_again(
    slack: SlackServer, tmp_path: Path
) -> None:
    _first_incident(tmp_path, slack)
    _killed_after_posting(Rig(tmp_path, sink_for(slack)), slack)
    nan, oom = slack.parents()
    again = Rig(tmp_path, sink_for(slack))
    try:
        again.pump(lambda: again.pending() == 0)
        assert len(slack.parents()) == 2
        assert slack.calls_to("conversations.history")
        stored = again.store._conn.execute("SELECT channel, ts FROM messages").fetchall()
        assert sorted(stored) == sorted([(nan.channel, nan.ts), (oom.channel, oom.ts)])
        with open(again.logs / "rank2.log", "a", encoding="utf-8") as f:
            f.write(OOM_LINE.replace("NPU 1", "NPU 2"))
        again.step()
        again.pump(lambda: bool(oom.edits))  # the same message lives on
        assert len(slack.parents()) == 2
    finally:
        again.close()


def test_without_history_access_a_restart_posts_again_and_says_why(
    slack: SlackServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _first_incident(tmp_path, slack)
    slack.missing_scopes.add("history")
    _killed_after_posting(Rig(tmp_path, sink_for(slack)), slack)
    again = Rig(tmp_path, sink_for(slack))
    try:
        with caplog.at_level("WARNING", logger="nanwatch.notify.slack"):
            again.pump(lambda: len(slack.parents()) == 3)
        assert "channels:history" in caplog.text
    finally:
        again.close()


def test_reminders_for_open_incidents(slack: SlackServer, rig_factory: Callable[..., Rig]) -> None:
    clock = Clock()
    rig = rig_factory(sink_for(slack, repeat_interval=3600, clock=clock), clock=clock)
    rig.nan(0)
    rig.step()
    rig.pump(lambda: len(slack.parents()) == 1 and rig.pending() == 0)
    (parent,) = slack.parents()
    assert rig.pipe.outbox is not None
    assert rig.pipe.outbox.enqueue_reminders() == 0  # just told
    clock.advance(3599)
    assert rig.pipe.outbox.enqueue_reminders() == 0
    clock.advance(2)
    assert rig.pipe.outbox.enqueue_reminders() == 1
    assert rig.pipe.outbox.enqueue_reminders() == 0  # one at a time
    rig.pump(lambda: bool(slack.replies(parent.ts)))
    assert "Still open" in slack.replies(parent.ts)[0].text


def test_silence_holds_messages_until_it_ends(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    clock = Clock()
    rig = rig_factory(sink_for(slack, clock=clock), clock=clock)
    add_silence(rig.store, run="job", kind=None, seconds=1800, comment="known", now=clock())
    add_silence(rig.store, run="other", kind=None, seconds=3600, now=clock())
    rig.nan(0)
    rig.step()
    rig.pump(lambda: str(rig.outbox()[0][2]).startswith("silenced"))
    assert slack.parents() == [] and rig.pending() == 1
    clock.advance(1801)  # the silence is over
    rig.pump(lambda: len(slack.parents()) == 1 and rig.pending() == 0)
    assert len(slack.details(slack.parents()[0].ts)) == 1


def test_plain_scan_incidents_are_never_posted_by_a_later_watch(
    slack: SlackServer, rig_factory: Callable[..., Rig], tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("".join(nan_line(i) for i in range(1, 4)))
    store = Store.open(tmp_path / "nw.db")
    Pipeline(Config(), store, [str(logs)], run="job").scan()  # no sinks: nothing queued
    store.close()
    rig = rig_factory(sink_for(slack))
    rig.lines = {0: 3}
    rig.nan(1)  # the old incident grows while `watch` runs
    rig.step()
    rig.settle(0.5)
    assert slack.calls == [] and rig.pending() == 0


def test_webhook_posts_once_and_follows_up_only_with_news(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    slack.fail("services/T0000/B0000/hook", status=429, retry_after=1)
    rig = rig_factory(sink_for(slack, webhook=True))
    rig.nan(0, extra=MENTIONS)
    rig.step()
    rig.pump(lambda: len(slack.webhook_posts) == 1)
    rig.nan(0, 5)  # no news
    rig.step()
    rig.settle(0.4)
    assert len(slack.webhook_posts) == 1
    rig.nan(1)
    rig.step()
    rig.pump(lambda: len(slack.webhook_posts) == 2)
    assert "ranks 1 affected" in slack.webhook_posts[1]["text"]
    hook_calls = slack.calls_to("services/T0000/B0000/hook")
    assert hook_calls[0].status == 429 and hook_calls[1].at - hook_calls[0].at >= 1
    assert "<!channel>" not in request_texts(slack)


def test_routes_send_kinds_to_their_channel(slack: SlackServer, tmp_path: Path) -> None:
    settings = SlackSettings(
        channel="#alerts",
        base_url=slack.base_url,
        token=TOKEN,
        routes=({"kinds": ("oom",), "channel": "#oncall"}, {"runs": ("job*",), "channel": "#jobs"}),
    )
    sink = SlackSink(settings, pace=0.0)
    assert sink.route({"kind": "oom", "run": "job1"}) == "#oncall"
    assert sink.route({"kind": "nan", "run": "job1"}) == "#jobs"
    assert sink.route({"kind": "nan", "run": "dino"}) == "#alerts"


def test_messages_table_keeps_channel_and_ts(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    rig = rig_factory(sink_for(slack))
    rig.nan(0)
    rig.step()
    rig.pump(lambda: len(slack.parents()) == 1)
    conn = sqlite3.connect(rig.db)
    try:
        row = conn.execute("SELECT incident_id, sink, channel, ts FROM messages").fetchone()
    finally:
        conn.close()
    (parent,) = slack.parents()
    assert row == (1, "slack", parent.channel, parent.ts)


def test_plot_is_attached_to_the_thread_once_even_after_a_failure(
    slack: SlackServer, rig_factory: Callable[..., Rig]
) -> None:
    slack.fail("files.getUploadURLExternal", status=500, error="internal_error")
    rig = rig_factory(sink_for(slack, plots=True))
    for rank in (0, 1):
        with open(rig.logs / f"rank{rank}.log", "w") as f:
            f.write("".join(nan_line(i).replace("loss: nan", f"loss: {i}.5") for i in range(1, 9)))
    rig.lines = {0: 8, 1: 8}
    rig.nan(0)
    rig.step()
    rig.pump(lambda: rig.pending() == 0 and len(slack.parents()) == 1, timeout=20)
    (parent,) = slack.parents()
    files = [m for m in slack.replies(parent.ts) if m.text.startswith("file ")]
    assert len(files) == 1
    (fid,) = slack.uploads
    assert slack.uploads[fid][:8] == b"\x89PNG\r\n\x1a\n"
    assert [c.status for c in slack.calls_to("files.getUploadURLExternal")] == [500, 200]


@pytest.mark.parametrize("broken", ["files.getUploadURLExternal", "upload"])
def test_a_plot_that_never_uploads_is_given_up_after_five_attempts(
    slack: SlackServer, rig_factory: Callable[..., Rig], broken: str
) -> None:
    if broken == "upload":  # the upload URL Slack hands out answers 500
        for n in range(1, 20):
            slack.fail(f"upload/F{n:08d}", status=500, error="internal_error")
    else:
        slack.fail(broken, status=500, error="internal_error", times=100)
    rig = rig_factory(sink_for(slack, plots=True))
    for rank in (0, 1):
        with open(rig.logs / f"rank{rank}.log", "w") as f:
            f.write("".join(nan_line(i).replace("loss: nan", f"loss: {i}.5") for i in range(1, 9)))
    rig.lines = {0: 8, 1: 8}
    rig.nan(0)
    rig.step()
    for _ in range(12):  # every retry is due at once: a clock far ahead
        rig.sender.deliver_due(rig.reader, now=time.time() + 1e6)
        assert rig.pipe.outbox is not None
        rig.pipe.outbox.record(rig.sender.drain_results())
    assert len(slack.parents()) == 1  # the message went out whatever the plot did
    assert len(slack.calls_to("files.getUploadURLExternal")) == 5
    assert rig.pending() == 0
    ((delivered, error),) = rig.store._conn.execute(
        "SELECT delivered_at, last_error FROM outbox WHERE action = 'plot'"
    ).fetchall()
    assert delivered.startswith("failed") and "given up" in error
    assert "cannot reach" not in error and "HTTP 500" in error


def test_the_oom_and_its_timeouts_arrive_as_one_message(
    slack: SlackServer, rig_factory: Callable[..., Rig], tmp_path: Path
) -> None:
    run_a, _ = seed_scenario(tmp_path / "seed", ranks=4)
    lines = list(run_a.lines())
    cut = min(line.t for line in lines if "EI0002" in line.text)
    rig = rig_factory(sink_for(slack, group_wait=1.0))
    for phase in (
        [line for line in lines if line.t < cut],  # ... validation, rank 3 runs out of memory
        [line for line in lines if line.t >= cut],  # the other ranks time out in HCCL
    ):
        for rank in range(4):
            with open(rig.logs / f"rank{rank}.log", "a", encoding="utf-8") as f:
                f.writelines(line.text + "\n" for line in phase if line.rank == rank)
        rig.step()
        rig.pump(lambda: True)
    rig.pump(lambda: rig.pending() == 0)
    rig.settle(0.5)
    (parent,) = slack.parents()
    assert "#1 oom" in parent.text and "ranks 0-3" in parent.text
    assert "timed out in HCCL" in json.dumps(parent.blocks)
    assert parent.edits == [] and slack.replies(parent.ts) == []


def test_one_budget_per_channel_also_after_a_restart(
    slack: SlackServer, rig_factory: Callable[..., Rig], tmp_path: Path
) -> None:
    rig = rig_factory(sink_for(slack))
    rig.nan(0)
    rig.step()
    rig.pump(lambda: len(slack.parents()) == 1 and rig.pending() == 0)
    rig.close()
    sink = sink_for(slack, group_interval=0.0)
    sink.pace = 1.0
    again = Rig(tmp_path, sink)  # a new process: it knows the channel only by its name
    try:
        again.lines = {0: 1}
        again.nan(1)  # news for incident 1 (by the channel's ID) ...
        again.step()
        with open(again.logs / "rank1.log", "a") as f:  # ... and a new incident (by its name)
            f.write(
                "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 79.11 GiB "
                "total capacity; 70.00 GiB already allocated; 1.00 GiB free; 76.00 GiB reserved "
                "in total by PyTorch)\n"
            )
        again.step()
        (first,) = slack.parents()
        again.pump(
            lambda: (
                len(slack.parents()) == 2
                and bool(slack.replies(first.ts))
                and bool(slack.details(slack.parents()[1].ts))
            )
        )
        # after the first process's parent and details: an edit and a reply for incident 1,
        # then incident 2's parent and details, one second apart in the channel's one budget
        times = sorted(c.at for c in slack.calls if c.method.startswith("chat."))[2:]
        assert len(times) == 4
        assert all(b - a >= 0.9 for a, b in itertools.pairwise(times))
    finally:
        again.close()
