"""The knowledge base: every cause matches its examples and none of its counterexamples."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanwatch.correlate import facts
from nanwatch.correlate.facts import node_cann_version, satisfies, version_key
from nanwatch.correlate.knowledge import Knowledge, Situation
from nanwatch.errors import RuleError

KB = Knowledge.load(node_facts=False)


def _cases() -> list[object]:
    out = []
    for c in KB.causes:
        for i, s in enumerate(c.examples):
            out.append(pytest.param(c, s, True, id=f"{c.id}-example{i}"))
        for i, s in enumerate(c.counterexamples):
            out.append(pytest.param(c, s, False, id=f"{c.id}-counter{i}"))
    return out


@pytest.mark.parametrize(("cause", "situation", "expected"), _cases())
def test_cause_examples(cause: object, situation: Situation, expected: bool) -> None:
    assert cause.matches(situation) is expected  # type: ignore[attr-defined]


def test_only_applicable_hints_are_attached() -> None:
    oom = Situation(
        kind="oom",
        origin={"stage": "val", "rank": 3},
        symptoms=frozenset({"comm_timeout"}),
        backends=frozenset({"hccl"}),
    )
    ids = [h["id"] for h in KB.match(oom)]
    assert ids[0] == "oom-validation-collective-timeouts"
    assert not any("embedding" in i or "cann" in i for i in ids)
    nan = Situation(
        kind="nan",
        origin={
            "tensor": "module.dn_query_generator.label_embedding.weight",
            "tag": "grad_unreduced",
            "rank": 6,
        },
    )
    hints = KB.match(nan)
    ids = [h["id"] for h in hints]
    assert ids[:2] == ["nan-embedding-empty-input-cann", "empty-gt-labels-out-of-range-classes"]
    assert not any("hccl" in i or "collective" in i for i in ids)
    text = " ".join(h["title"] + h["text"] + " ".join(h["commands"]) for h in hints)
    assert "8.0.0" in text and "gt_labels" in text and "nanwatch check-dataset" in text
    assert "CANN version unknown: run `cat $ASCEND_TOOLKIT_HOME/version.cfg`" in text


def test_an_unknown_version_says_why_and_what_to_run() -> None:
    s = Situation(
        kind="nan",
        origin={"tensor": "module.x.label_embedding.weight"},
        unknown={"cann": "torch_npu is not imported by the job"},
    )
    hint = next(h for h in KB.match(s) if h["id"] == "nan-embedding-empty-input-cann")
    assert (
        "CANN version unknown (torch_npu is not imported by the job): run "
        "`cat $ASCEND_TOOLKIT_HOME/version.cfg` (or `npu-smi info`); this applies if it is <8.0.0"
    ) in hint["text"]
    assert hint["commands"][0] == "cat $ASCEND_TOOLKIT_HOME/version.cfg"


def test_known_new_cann_drops_the_cann_hint() -> None:
    kb = Knowledge.load(node_facts=False, cann_version="8.0.1")
    s = Situation(
        kind="nan", origin={"tensor": "module.x.label_embedding.weight"}, versions={"cann": "8.0.1"}
    )
    assert "nan-embedding-empty-input-cann" not in [h["id"] for h in kb.match(s)]
    s_old = Situation(
        kind="nan",
        origin={"tensor": "module.x.label_embedding.weight"},
        versions={"cann": "7.0.0"},
        version_sources={"cann": "config"},
    )
    hint = next(h for h in kb.match(s_old) if h["id"] == "nan-embedding-empty-input-cann")
    assert "cann 7.0.0 (config) is <8.0.0" in hint["text"]


@pytest.mark.parametrize(
    ("v", "c", "ok"),
    [
        ("7.0.0", "<8.0.0", True),
        ("8.0.RC2", "<8.0.0", True),
        ("8.0.0", "<8.0.0", False),
        ("8.0.1", "<8.0.0", False),
        ("8.1.RC1", ">=8.0.0", True),
        ("2.1.0a0", "<2.1.0", True),
        ("2.1.0+cpu", ">=2.1", True),
        ("7.0.0.alpha003", "<7.0.0", True),
    ],
)
def test_versions(v: str, c: str, ok: bool) -> None:
    assert satisfies(v, c) is ok


def test_version_key_orders_rc_before_final() -> None:
    assert version_key("8.0.RC1") < version_key("8.0.RC2") < version_key("8.0.0")


def test_node_cann_version_from_toolkit_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=7.0.0\ninnerversion=V100R001C13\n"
    )
    assert node_cann_version({"ASCEND_TOOLKIT_HOME": str(home)})[0] == "7.0.0"
    (home / "version.cfg").write_text("runtime_running_version=[7.0.RC1.3.b060:7.0.RC1]\n")
    assert node_cann_version({"ASCEND_TOOLKIT_HOME": str(home)})[0] == "7.0.RC1"
    # a home that does not exist is passed over for the next place (this node's own install
    # dirs, pointed at an empty folder so the answer does not depend on the machine)
    monkeypatch.setattr(facts, "_TOOLKIT_DIRS", (str(tmp_path / "no-install"),))
    missing = {"ASCEND_TOOLKIT_HOME": str(tmp_path / "none")}
    assert node_cann_version(missing) == (None, None)
    assert node_cann_version({**missing, "ASCEND_HOME_PATH": str(home)})[0] == "7.0.RC1"
    monkeypatch.setattr(facts, "_TOOLKIT_DIRS", (str(tmp_path / "no-install"), str(home)))
    assert node_cann_version(missing) == ("7.0.RC1", str(home / "version.cfg"))


def test_broken_entry_names_file_and_id(tmp_path: Path) -> None:
    (tmp_path / "site.toml").write_text(
        '[[cause]]\nid = "x"\ntitle = "t"\ntext = "t"\n[cause.when]\nknd = ["oom"]\n'
    )
    with pytest.raises(RuleError, match=r"site.toml: cause 'x': unknown key 'knd'.*'kind'"):
        Knowledge.load([tmp_path], node_facts=False)
    (tmp_path / "site.toml").write_text('[[cause]]\nid = "x"\ntitle = "t"\ntext = "t"\n')
    with pytest.raises(RuleError, match="counterexample"):
        Knowledge.load([tmp_path], node_facts=False)
