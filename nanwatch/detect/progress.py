"""A metric line read by its structure, whatever the framework that printed it.

Training loops print, every logged step, a line of ``key: value`` pairs: a loss, counters
(epoch, iteration, step, a ``N/M`` position) and sometimes the mode. The packs name the common
formats one by one (common.toml's progress rules); this reader is what is left when none of
them knows the line: it finds

- the loss: a key ending in ``loss`` with a number, ``nan`` or ``inf`` after it (``loss: 0.5``,
  ``Loss nan``, ``'train_loss': 2.1``, ``loss/total=0.3``), never a loss scale;
- the counters: ``epoch``/``iter``/``iteration``/``step``/``global step``/``batch`` followed by a
  number (``Epoch 2/30``, ``iter 3010:``, ``[step] 104``, ``Global Step: 20``), and the bare
  position of a progress bar (tqdm's ``431/788222 [29:28<...``, Keras' ``365/5427 [=>...``, a
  bracket ``600 / 1000]``) as the iteration;
- the stage: the mode words on the line (``Training:``, ``[Epoch 0 / Train]``, ``val loss``);
  mode words that disagree (nanoGPT's ``train loss 4.03, val loss 4.04``) say nothing, and a
  plain loss with no mode word is a training step's (evaluation loops print ``val_loss`` or name
  their mode).

It reads one line and keeps nothing; the engine calls it on the lines of events only (a NaN
metric's own line, and the lines before a failure report that has no counters of its own), so
it costs nothing on lines that give no event.
"""

from __future__ import annotations

import dataclasses
import re

from .._dc import dataclass
from .rules import normalize_stage

LINE_MAX = 4000  # what is read of one line

_LOSS = re.compile(
    r"(?i)(?P<key>(?<![\w/.\-])[a-z_][\w/.\-]{0,60}?)?loss"
    r"(?!\.(?:cu|cuh|cc|cpp|cxx|c|h|hpp|py|pyx)[:\"\s])"  # a source file ("Loss.cu:257")
    r"(?P<tail>[\w/.\-]{0,30}?)"
    r"['\"]?\]?[ \t]{0,3}"
    r"(?:[:=][ \t]{0,3}|[ \t]{1,3})['\"]?[-+]?(?:\d|\.\d|nan(?![a-z])|inf(?![a-z]))"
)
_COUNTER = re.compile(
    r"(?i)(?<![\w])(?<!\w-)(?P<key>epoch|ep|pass|iteration|iter|step|global[ _]step"
    r"|total[ _]step(?!s)|batch|num_updates)s?"
    r"(?:/(?:max|total|num)_?\w{0,12})?\b['\"]?\]?"  # a position's key: "global_step/max_steps"
    # a separator after the padding of an aligned table ("epoch    =    5.0") or a tight one
    r"(?:[ \t]{0,40}[:=][ \t]{0,12}|[ \t]{0,3}#?[ \t]{0,3})"
    # the number, never a bar's share ("Iteration:  31%|")
    r"['\"]?[\[(]?[ \t]{0,3}(?P<n>\d{1,12})(?:\.0{1,6}(?![\d.]))?(?!%)"
    r"(?:[ \t]{0,2}/[ \t]{0,2}(?P<of>\d{1,12}))?(?![\d.])"
    r"(?![ \t]{0,3}->)"  # "(batch 32 -> 30)": a size that changed, not a position
)
# a progress bar's position: tqdm's "431/788222 [29:28<...", Keras' "365/5427 [=>..." and a
# closing bracket "[ 600 / 1000]"
_POSITION = re.compile(
    r"(?<![\w./:\-])(?P<n>\d{1,12})[ \t]{0,2}/[ \t]{0,2}(?P<of>\d{1,12})"
    r"(?:[ \t]{1,3}\[(?=\d{1,4}:\d\d|[=>.\u2026 ])|[ \t]{0,2}\]"
    r"|[ \t]{1,2}\([ \t]{0,2}\d{1,3}(?:\.\d{1,2})?%\)\])"  # "[640/60000 (1%)]"
)
# a tqdm bar's rate in epochs: "98/150 [18:47:34<9:58:18, 690.35s/epoch, loss=-1.01]"
_EPOCH_UNIT = re.compile(r"(?:[ \t]{0,3}\[)?[^\]\n]{0,60}?(?:s/epoch|epochs?/s)\b")
# a bar named for the epochs it counts: "Epoch:   3%|▎         | 10/321 [..."
_EPOCH_DESC = re.compile(r"(?i)^[ \t]{0,8}epochs?[ \t]{0,2}:?[ \t]{1,8}\d{1,3}%")
_MODE = re.compile(
    r"(?i)(?<![\w./\-])(train(?:ing)?|val(?:id|idation|idating)?|eval(?:uate|uating|uation)?"
    r"|test(?:ing)?)(?![\w.\-/])"
)
# a metric's key that a mode word heads ("Train-SmoothL1=0.4", "eval/acc: 0.7"): the line's
# mode when all such keys agree (Lightning's bar shows "training/loss=..., validation/loss=..."
# on a training step; Keras' "val_loss" beside a plain "loss" likewise, see _progress)
_MODE_KEY = re.compile(
    r"(?i)(?<![\w./\-])(train(?:ing)?|val(?:id|idation)?|eval(?:uation)?|test)"
    r"(?=[-/][A-Za-z][\w\-/.]{0,40}[ \t]{0,2}[:=][ \t]{0,2}['\"]?[-+]?(?:\d|\.\d|nan|inf))"
)
_KEY_STAGE = re.compile(r"(?i)^(train|val|valid|validation|eval|test|dev)(?:[_/.\-]|$)")


