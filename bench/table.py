"""The one table `make bench` prints: figure, value, reference or target, verdict."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Row:
    figure: str
    value: str
    target: str = ""
    ok: bool | None = None  # None: no target, a figure to read
    key: str = ""  # where the compared number lives in results.json
    num: float | None = None
    change: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _get(d: Any, key: str) -> Any:
    for part in key.split("/"):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _pure_row(res: dict[str, Any], name: str) -> Iterator[Row]:
    """The same input in pure Python (NANWATCH_PURE=1), beside the compiled core's figure."""
    pure = res.get("pure")
    if pure is None:
        return
    yield Row(
        "  the same in pure Python (NANWATCH_PURE=1)",
        f"{pure['scan_mb_s']} MB/s = {pure['ratio']:.3f} x grep, {pure['us_per_line']} us/line"
        f" (compiled: x{res['scan_mb_s'] / max(pure['scan_mb_s'], 1e-9):.2f} faster)",
        f"ratio >= 0.15 (grep: {pure['grep_mb_s']} MB/s); every metric row stored",
        pure["ratio"] >= 0.15 and pure["metrics_ok"],
        f"scan/{name}/pure/scan_mb_s",
        pure["scan_mb_s"],
    )


def rows_for(results: dict[str, Any], old: dict[str, Any] | None = None) -> list[Row]:
    rows = list(_rows(results["sections"]))
    if old is not None:
        for r in rows:
            was = _get(old.get("sections", {}), r.key) if r.key else None
            if isinstance(was, (int, float)) and r.num is not None and was:
                r.change = f"x{r.num / was:.2f}"
    return rows


def _ms(x: float) -> str:
    return f"{x:.0f} ms" if x >= 10 else f"{x:.1f} ms"


