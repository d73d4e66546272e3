"""Tables that fit the terminal: `incidents`, `events` and `runs` (and the demo, which prints
the same `incidents` table).

A cell may offer shorter forms of itself (a run's distinguishing tail, a short time); the
table takes them column by column until every line fits ``width``, then truncates the
columns that may lose text (a title keeps its head, a run or a path its tail), and as a last
resort cuts each line. ``width=None`` (output piped) means no limit at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._dc import dataclass
from ..events import ranks_text
from ..render import Doc

RESET = "\x1b[0m"
# incident severity (and status) -> ANSI style of its STATUS and KIND cells
STYLES = {"critical": "\x1b[1;31m", "warning": "\x1b[33m", "info": "\x1b[36m"}
RESOLVED_STYLE = "\x1b[32m"

Cell = str | tuple[str, ...]  # a text, or its forms from longest to shortest


@dataclass(frozen=True)
class Column:
    header: str
    squeeze: int = 0  # order in which shorter forms are taken (0: never)
    cut: str = ""  # "end" keeps the head (a title), "start" keeps the tail (a run, a path)
    cut_rank: int = 0  # order in which cut columns lose text (lowest first)
    min_width: int = 0
    keep: bool = False  # cut only when nothing else can give way (a run's distinguishing tail)
    drop_rank: int = 0  # on a narrow terminal, left out in this order (0: always shown)
    styled: bool = False  # carries the row's style (colour)


def _forms(cell: object) -> tuple[str, ...]:
    if isinstance(cell, tuple):
        return tuple(str(c) for c in cell) or ("",)
    return ("" if cell is None else str(cell),)


def _cut(text: str, width: int, how: str) -> str:
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    return "…" + text[-(width - 1) :] if how == "start" else text[: width - 1] + "…"


def fit(
    rows: Sequence[Sequence[object]],
    columns: Sequence[Column],
    *,
    width: int | None = None,
    styles: Sequence[str | None] | None = None,
    color: bool = False,
) -> str:
    """The table as text: a header line, a rule, one line per row, none longer than ``width``."""
    forms = [[_forms(c) for c in row] for row in rows]
    level = [0] * len(columns)  # which form each column shows

    def text(r: int, c: int) -> str:
        f = forms[r][c]
        return f[min(level[c], len(f) - 1)]

    def col_width(c: int) -> int:
        return max([len(columns[c].header), *(len(text(r, c)) for r in range(len(rows)))])

    widths = [col_width(c) for c in range(len(columns))]
    shown = [True] * len(columns)

    def total() -> int:
        return sum(widths) + 2 * (len(widths) - 1)

    if width is not None:
        squeezed = sorted(
            (c for c, col in enumerate(columns) if col.squeeze), key=lambda c: columns[c].squeeze
        )
        for c in squeezed:
            deepest = max((len(forms[r][c]) for r in range(len(rows))), default=1) - 1
            while total() > width and level[c] < deepest:
                level[c] += 1
                widths[c] = col_width(c)
        cuts = sorted(
            (c for c, col in enumerate(columns) if col.cut), key=lambda c: columns[c].cut_rank
        )

        def floor(c: int, loose: bool) -> int:
            head = len(columns[c].header)
            if loose:
                return min(widths[c], max(head, 1))
            if columns[c].keep:
                return widths[c]
            return min(widths[c], max(columns[c].min_width, head))

        # leave out optional columns while the cut ones could not keep their minimum
        for c in sorted(
            (c for c, col in enumerate(columns) if col.drop_rank),
            key=lambda c: columns[c].drop_rank,
        ):
            if total() - sum(widths[k] - floor(k, False) for k in cuts) <= width:
                break
            shown[c] = False
            widths[c] = -2  # and its separator
        # then cut: the widest column first, down to each column's minimum (columns come out
        # balanced), then in rank order down to their headers
        while total() > width:
            able = [c for c in cuts if shown[c] and widths[c] > floor(c, False)]
            if not able:
                break
            c = max(able, key=lambda c: (widths[c], -columns[c].cut_rank))
            widths[c] -= 1
        for c in cuts:
            over = total() - width
            if over <= 0:
                break
            if shown[c]:
                widths[c] = max(floor(c, True), widths[c] - over)

    def line(cells: Sequence[str], style: str | None) -> str:
        out = []
        for c, v in enumerate(cells):
            if not shown[c]:
                continue
            v = _cut(v, widths[c], columns[c].cut or "end").ljust(widths[c])
            out.append((v, style if style and columns[c].styled else None))
        plain = "  ".join(v for v, _ in out).rstrip()
        if width is not None and len(plain) > width:
            # even the narrowest forms are too wide: cut the line (and drop its colour rather
            # than cut an escape code in half)
            return plain[:width]
        if not color:
            return plain
        coloured = "  ".join(f"{s}{v}{RESET}" if s else v for v, s in out)
        return coloured.rstrip()

    lines = [line([col.header for col in columns], None), line(["-" * w for w in widths], None)]
    for r in range(len(rows)):
        style = styles[r] if styles is not None and color else None
        lines.append(line([text(r, c) for c in range(len(columns))], style))
    return "\n".join(lines)


# -- shorter forms ----------------------------------------------------------------------------


def run_tails(names: Sequence[str]) -> dict[str, str]:
    """Each run's shortest tail of path components that no other listed run ends with
    (``dino/20261130_101500`` -> ``20261130_101500``); `--run` accepts the same tails."""
    out: dict[str, str] = {}
    unique = sorted(set(names))
    for name in unique:
        parts = name.split("/")
        for k in range(1, len(parts) + 1):
            tail = "/".join(parts[-k:])
            if not any(o != name and (o == tail or o.endswith("/" + tail)) for o in unique):
                break
        out[name] = tail
    return out


def time_forms(value: str | None) -> tuple[str, ...]:
    """``2026-11-30T10:18:04.000Z`` -> itself, ``2026-11-30 10:18:04``, ``11-30 10:18``."""
    if not value:
        return ("-",)
    v = str(value)
    if len(v) >= 19 and v[10] == "T":
        return (v, f"{v[:10]} {v[11:19]}", f"{v[5:10]} {v[11:16]}")
    return (v,)


# -- the tables -------------------------------------------------------------------------------


def _style(inc: Doc) -> str | None:
    if inc.get("status") != "open":
        return RESOLVED_STYLE
    return STYLES.get(str(inc.get("severity") or "critical"))


def incidents_table(
    incidents: Sequence[Doc], *, width: int | None = None, color: bool = False
) -> str:
    from ..render import origin_text

    tails = run_tails([str(i.get("run") or "-") for i in incidents])
    rows = []
    for i in incidents:
        run = str(i.get("run") or "-")
        rows.append(
            (
                i["id"],
                i["status"],
                i["kind"],
                (run, tails[run]) if tails[run] != run else run,
                ranks_text(i.get("ranks") or []),
                i.get("event_count", 0),
                time_forms(i.get("first_time")),
                origin_text(i.get("origin") or {}),
                # the RUN column says it already
                str(i.get("title") or "").replace(f" (run {run})", ""),
            )
        )
    columns = [
        Column("ID"),
        Column("STATUS", styled=True),
        Column("KIND", styled=True),
        Column("RUN", squeeze=1, cut="start", cut_rank=3, min_width=8, keep=True),
        Column("RANKS"),
        Column("EVENTS", drop_rank=2),
        Column("FIRST", squeeze=2),
        Column("ORIGIN", cut="end", cut_rank=2, min_width=12, drop_rank=1),
        # the title goes first when space runs out: `show ID` tells the whole story
        Column("TITLE", cut="end", cut_rank=1, min_width=20),
    ]
    return fit(rows, columns, width=width, styles=[_style(i) for i in incidents], color=color)


def events_table(events: Sequence[Doc], *, width: int | None = None, color: bool = False) -> str:
    tails = run_tails([str(e.get("run") or "-") for e in events])

    def dash(v: object) -> object:
        return "-" if v is None else v

    rows = []
    for e in events:
        run = str(e.get("run") or "-")
        rows.append(
            (
                e["id"],
                time_forms(e.get("time")),
                e["kind"],
                (run, tails[run]) if tails[run] != run else run,
                dash(e.get("rank")),
                e.get("stage") or "-",
                dash(e.get("epoch")),
                dash(e.get("iter")),
                dash(e.get("step")),
                e.get("message") or "",
            )
        )
    columns = [
        Column("ID"),
        Column("TIME", squeeze=2),
        Column("KIND"),
        Column("RUN", squeeze=1, cut="start", cut_rank=2, min_width=8, keep=True),
        Column("RANK"),
        Column("STAGE", drop_rank=1),
        Column("EPOCH", drop_rank=3),
        Column("ITER", drop_rank=2),
        Column("STEP"),
        Column("MESSAGE", cut="end", cut_rank=1, min_width=16),
    ]
    return fit(rows, columns, width=width, color=color)


def runs_table(runs: Sequence[Doc], *, width: int | None = None) -> str:
    tails = run_tails([str(r["name"]) for r in runs])
    rows = [
        (
            r["id"],
            (r["name"], tails[r["name"]]) if tails[r["name"]] != r["name"] else r["name"],
            r.get("status") or "-",
            time_forms(r.get("first_time")),
            time_forms(r.get("last_time")),
            r.get("experiment") or "-",
            r.get("sources", 0),
            r.get("events", 0),
            r.get("incidents", 0),
            r.get("path") or "",
        )
        for r in runs
    ]
    columns = [
        Column("ID"),
        Column("RUN", squeeze=1, cut="start", cut_rank=3, min_width=8, keep=True),
        Column("STATUS"),
        Column("START", squeeze=2),
        Column("END", squeeze=3),
        Column("EXPERIMENT", cut="start", cut_rank=2, min_width=10, drop_rank=2),
        Column("FILES", drop_rank=3),
        Column("EVENTS"),
        Column("INCIDENTS"),
        Column("PATH", cut="start", cut_rank=1, min_width=10, drop_rank=1),
    ]
    return fit(rows, columns, width=width)