# A line that prints both a loss and the optimizer's learning rate is a training step's, whatever
# the framework: validation, evaluation and inference print no learning rate (mmengine's
# Epoch(val), HF's eval_* dicts, Lightning's validation bars). Read only on lines that gave an
# event whose stream names no stage; nothing else makes a stage "train".
_TRAIN_LINE = re.compile(
    r"(?i)^(?=[^\n]{0,2000}?\bloss\b['\"]?[ \t]{0,3}[:=])[^\n]{0,2000}?(?<![\w.])"
    r"(?:lr|learning[ _]rate)['\"]?[ \t]{0,3}[:=][ \t]{0,3}['\"]?[-+]?\.?\d"
)
# ... or it prints a loss and a step or iteration counter, and no evaluation word
_STEP_LINE = re.compile(
    r"(?i)^(?![^\n]{0,2000}?(?<![\w])(?:val|valid|validation|eval|evaluat\w*|test(?:ing)?)(?![a-z]))"
    r"(?=[^\n]{0,2000}?(?<![\w])\[?loss\b(?:['\"]?[ \t]{0,3}[:=]|\][ \t]{0,3}[:=]?))"
    r"[^\n]{0,2000}?(?<![\w.])\[?(?:step|iter(?:ation)?)\b\]?['\"]?[ \t]{0,3}[:=\[]?[ \t]{0,3}\d"
)
# ... or it prints the learning rate beside an epoch, iteration or step counter, and no
# evaluation word ("Epoch 10 ; Iter 50/213 ; LR 1.0000 ; PPL nan"): the optimizer's step
_LR_COUNTER_LINE = re.compile(
    r"(?i)^(?![^\n]{0,2000}?(?<![\w])(?:val|valid|validation|eval|evaluat\w*|test(?:ing)?)(?![a-z]))"
    r"(?=[^\n]{0,2000}?(?<![\w.])(?:epoch|iter(?:ation)?|step)s?\b[ \t]{0,3}[:=#\[]?[ \t]{0,3}\d)"
    r"[^\n]{0,2000}?(?<![\w.])(?:lr|learning[ _]rate)\b['\"]?"
    r"(?:[ \t]{0,3}[:=][ \t]{0,3}|[ \t]{1,3})['\"]?\[?[-+]?\.?\d"  # "lr=[0.0003, 0.0003]": groups
)
# A metric line's own rank, epoch and step, in the bracketed style of custom trainers: "[R0]",
# "E6 iter[ 14/ 15]" or "Epoch 6" / "Epoch: [6]", "[step] 104"
# ... or a key-value line that ends with its rank ("... loss nan lr 0.00004 rank 3", WeNet's)
_LINE_RANK = re.compile(
    r"(?<![\w\[])\[R(\d{1,5})\]|(?<![\w.\-])rank[ \t]{0,2}[:=]?[ \t]{0,2}(\d{1,6})[ \t]*$"
    r"|(?<![\w.\-])rank[ \t]{0,2}[:=][ \t]{0,2}(\d{1,6})[ \t]*[,;|]"  # "train, rank: 0, epoch: 3"
)
_LINE_EPOCH = re.compile(
    r"(?<![\w.])(?:E(\d{1,5})(?=[ \t]+(?:iter|step|it)\b)"
    r"|[Ee]poch[ \t]{0,2}:?[ \t]{0,2}\[?[ \t]{0,2}(\d{1,5})\b(?![.\d]))"
)
_LINE_STEP = re.compile(r"\[(?:step|Step|STEP|global_step)\][ \t]{0,3}[:=]?[ \t]{0,3}(\d{1,12})\b")


