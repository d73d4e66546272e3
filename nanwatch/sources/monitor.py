"""Recognising msprobe monitor output by its shape on disk.

V1 (``TrainerMon``): ``$MONITOR_OUTPUT_DIR/{MonDD_HH-MM-SS}-rank{R}-{id}/{family}_{S}-{E}.csv``
(``_part_N`` when one write exceeded msprobe's rows-per-file limit), ``stack_info.csv`` beside
them, ``anomaly_detected/rank{R}/anomaly.json`` (rewritten in place after each step),
``module_struct/rank{R}/module_struct.json``. Monitor V2: ``rank_{R}/{family}_step{S}-{E}.csv``.
The folder time is Asia/Shanghai, whatever the machine's zone (msprobe hard-codes it).
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from functools import lru_cache

from .._dc import dataclass
from ..events import TAGS
from .dates import infer_year, zoned_epoch


class _Lazy:
    """A pattern compiled when first used: a start that meets no msprobe output compiles none."""

    __slots__ = ("_compiled", "_source")

    def __init__(self, source: str) -> None:
        self._source = source
        self._compiled: re.Pattern[str] | None = None

    @property
    def compiled(self) -> re.Pattern[str]:
        if self._compiled is None:
            self._compiled = re.compile(self._source)
        return self._compiled

    def match(self, text: str) -> re.Match[str] | None:
        return self.compiled.match(text)

    def search(self, text: str) -> re.Match[str] | None:
        return self.compiled.search(text)


# msprobe matches its own folders with `([\w-]{0,20})-rank(\d{1,5})-`; the time is '%b%d_%H-%M-%S'
RANK_DIR = _Lazy(
    r"^(?P<ts>[A-Za-z]{3}\d{2}_\d{2}-\d{2}-\d{2})-rank(?P<rank>\d{1,5})-(?P<uid>[0-9A-Za-z]{1,32})$"
)
V2_RANK_DIR = _Lazy(r"^rank_(?P<rank>\d{1,5})$")
_V1_CSV = _Lazy(
    r"^(?P<family>[a-z][a-z_]*?)_(?P<start>\d+)-(?P<end>\d+)(?:_part_(?P<part>\d+))?\.csv$"
)
_V2_CSV = _Lazy(
    r"^(?P<family>[a-z][a-z_]*?)_step(?P<start>\d+)-(?P<end>\d+)(?:_part_(?P<part>\d+))?\.csv$"
)
_ANOMALY = _Lazy(r"(?:^|/)anomaly_detected/rank(?P<rank>\d{1,5})/anomaly\.json$")
_STRUCT = _Lazy(r"(?:^|/)module_struct/rank(?P<rank>\d{1,5})/module_struct\.json$")

V1_FAMILIES = frozenset(TAGS)  # msprobe's CSV prefixes are the vocabulary's tensor tags
# Families msprobe also writes that carry no per-tensor NaN statistics nanwatch uses.
V1_OTHER = frozenset(
    ("other", "linear_hook", "attention_hook", "moe_router_weight_hook", "moe_router_logit_hook")
)
V2_FAMILIES = frozenset(("module", "weight_grad", "optimizer", "param"))
V2_OTHER = frozenset(("cc",))

_SHANGHAI = _dt.timezone(_dt.timedelta(hours=8))
_shanghai_epoch = zoned_epoch(_SHANGHAI)
_MONTH_NAMES = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTHS = {m: i for i, m in enumerate(_MONTH_NAMES, 1)}


@dataclass(frozen=True)
class MonitorFile:
    """What a path is within msprobe's output."""

    kind: str  # csv | anomaly | ignore
    version: int  # 1 (TrainerMon) or 2 (Monitor V2)
    family: str  # the CSV prefix (V1) or slug (V2); '' for non-CSV files
    rank: int | None
    start: int | None = None  # step range in the file name
    end: int | None = None
    part: int | None = None

    @property
    def base_csv(self) -> str | None:
        """For a ``_part_N`` file: the name of the file of the same write that has the header."""
        if self.part is None or self.start is None:
            return None
        step = "_step" if self.version == 2 else "_"
        return f"{self.family}{step}{self.start}-{self.end}.csv"


@lru_cache(maxsize=65536)
def classify(path: str) -> MonitorFile | None:
    """A monitor file, or None for anything else (read as text by the rule packs)."""
    if not path.endswith((".csv", ".json")):
        return None  # every monitor file is one (the patterns below say so)
    norm = path.replace(os.sep, "/")
    m = _ANOMALY.search(norm)
    if m:
        return MonitorFile("anomaly", 1, "", int(m["rank"]))
    if norm.endswith("/anomaly_analyse.json") and "/anomaly_detected" in norm:
        return MonitorFile("ignore", 1, "", None)  # msprobe's own top-k of the dumps: a copy
    m = _STRUCT.search(norm)
    if m:
        return MonitorFile("ignore", 1, "", int(m["rank"]))
    folder, name = os.path.split(path)
    dname = os.path.basename(folder)
    d1 = RANK_DIR.match(dname)
    if d1 is not None:
        if name == "stack_info.csv":
            return MonitorFile("ignore", 1, "", int(d1["rank"]))
        m = _V1_CSV.match(name)
        if m is None:
            return None
        family = m["family"]
        if family not in V1_FAMILIES:
            return MonitorFile("ignore", 1, family, int(d1["rank"])) if family in V1_OTHER else None
        return MonitorFile(
            "csv",
            1,
            family,
            int(d1["rank"]),
            int(m["start"]),
            int(m["end"]),
            int(m["part"]) if m["part"] else None,
        )
    d2 = V2_RANK_DIR.match(dname)
    if d2 is not None:
        m = _V2_CSV.match(name)
        if m is None or m["family"] not in V2_FAMILIES | V2_OTHER:
            return None
        kind = "csv" if m["family"] in V2_FAMILIES else "ignore"
        return MonitorFile(
            kind,
            2,
            m["family"],
            int(d2["rank"]),
            int(m["start"]),
            int(m["end"]),
            int(m["part"]) if m["part"] else None,
        )
    return None


def folder_time(name: str, bound: float) -> float | None:
    """Start time (epoch seconds) of a V1 rank folder ``Nov30_15-48-51-rank1-de3ab572``.

    The name has no year: the one :func:`nanwatch.sources.dates.infer_year` gives for a
    folder that was created before ``bound`` (its mtime: msprobe writes into it after naming it).
    """
    m = RANK_DIR.match(name)
    if m is None:
        return None
    ts = m["ts"]
    month = _MONTHS.get(ts[:3].title())
    if month is None:
        return None
    day, hh, mm, ss = int(ts[3:5]), int(ts[6:8]), int(ts[9:11]), int(ts[12:14])
    year = infer_year(month, day, hh, mm, ss, bound=bound, epoch=_shanghai_epoch)
    return None if year is None else _shanghai_epoch(year, month, day, hh, mm, ss)