def _rows(s: dict[str, Any]) -> Iterator[Row]:
    if "startup" in s:
        st = s["startup"]
        for name in ("nanwatch --help", "nanwatch scan --help", "nanwatch watch --help"):
            ms = st[name]["ms"]
            yield Row(
                f"`{name}`",
                _ms(ms),
                "< 300 ms",
                ms < 300,
                f"startup/{name}/ms",
                ms,
            )
        scan0 = st.get("nanwatch scan (an empty file)")
        if scan0 is not None:
            yield Row(
                "`nanwatch scan` of an empty file (a fresh database)",
                _ms(scan0["ms"]),
                "<= 150 ms",
                scan0["ms"] <= 150,
                "startup/nanwatch scan (an empty file)/ms",
                scan0["ms"],
            )
    if "scan" in s:
        sc = s["scan"]
        full, half = sc["full"], sc["half"]
        # the compiled chunk core's target, or pure Python's when it is not built
        compiled = str(sc.get("core", "")).startswith("compiled")
        want = 0.33 if compiled else 0.15
        yield Row(
            f"scan: {full['mb']:.0f} MB of 8-rank mmengine logs (start-up subtracted), "
            f"{'compiled core' if compiled else 'pure Python'}",
            f"{full['scan_mb_s']} MB/s = {full['ratio']:.3f} x grep"
            + (f", {full['us_per_line']} us/line" if "us_per_line" in full else ""),
            f"ratio >= {want} (grep -E -c -i: {full['grep_mb_s']} MB/s, same files, "
            "alternating runs)",
            full["ratio"] >= want,
            "scan/full/scan_mb_s",
            full["scan_mb_s"],
        )
        yield from _pure_row(full, "full")
        yield Row(
            "  every incident found, every iteration's metrics stored",
            f"{', '.join(f'{k} rank {r}' for k, r in full['incidents'])}; "
            f"{full['metrics']}/{full['iteration_lines']} metric rows",
            "oom rank 3 + nan rank 6; all",
            full["incidents_ok"] and full["metrics_ok"],
        )
        short = sc.get("short")
        if short is not None:
            yield Row(
                f"scan: the same with ~{short.get('line_bytes', 300)}-byte iteration lines "
                f"({short['mb']:.0f} MB)",
                f"{short['scan_mb_s']} MB/s = {short['ratio']:.3f} x grep "
                f"(705-byte: {full['ratio']:.3f} x)"
                + (f", {short['us_per_line']} us/line" if "us_per_line" in short else ""),
                f"ratio >= {want} (grep: {short['grep_mb_s']} MB/s)",
                short["ratio"] >= want,
                "scan/short/scan_mb_s",
                short["scan_mb_s"],
            )
            yield from _pure_row(short, "short")
            yield Row(
                "  every incident found, every iteration's metrics stored",
                f"{', '.join(f'{k} rank {r}' for k, r in short['incidents'])}; "
                f"{short['metrics']}/{short['iteration_lines']} metric rows",
                "oom rank 3 + nan rank 6; all",
                short["incidents_ok"] and short["metrics_ok"],
            )
        yield Row(
            "  start-up (same command on an empty folder); peak RSS",
            f"{full['startup_s']:.2f} s; {full['rss_mib']:.0f} MiB",
            "",
            None,
            "scan/full/rss_mib",
            full["rss_mib"],
        )
        yield Row(
            f"  growth {half['mb']:.0f} -> {full['mb']:.0f} MB",
            f"time x{sc['growth_time']}, peak RSS x{sc['growth_rss']}",
            "~2x time, flat memory",
            1.6 <= sc["growth_time"] <= 2.4 and sc["growth_rss"] <= 1.25,
        )
        pl = sc["plog"]
        yield Row(
            f"scan: {pl['mb']:.0f} MB of CANN plogs, 8 ranks",
            f"{pl['scan_mb_s']} MB/s = {pl['ratio']:.3f} x grep",
            f"grep: {pl['grep_mb_s']} MB/s; incidents {', '.join(pl['incidents'])}",
            pl["incidents_ok"],
            "scan/plog/scan_mb_s",
            pl["scan_mb_s"],
        )
    if "msprobe" in s:
        m = s["msprobe"]
        f, h = m["full"], m["half"]
        p = m["params"]
        yield Row(
            f"msprobe CSV ingestion ({p['ranks']} ranks x {p['steps']} steps x {p['params']} "
            "params x 8 families)",
            f"{f['rows_per_s']:,} rows/s ({f['mb_per_s']} MB/s)",
            f"reader alone {f['reader_rows_per_s']:,} rows/s; origin {f['origin']}",
            f["origin_ok"],
            "msprobe/full/rows_per_s",
            f["rows_per_s"],
        )
        yield Row(
            f"  growth {h['rows']:,} -> {f['rows']:,} rows (same NaN at the end)",
            f"time x{m['growth_time']}",
            "<= ~2x time (the NaN's events are the same work)",
            m["growth_time"] <= 2.4,
        )
        lat = sorted(m["latency_s"])
        yield Row(
            "msprobe: a step's CSVs landed -> NaN incident with its origin (watch)",
            f"{_ms(1000 * lat[len(lat) // 2])} (max {_ms(1000 * lat[-1])})",
            "",
            None,
        )
    if "adversarial" in s:
        a = s["adversarial"]
        yield Row(
            f"one {a['mb']:g} MB line built from a rule's own literals, worst of {a['rules']} "
            f"rules ({a['lines']} lines)",
            f"{_ms(a['worst_ms'])} ({a['worst_rule']}); {a['timeouts']} rule timeouts",
            f"< {a['budget_ms']} ms, no timeout",
            a["worst_ms"] < a["budget_ms"] and a["timeouts"] == 0,
            "adversarial/worst_ms",
            a["worst_ms"],
        )
    if "live" in s:
        lv = s["live"]
        ino, poll, sl = lv["inotify"], lv["poll"], lv["slack"]
        yield Row(
            "live: line appended -> event committed, inotify",
            f"p50 {_ms(ino['p50_ms'])}, p99 {_ms(ino['p99_ms'])} ({ino['committed']} lines)",
            "p99 <= 100 ms",
            ino["p99_ms"] <= 100 and ino["committed"] == ino["probes"],
            "live/inotify/p99_ms",
            ino["p99_ms"],
        )
        budget = 1000 * poll["poll_interval_s"] + 100
        yield Row(
            f"live: same, polling every {poll['poll_interval_s']:g} s",
            f"p50 {_ms(poll['p50_ms'])}, p99 {_ms(poll['p99_ms'])}",
            f"p99 <= {budget:.0f} ms",
            poll["p99_ms"] <= budget and poll["committed"] == poll["probes"],
            "live/poll/p99_ms",
            poll["p99_ms"],
        )
        if sl["p50_ms"] is not None:
            yield Row(
                f"live: first line of an incident -> Slack request, after group_wait "
                f"({sl['group_wait_s']:g} s)",
                f"p50 {_ms(sl['p50_ms'])}, max {_ms(sl['max_ms'])}",
                f"{sl['posted']}/{sl['trials']} posted",
                sl["posted"] == sl["trials"],
                "live/slack/p50_ms",
                sl["p50_ms"],
            )
    if "idle" in s:
        i = s["idle"]
        q = i["inotify"]
        yield Row(
            f"idle CPU, {q['files']} quiet files, inotify (watchdog tick every 30 s)",
            f"{q['cpu_percent_of_one_core']:.3f}% of a core",
            "< 0.2%",
            q["cpu_percent_of_one_core"] < 0.2,
            "idle/inotify/cpu_percent_of_one_core",
            q["cpu_percent_of_one_core"],
        )
        yield Row(
            "idle RSS (no torch imported)",
            f"{q['rss_mib_min']}-{q['rss_mib_max']} MiB",
            "< 80 MB",
            q["rss_mib_max"] * 1.048576 < 80,
            "idle/inotify/rss_mib_max",
            q["rss_mib_max"],
        )
        pq = i["poll"]
        yield Row(
            f"idle CPU, {pq['files']} quiet files, polling every 2 s",
            f"{pq['cpu_percent_of_one_core']:.3f}% of a core",
            "",
            None,
            "idle/poll/cpu_percent_of_one_core",
            pq["cpu_percent_of_one_core"],
        )
        t = i["ticks"]
        extra = t["cpu_percent_of_one_core"] - q["cpu_percent_of_one_core"]
        yield Row(
            "  the same with a watchdog tick (a pass that finds nothing) every second",
            f"{t['cpu_percent_of_one_core']:.3f}% of a core (~{10 * max(extra, 0):.2f} ms per "
            "tick)",
            "",
            None,
            "idle/ticks/cpu_percent_of_one_core",
            t["cpu_percent_of_one_core"],
        )
        ld = i["load"]
        yield Row(
            f"CPU while {ld['files']} ranks write {ld['lines_per_s_per_file']:g} lines/s each",
            f"{ld['cpu_percent_median_window']:.1f}% of a core; RSS {ld['rss_mib_min']}-"
            f"{ld['rss_mib_max']} MiB",
            "",
            None,
            "idle/load/cpu_percent_median_window",
            ld["cpu_percent_median_window"],
        )
    if "query" in s:
        qy = s["query"]
        db = qy["db"]
        for name, v in qy["queries"].items():
            yield Row(
                f"query `{name}`, {db['events']:,} events / {db['incidents']} incidents",
                f"{_ms(v['ms'])} (as a process: {_ms(v['process_ms'])})",
                "< 100 ms",
                v["ms"] < 100,
                f"query/queries/{name}/ms",
                v["ms"],
            )
    if "fleet" in s:
        fl = s["fleet"]
        n = fl["nodes"]
        yield Row(
            f"fleet: one forward per node into PostgreSQL ({n} nodes, {fl['events']:,} events)",
            f"{fl['forward_events_per_s']:,} events/s",
            "",
            None,
            "fleet/forward_events_per_s",
            fl["forward_events_per_s"],
        )
        yield Row(
            f"fleet: a node's backlog of {fl['bulk_forward_events']:,} events forwarded",
            f"{fl['bulk_forward_events_per_s']:,} events/s",
            "",
            None,
            "fleet/bulk_forward_events_per_s",
            fl["bulk_forward_events_per_s"],
        )
        yield Row(
            f"fleet: last node's events in -> fleet incident with its root ({n} nodes)",
            f"{fl['root_latency_s']:.2f} s" + ("" if fl["root_found"] else " (root NOT found)"),
            "<= 5 s",
            fl["root_latency_s"] <= 5 and fl["root_found"],
            "fleet/root_latency_s",
            fl["root_latency_s"],
        )
        yield Row(
            f"fleet store size ({n} nodes)",
            f"{fl['bytes_per_node'] / 1024:.0f} KiB per node, {fl['bytes_per_event']} B per event",
            "",
            None,
            "fleet/bytes_per_node",
            fl["bytes_per_node"],
        )
        for name in ("incidents", "show"):
            ms = fl[f"{name}_ms"]
            yield Row(
                f"fleet store `{name}` ({n} nodes)",
                f"{_ms(ms)} (as a process: {_ms(fl[f'{name}_process_ms'])})",
                "< 200 ms",
                ms < 200,
                f"fleet/{name}_ms",
                ms,
            )
    if "hook" in s:
        hk = s["hook"]
        yield Row(
            f"companion hook per iteration, batch of {hk['batch']}, all with ground truth "
            f"(a no-op hook: {hk['baseline_us']:.1f} us)",
            f"{hk['healthy_us']:.1f} us per iteration",
            "< 100 us",
            hk["healthy_us"] < 100,
            "hook/healthy_us",
            hk["healthy_us"],
        )
        yield Row(
            "the same, one empty sample per batch (lines rate-limited)",
            f"{hk['one_empty_us']:.1f} us per iteration",
            "",
            None,
            "hook/one_empty_us",
            hk["one_empty_us"],
        )


def render(results: dict[str, Any], rows: list[Row], compared: Path | None = None) -> str:
    m = results["machine"]
    head = (
        f"nanwatch bench ({results['mode']}): {m['nproc']} cores, {m['cpu']}, Python "
        f"{m['python']}, SQLite {m['sqlite']}; load average {m['load_before'][0]} before, "
        f"{m['load_after'][0]} after; {results['seconds']['total']:.0f} s"
    )
    cols = ["figure", "value", "target / reference", "ok"]
    if compared:
        cols.append(f"vs {compared.name}")
    table = []
    for r in rows:
        ok = "" if r.ok is None else ("yes" if r.ok else "NO")
        line = [r.figure, r.value, r.target, ok]
        if compared:
            line.append(r.change)
        table.append(line)
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    widths = [min(w, 80) for w in widths]
    out = [
        head,
        "Every figure is the median of several runs (their spread is in results.json).",
        "",
    ]
    out.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    out.append("  ".join("-" * w for w in widths))
    for t in table:
        out.append("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())
    return "\n".join(out)