@dataclass(frozen=True)
class LineProgress:
    """What one metric line says about where the run is."""

    loss: bool  # the line prints a loss
    stage: str | None = None
    epoch: int | None = None
    iter: int | None = None
    step: int | None = None
    rank: int | None = None

    @property
    def counted(self) -> bool:
        return self.epoch is not None or self.iter is not None or self.step is not None


def read(text: str, at: int | None = None) -> LineProgress | None:
    """The progress ``text`` prints, or None when it prints neither a loss nor a counter; with
    ``at``, the stage is that of the value at that position."""
    text = text[:LINE_MAX]
    losses = [m for m in _LOSS.finditer(text) if "scal" not in (m.group("tail") or "").lower()]
    epoch = it = step = None
    taken: list[tuple[int, int]] = []  # the counters' spans: "Epoch [2/10]" is no position
    for m in _COUNTER.finditer(text):
        taken.append(m.span())
        n, of = int(m.group("n")), m.group("of")
        if of is not None and n > int(of):
            continue  # "3/2" is not a position
        key = m.group("key").lower()
        if key in ("epoch", "ep", "pass"):  # Paddle 1.x: "Pass 34, batch 80, loss ..."
            epoch = n if epoch is None else epoch
        elif key in ("iter", "iteration", "batch"):
            it = n if it is None else it
        else:
            step = n if step is None else step
    if it is None:
        for m in _POSITION.finditer(text):
            if any(a < m.end() and m.start() < b for a, b in taken):
                continue
            n, of = int(m.group("n")), int(m.group("of"))
            if of > 0 and n <= of:
                if epoch is None and (_EPOCH_UNIT.match(text, m.end()) or _EPOCH_DESC.match(text)):
                    epoch = n  # a bar whose unit (or whose name) is the epoch counts epochs
                else:
                    it = n
                break
    if not losses and epoch is None and it is None and step is None:
        return None
    if at is not None:
        # a value's own mode: the nearest mode word before it ("train loss 3.9, val loss nan"
        # is a validation NaN; in "ep=23 tr=[...] loss=nan valid=dev loss=nan" the first NaN
        # has none before it: a plain loss, the training one)
        words = [m.group(1) for m in _MODE.finditer(text, 0, at)]
        losses = [m for m in losses if m.start() <= at] or losses[:1]
        if words:
            return _progress(losses, text, {normalize_stage(words[-1])}, epoch, it, step)
        return _progress(losses, text, set(), epoch, it, step)
    stages = {normalize_stage(w) for w in _MODE.findall(text)}
    keyed = {normalize_stage(w) for w in _MODE_KEY.findall(text)}
    if len(keyed) == 1:
        stages |= keyed
    return _progress(losses, text, stages, epoch, it, step)


def _progress(
    losses: list[re.Match[str]],
    text: str,
    stages: set[str | None],
    epoch: int | None,
    it: int | None,
    step: int | None,
) -> LineProgress:
    # a plain loss beside a val_loss is a training step that also reports its validation
    # (Keras' epoch summary); only a line of qualified losses takes its mode from their keys
    plain = any(not _KEY_STAGE.match((m.group("key") or "").lower()) for m in losses)
    if not plain:
        for m in losses:
            qualified = _KEY_STAGE.match((m.group("key") or "").lower())
            if qualified:
                stages.add(normalize_stage(qualified.group(1)))
    stages.discard(None)
    stage: str | None = None
    if len(stages) == 1:
        stage = stages.pop()
    elif not stages and plain:
        stage = "train"
    rank_m = _LINE_RANK.search(text)
    return LineProgress(
        loss=bool(losses),
        stage=stage,
        epoch=epoch,
        iter=it,
        step=step,
        rank=int(next(g for g in rank_m.groups() if g)) if rank_m else None,
    )


# a loss or a gradient named on a line, whatever follows ("Loss is nan", "NaN loss", "the grad
# norm is nan"), and the words that make it an evaluation's
_TRAINING_VALUE = re.compile(
    r"(?i)(?<![\w])(?P<pre>[a-z]{1,12}[_ /.\-])?"
    r"(?:loss(?:es)?|grad(?:ient)?s?(?:[_ ]?norm)?)(?![a-z])"
)
_EVAL_PREFIX = re.compile(r"(?i)^(?:val|valid|validation|eval|evaluation|test|dev)[_ /.\-]$")


