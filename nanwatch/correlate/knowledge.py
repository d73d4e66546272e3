"""The known-causes knowledge base (``alerts/*.toml`` and site folders).

An entry says when it applies to an incident, what to tell people and what to run::

    [[cause]]
    id = "oom-in-validation"
    title = "Validation ran out of memory; the other ranks' timeouts are a symptom"
    priority = 90                 # higher first
    text = "..."                  # may use {cann}, {torch}, ... and {rank}, {stage}, {run}
    commands = ["nanwatch events --run {run}"]   # values are shell-quoted: no quotes around {run}
    [cause.when]                  # every condition must hold
    kind = ["oom"]                # incident kind
    stage = ["val"]               # origin stage
    symptoms = ["comm_timeout"]   # the incident absorbed symptoms of one of these kinds
    backend = ["hccl"]            # some event's backend
    code = ["EI0002"]             # some event's error code
    message = 'regex'             # some event's message
    tensor = 'regex'              # origin tensor or first parameter
    module = 'regex'              # origin module
    tag = ["grad_unreduced"]      # origin tag
    versions = { cann = "<8.0.0" }   # unknown versions match, and the hint says how to find them
    [[cause.example]]             # an incident it must match (run by the tests)
    kind = "oom"
    origin = { stage = "val", rank = 3 }
    symptoms = ["comm_timeout"]
    [[cause.counterexample]]      # one it must not match
    kind = "oom"
    origin = { stage = "train" }
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field
from pathlib import Path

from .._dc import dataclass
from ..errors import RuleError
from ..store.events import Events
from ..store.records import JSON, Run
from .commands import check_command, fill_command
from .facts import HOW_TO_FIND, LABELS, node_cann_version, satisfies
from .samples import SAMPLE_REASONS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_CAUSE_KEYS = {
    "id",
    "title",
    "priority",
    "text",
    "commands",
    "when",
    "example",
    "counterexample",
    "url",
    "description",
}
_WHEN_KEYS = {
    "kind",
    "stage",
    "symptoms",
    "backend",
    "code",
    "message",
    "tensor",
    "module",
    "tag",
    "versions",
    "phase",
    "data_issue",
    "fields",
}
_EXAMPLE_KEYS = {
    "kind",
    "origin",
    "symptoms",
    "backends",
    "codes",
    "messages",
    "versions",
    "data_issue",
    "fields",
    "stage",
}


@dataclass(frozen=True)
class Situation:
    """What the knowledge base sees of an incident."""

    kind: str
    origin: Mapping[str, JSON] = field(default_factory=dict)
    symptoms: frozenset[str] = frozenset()
    backends: frozenset[str] = frozenset()
    codes: frozenset[str] = frozenset()
    messages: tuple[str, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict)
    version_sources: Mapping[str, str] = field(default_factory=dict)
    unknown: Mapping[str, str] = field(default_factory=dict)  # version -> why the run cannot tell
    data_issue: bool = False
    fields: Mapping[str, frozenset[JSON]] = field(default_factory=dict)
    run: str | None = None
    work_dir: str | None = None
    # more values hints may name: {incident}, {config}, {annotations}, {classes}
    extra: Mapping[str, JSON] = field(default_factory=dict)


@dataclass(frozen=True)
class Cause:
    id: str
    title: str
    text: str
    commands: tuple[str, ...]
    priority: int
    when: Mapping[str, JSON]
    source: Path
    examples: tuple[Situation, ...] = ()
    counterexamples: tuple[Situation, ...] = ()
    patterns: Mapping[str, re.Pattern[str]] = field(default_factory=dict)

    def matches(self, s: Situation) -> bool:
        w = self.when
        o = s.origin
        if "kind" in w and s.kind not in w["kind"]:
            return False
        if "stage" in w and (o.get("stage") or "") not in w["stage"]:
            return False
        if "phase" in w and (o.get("phase") or "") not in w["phase"]:
            return False
        if "symptoms" in w and not (set(w["symptoms"]) & s.symptoms):
            return False
        if "backend" in w and not ({b.lower() for b in w["backend"]} & s.backends):
            return False
        if "code" in w and not (set(w["code"]) & s.codes):
            return False
        if "tag" in w:
            tags = {o.get("tag"), (o.get("first_param") or {}).get("tag")}
            if not (set(w["tag"]) & tags):
                return False
        if "data_issue" in w and bool(w["data_issue"]) != s.data_issue:
            return False
        p = self.patterns
        if "message" in p and not any(p["message"].search(m) for m in s.messages):
            return False
        if "tensor" in p:
            names = [o.get("tensor"), (o.get("first_param") or {}).get("tensor")]
            if not any(n and p["tensor"].search(str(n)) for n in names):
                return False
        if "module" in p:
            mods = [o.get("module"), *(o.get("candidate_modules") or [])]
            if not any(m and p["module"].search(str(m)) for m in mods):
                return False
        for name, values in (w.get("fields") or {}).items():
            if not (set(values) & set(s.fields.get(name, ()))):
                return False
        for name, constraint in (w.get("versions") or {}).items():
            v = s.versions.get(name)
            if v is not None and not satisfies(v, constraint):
                return False
        return True

    def hint(self, s: Situation) -> dict[str, JSON]:
        values: dict[str, JSON] = dict(s.versions)
        values.update({k: s.origin.get(k) for k in ("rank", "stage", "step", "tensor", "module")})
        values["run"] = s.run
        values["work_dir"] = s.work_dir
        # the config file the run's work_dir holds (mmengine dumps it there), the incident...
        for k in ("config", "incident", "annotations", "classes"):
            values[k] = s.extra.get(k)
        text = _fill(self.text, values)
        commands = [fill_command(c, values) for c in self.commands]
        notes = []
        for name, constraint in (self.when.get("versions") or {}).items():
            v = s.versions.get(name)
            if v is None:
                find = HOW_TO_FIND.get(name, (f"pip show {name}",))
                why = s.unknown.get(name)
                also = f" (or `{find[1]}`)" if len(find) > 1 else ""
                notes.append(
                    f"{LABELS.get(name, name)} version unknown"
                    + (f" ({why})" if why else "")
                    + f": run `{find[0]}`{also}; this applies if it is {constraint}."
                )
                # the command that settles it comes first
                commands = [find[0], *(c for c in commands if c != find[0])]
            else:
                where = s.version_sources.get(name)
                notes.append(
                    f"{name} {v}" + (f" ({where})" if where else "") + f" is {constraint}."
                )
        if notes:
            text = text.rstrip() + "\n" + "\n".join(notes)
        return {
            "id": self.id,
            "title": _fill(self.title, values),
            "text": text,
            "commands": commands,
        }


def _run_values(incident_id: int, run: Run | None) -> dict[str, JSON]:
    from .runconfig import config_file, config_values

    out: dict[str, JSON] = {"incident": incident_id}
    if run is None:
        return out
    launch = run.name.rsplit("/", 1)[-1] if "/" in run.name else None
    path = config_file(run.root, run.experiment, launch)
    if path is not None:
        out["config"] = str(path)
        out.update(config_values(path))
    return out


def _fill(template: str, values: Mapping[str, JSON]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in values:
            return m.group(0)
        v = values[name]
        return str(v) if v is not None else f"<{name}>"

    return re.sub(r"\{(\w+)\}", sub, template)


def _commands(src: Path, cid: str, raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(c, str) for c in raw):
        raise _fail(src, cid, "commands: expected a list of strings")
    for i, c in enumerate(raw):
        why = check_command(c)
        if why:
            raise _fail(src, cid, f"commands[{i}] {c!r}: {why}")
    return tuple(raw)


def _situation(raw: Mapping[str, JSON]) -> Situation:
    return Situation(
        kind=raw.get("kind", ""),
        origin={"stage": raw.get("stage"), **raw.get("origin", {})},
        symptoms=frozenset(raw.get("symptoms", ())),
        backends=frozenset(b.lower() for b in raw.get("backends", ())),
        codes=frozenset(raw.get("codes", ())),
        messages=tuple(raw.get("messages", ())),
        versions=raw.get("versions", {}),
        data_issue=bool(raw.get("data_issue", False)),
        fields={k: frozenset(v) for k, v in raw.get("fields", {}).items()},
    )


def _fail(src: Path, cid: str | None, msg: str) -> RuleError:
    return RuleError(f"{src}" + (f": cause {cid!r}" if cid else "") + f": {msg}")


def _keys(
    src: Path, cid: str | None, table: Mapping[str, JSON], valid: set[str], what: str
) -> None:
    for k in table:
        if k not in valid:
            near = difflib.get_close_matches(k, sorted(valid), n=1, cutoff=0.5)
            hint = (
                f"; did you mean {near[0]!r}?" if near else f"; valid: {', '.join(sorted(valid))}"
            )
            raise _fail(src, cid, f"unknown key {k!r} in {what}{hint}")


def load_causes(src: Path, seen: dict[str, Path]) -> list[Cause]:
    try:
        data = tomllib.loads(src.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise _fail(src, None, f"not valid TOML: {e}") from None
    out = []
    for k in data:
        if k != "cause":
            raise _fail(src, None, f"unknown table {k!r}; a knowledge file holds [[cause]] entries")
    for raw in data.get("cause", []):
        cid = raw.get("id")
        if not isinstance(cid, str):
            raise _fail(src, None, "a [[cause]] has no id")
        if cid in seen:
            raise _fail(src, cid, f"duplicate id (also in {seen[cid]})")
        seen[cid] = src
        _keys(src, cid, raw, _CAUSE_KEYS, "[[cause]]")
        when = raw.get("when", {})
        _keys(src, cid, when, _WHEN_KEYS, "[cause.when]")
        for need in ("title", "text"):
            if not isinstance(raw.get(need), str):
                raise _fail(src, cid, f"missing `{need}`")
        patterns = {}
        for key in ("message", "tensor", "module"):
            if key in when:
                try:
                    patterns[key] = re.compile(when[key])
                except re.error as e:
                    raise _fail(src, cid, f"when.{key} does not compile: {e}") from None
        for name, c in (when.get("versions") or {}).items():
            try:
                satisfies("1.0", c)
            except ValueError as e:
                raise _fail(src, cid, f"when.versions.{name}: {e}") from None
        examples = []
        for group in ("example", "counterexample"):
            sits = []
            for ex in raw.get(group, []):
                _keys(src, cid, ex, _EXAMPLE_KEYS, f"[[cause.{group}]]")
                sits.append(_situation(ex))
            examples.append(tuple(sits))
        if not examples[0] or not examples[1]:
            raise _fail(
                src, cid, "needs at least one [[cause.example]] and one [[cause.counterexample]]"
            )
        out.append(
            Cause(
                id=cid,
                title=raw["title"],
                text=raw["text"],
                commands=_commands(src, cid, raw.get("commands", [])),
                priority=int(raw.get("priority", 0)),
                when=when,
                source=src,
                examples=examples[0],
                counterexamples=examples[1],
                patterns=patterns,
            )
        )
    return out


class Knowledge:
    """Matches incidents against the known causes and renders the hints."""

    MAX_HINTS = 4

    def __init__(
        self,
        causes: Sequence[Cause],
        *,
        cann_version: str | None = None,
        node_facts: bool = True,
    ) -> None:
        self.causes = sorted(causes, key=lambda c: -c.priority)
        # precedence: the config, then what the run printed, then this node's install
        self.configured: dict[str, tuple[str, str]] = {}
        self.node: dict[str, tuple[str, str]] = {}
        if cann_version:
            self.configured["cann"] = (cann_version, "[knowledge] cann_version")
        if node_facts:
            v, where = node_cann_version()
            if v:
                self.node["cann"] = (v, f"this node's {where}")

    @classmethod
    def load(
        cls,
        dirs: Iterable[str | Path] = (),
        *,
        builtin: bool = True,
        cann_version: str | None = None,
        node_facts: bool = True,
    ) -> Knowledge:
        from ..detect.resources import data_dir

        folders = [Path(d) for d in dirs]
        if builtin:
            folders.append(data_dir("alerts"))
        seen: dict[str, Path] = {}
        causes: list[Cause] = []
        for d in folders:
            if not d.is_dir():
                raise RuleError(f"{d}: knowledge folder not found; fix [knowledge] dirs")
            for f in sorted(d.glob("*.toml")):
                causes.extend(load_causes(f, seen))
        return cls(causes, cann_version=cann_version, node_facts=node_facts)

    def situation(
        self,
        events: Events,
        incident_id: int,
        kind: str,
        origin: Mapping[str, JSON],
        detail: Mapping[str, JSON],
        run: Run | None,
    ) -> Situation:
        rows = events.backends_and_codes(incident_id)
        kinds = {r[0] for r in rows}
        backends = {str(r[1]).lower() for r in rows if r[1]}
        codes = {str(r[2]) for r in rows if r[2]}
        first = events.of_incident(incident_id, limit=50)
        messages = [e.message for e in first]
        facts = run.facts if run is not None else {}
        known: dict[str, tuple[str, str]] = dict(self.configured)
        for name, v in (facts.get("versions") or {}).items():
            if v:
                known.setdefault(name, (str(v), "printed by the run"))
        for name, pair in self.node.items():
            known.setdefault(name, pair)
        versions = {k: v for k, (v, _) in known.items()}
        sources = {k: where for k, (_, where) in known.items()}
        told = facts.get("unknown") or {}
        unknown = {str(k): str(why) for k, why in told.items() if k not in versions and why}
        # samples with empty ground truth count when they came just before this incident (the
        # NaN story links them); other data issues (msprobe's empty tensors) anywhere in the run
        data_issue = bool(detail.get("related_data_issues")) or (
            events.run_has_data_issue(run.id, except_reasons=SAMPLE_REASONS)
            if run is not None
            else False
        )
        fields: dict[str, set[JSON]] = {}
        for e in first:
            for k, v in e.fields.items():
                if isinstance(v, (str, int, float, bool)):
                    fields.setdefault(k, set()).add(v)
        return Situation(
            kind=kind,
            origin=origin,
            symptoms=frozenset(kinds - {kind}),
            backends=frozenset(backends),
            codes=frozenset(codes),
            messages=tuple(messages),
            versions=versions,
            version_sources=sources,
            unknown=unknown,
            data_issue=data_issue,
            fields={k: frozenset(v) for k, v in fields.items()},
            run=run.name if run is not None else None,
            work_dir=run.root if run is not None else None,
            extra=_run_values(incident_id, run),
        )

    def match(self, s: Situation) -> list[dict[str, JSON]]:
        return [c.hint(s) for c in self.causes if c.matches(s)][: self.MAX_HINTS]

    def hints_for(
        self,
        events: Events,
        incident_id: int,
        kind: str,
        origin: Mapping[str, JSON],
        detail: Mapping[str, JSON],
        run: Run | None,
    ) -> list[dict[str, JSON]]:
        return self.match(self.situation(events, incident_id, kind, origin, detail, run))