def training_value(text: str) -> bool:
    """Does ``text`` speak of a loss or a gradient that is not an evaluation's, on a line with no
    mode word? Only training computes gradients, and a loss that nothing qualifies (no
    ``val_loss``, no ``Epoch(val)``) is the training loop's: the reading for a non-finite value
    in a stream that names no stage."""
    text = text[:LINE_MAX]
    if _MODE.search(text):
        return False
    return any(not _EVAL_PREFIX.match(m.group("pre") or "") for m in _TRAINING_VALUE.finditer(text))


def before(
    chunk: bytes, start: int, lines: int = 200, span: int = 32768, floor: int = 0
) -> LineProgress | None:
    """The nearest line before ``start`` in ``chunk`` that prints a loss (the last logged step
    before a failure report: its counters and its mode), looking back at most ``lines`` lines and
    ``span`` bytes, none below ``floor``; the epoch may come from a line above it (Keras
    prints ``Epoch 3/10`` on a line of its own)."""
    lo = max(floor, start - span)
    window = chunk[lo:start].decode("utf-8", "replace").split("\n")
    if lo > floor or (lo > 0 and chunk[lo - 1 : lo] != b"\n"):
        window = window[1:]  # the first piece is a line cut in its middle
    found: LineProgress | None = None
    bar: LineProgress | None = None  # the nearest bare progress bar, when no loss line is found
    seen = 0
    for text in reversed(window[-lines:]):
        if not text.strip():
            continue
        if not _TRACEBACK_LINE.match(text):
            seen += 1  # a traceback's frames are one report, however deep: the bar is before it
        p = read(text)
        if p is None:
            continue
        bare = found is None and bar is None and seen <= BAR_LINES and p.iter is not None
        if bare and _BARE_BAR.match(text):
            bar = p
        if found is None:
            if p.loss:
                found = p
                if found.epoch is not None and found.counted:
                    return found
            elif _header(text, p):
                # the report is inside a block of metric lines (one per line) whose header
                # names the step: "Learning iteration 8391/10000", "t = 15500 / 300000"; a
                # bare bar between them counts the steps of the epoch the header names
                if p.stage is None and _LR_COUNTER_LINE.search(text):
                    # a learning rate beside the counter: the optimizer's loop
                    p = dataclasses.replace(p, stage="train")
                if bar is not None and p.iter is None and p.step is None:
                    return LineProgress(
                        False, p.stage or bar.stage, p.epoch, bar.iter, None, p.rank
                    )
                return p
            continue
        if not found.counted:
            # a block of metric lines: the counters are on the block's header above them,
            # unless a line with a loss and counters of its own comes first (another step's)
            if p.counted:
                if p.loss:
                    return found
                return LineProgress(
                    True, found.stage or p.stage, p.epoch, p.iter, p.step, found.rank
                )
            continue
        if p.epoch is not None and not p.loss:
            return LineProgress(
                found.loss, found.stage, p.epoch, found.iter, found.step, found.rank
            )
    return found if found is not None else bar


# A progress bar with no description ("  5%|███▌   | 5/100 [00:09<02:51, ...]"): the training
# bar of HF's Trainer and of most loops that wrap their steps in tqdm. A bar that says what it
# counts ("Loading checkpoint shards: 100%|...| 4/4") is not the run's position. A report that
# follows such a bar within a few lines, with no loss line nearer, happened at its position.
_BARE_BAR = re.compile(r"^[ \t]{0,8}\d{1,3}%\|")
_EPOCH_BAR = re.compile(r"^[ \t]{0,8}Epoch[ \t]{1,3}\d{1,6}:[ \t]{1,8}\d{1,3}%\|")  # Lightning's
# a bar whose description is a mode word: "steps:  0% 0/2300 [", "Train: 4%|"
_NAMED_BAR = re.compile(
    r"^[ \t]{0,8}(?P<desc>[A-Za-z]{2,20})[ \t]?:?[ \t]{1,8}\d{1,3}%"
    r"(?:\||[ \t]{1,4}\d{1,12}/\d{1,12} \[)"
)
BAR_LINES = 8
# a traceback's own lines: its header, its frames, their source lines (indented deeper than any
# bar) and the carets under them
_TRACEBACK_LINE = re.compile(
    r"^(?:\[[^\]\n]{1,40}\]:)?(?:[ \t]*File \"|Traceback \(most recent call last\)"
    r"|[ \t]{4,}\S|[ \t]*[\^~]+[ \t]*$)"
)


def _header(text: str, p: LineProgress) -> bool:
    """Is ``text`` a block's header: counters named by their words and no loss (not a bare
    ``N/M``, which any progress bar, a shard loader's too, prints)?"""
    named = _COUNTER.search(text) is not None or _EPOCH_DESC.match(text) is not None
    return p.counted and not p.loss and named


REPEAT_HEAD = 16  # a line that begins as the report's own line did is the same notice again
# a line's time stamp is no part of how it begins: "[2026-03-02 10:00:01,100][root][WARNING] -"
_STAMP = re.compile(rb"[\d \t\[\]\-:.,/TZ+]*")


def _head(line: bytes) -> bytes:
    """How ``line`` begins after its time stamp: the first REPEAT_HEAD bytes of the rest."""
    m = _STAMP.match(line, 0, 64)
    lead = m.end() if m else 0
    return line[lead : lead + REPEAT_HEAD]


REPEATS_MAX = 64  # of those, how many the look-ahead steps over


def after(chunk: bytes, start: int, lines: int = 3) -> LineProgress | None:
    """The logged step within ``lines`` lines after the line at ``start``, when one prints a
    loss beside a counter: a report printed just before a step's log line (a skipped step's
    overflow notice, a warning raised inside the step) belongs to that step."""
    end = chunk.find(b"\n", start)
    own = chunk[start : end if end >= 0 else len(chunk)]
    head = _head(own)
    # a line that ends in blanks was wrapped where it was copied: the counters of its record
    # may be on the next line ("... Loss nan   LearningRate 0.001   " / "Epoch: 0   Step: 20")
    wrapped = own.rstrip(b"\r").endswith((b" ", b"\t"))
    left, repeats = lines, REPEATS_MAX
    while left > 0:
        if end < 0:
            return None
        nxt = chunk.find(b"\n", end + 1)
        raw = chunk[end + 1 : nxt if nxt >= 0 else len(chunk)]
        end = nxt
        if len(head) == REPEAT_HEAD and _head(raw) == head and repeats > 0:
            # the same notice again ("Gradient overflow. Skipping step" before each step
            # line): the step it belongs to is after the run of them
            repeats -= 1
            continue
        left -= 1
        text = raw.decode("utf-8", "replace")
        p = read(text)
        if p is None or not p.counted:
            wrapped = False
            continue
        if wrapped and left == lines - 1:
            return p  # the rest of the report's own record
        if p.loss or _BARE_BAR.match(text):
            # a step's log line, or the bar redrawn right after the report (tqdm refreshes it
            # as the step logs or the exception leaves its loop): its position is the report's
            return p
        if _LR_COUNTER_LINE.search(text):
            # the optimizer's report of the step ("step=228, skipped=1, lr=[...]"): training's
            return p if p.stage else dataclasses.replace(p, stage="train")
        # an epoch's bar trains (an evaluation has a bar of its own: common.iter.epoch_bar); a
        # bar named by its mode ("steps", "Training", "Validation") is that mode's step
        if _EPOCH_BAR.match(text):
            mode: str | None = "train"
        else:
            named = _NAMED_BAR.match(text)
            mode = normalize_stage(named["desc"]) if named else None
        if mode is not None:
            return p if p.stage else dataclasses.replace(p, stage=mode)
    return None


def bracketed_fields(text: str) -> dict[str, int]:
    """The rank, epoch and step a metric line prints in the bracketed style, when it does."""
    out: dict[str, int] = {}
    for name, pattern in (("rank", _LINE_RANK), ("epoch", _LINE_EPOCH), ("step", _LINE_STEP)):
        m = pattern.search(text)
        if m is not None:
            out[name] = int(next(g for g in m.groups() if g is not None))
    return out


def line_stage(text: str, line: LineProgress | None, *, nonfinite: bool) -> str | None:
    """The stage an event's own line names when its stream names none: a training step's line
    (a loss beside a learning rate, or beside a step counter with no evaluation word), else
    the mode :func:`read` found, else, for a non-finite value, a loss or gradient that no mode
    qualifies (:func:`training_value`)."""
    if _TRAIN_LINE.search(text) or _STEP_LINE.search(text) or _LR_COUNTER_LINE.search(text):
        return "train"
    if line is not None and line.stage is not None:
        return line.stage
    if nonfinite and training_value(text):
        return "train"
    return None
