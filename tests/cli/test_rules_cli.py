"""`nanwatch rules` and `nanwatch explain`, in-process and as a subprocess; broken site packs."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from nanwatch.cli import cli

from ..conftest import nanwatch

SITE_PACK = """
[pack]
id = "site"
title = "Our trainer"

[[rule]]
id = "site.loss_exploded"
kind = "nan"
literals = ["LOSS EXPLODED"]
pattern = 'LOSS EXPLODED at step (?P<step>\\d+)'
[[rule.example]]
line = "!!! LOSS EXPLODED at step 412"
event = { kind = "nan", step = 412 }
"""


def _config(tmp_path: Path, pack: str) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "ours.toml").write_text(pack, encoding="utf-8")
    cfg = tmp_path / "nanwatch.toml"
    cfg.write_text(f'[detect]\nrule_dirs = ["{site}"]\n', encoding="utf-8")
    return cfg


def test_rules_lists_shipped_and_site_packs(tmp_path: Path) -> None:
    cfg = _config(tmp_path, SITE_PACK)
    res = CliRunner().invoke(cli, ["rules", "--json", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines()]
    ids = {r["id"]: r for r in rows}
    assert ids["site.loss_exploded"]["kind"] == "nan"
    assert ids["nccl.watchdog_timeout"]["kind"] == "comm_timeout"
    assert ids["amp.deepspeed_overflow"]["incident"] is False
    assert ids["common.prefix.torchrun_rank"]["type"] == "prefix"
    text = CliRunner().invoke(cli, ["rules", "--kind", "oom"])
    assert text.exit_code == 0
    assert "oom.torch_caching_allocator" in text.output
    assert "nccl.watchdog_timeout" not in text.output


def test_explain_a_line_and_stdin(tmp_path: Path) -> None:
    cfg = _config(tmp_path, SITE_PACK)
    res = CliRunner().invoke(
        cli, ["explain", "--config", str(cfg), "!!! LOSS EXPLODED at step 412"]
    )
    assert res.exit_code == 0, res.output
    assert "site.loss_exploded" in res.output
    assert "step = 412" in res.output
    block = (
        '  File "/opt/mmengine/model/wrappers/distributed.py", line 141, in val_step\n'
        "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB (NPU 3; 60.96 GiB total "
        "capacity; 58.10 GiB already allocated; 1.20 GiB free)\n"
    )
    res = CliRunner().invoke(cli, ["explain", "--json", "-"], input=block)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [e["kind"] for e in out["events"]] == ["oom"]
    ev = out["events"][0]
    assert ev["stage"] == "val"
    assert ev["device"] == "npu"
    assert ev["fields"]["device_index"] == 3
    assert {m["rule"] for m in out["matches"]} >= {"common.hint.val_frame"}


def test_explain_says_when_nothing_matches() -> None:
    res = CliRunner().invoke(cli, ["explain", "Loading the tokenizer from /models/base"])
    assert res.exit_code == 0
    assert "No rule matches." in res.output


def test_broken_site_pack_fails_at_start_naming_file_rule_and_reason(tmp_path: Path) -> None:
    broken = SITE_PACK.replace("(?P<step>\\d+)", "(?P<step>\\d+")
    cfg = _config(tmp_path, broken)
    proc = nanwatch("rules", "--config", str(cfg), check=False)
    assert proc.returncode == 1
    assert "ours.toml" in proc.stderr
    assert "site.loss_exploded" in proc.stderr
    assert "does not compile" in proc.stderr
    # scan and watch load the same packs: they refuse to start too
    log = tmp_path / "train.log"
    log.write_text("loss: nan\n", encoding="utf-8")
    db = tmp_path / "db.sqlite"
    proc = nanwatch("scan", "--config", str(cfg), "--db", str(db), str(log), check=False)
    assert proc.returncode == 1
    assert "site.loss_exploded" in proc.stderr


def test_unknown_key_in_a_site_rule_names_the_nearest(tmp_path: Path) -> None:
    cfg = _config(tmp_path, SITE_PACK.replace("literals =", "literal ="))
    res = CliRunner().invoke(cli, ["rules", "--config", str(cfg)])
    assert res.exit_code == 1
    assert "site.loss_exploded" in res.output
    assert "did you mean 'literals'" in res.output


# an example that only passes through a shipped rule: `loss: nan` is mmengine's line, not ours
BORROWED = (
    SITE_PACK
    + """[[rule.example]]
line = "Epoch(train) [1][10/16]  lr: 1.0000e-02  loss: nan"
event = { kind = "nan" }
"""
)


def test_check_runs_a_pack_folder_and_the_shipped_examples(tmp_path: Path) -> None:
    site = tmp_path / "packs"
    site.mkdir()
    (site / "ours.toml").write_text(SITE_PACK, encoding="utf-8")
    res = CliRunner().invoke(cli, ["rules", "--check", str(site)])
    assert res.exit_code == 0, res.output
    first = res.output.split()
    assert first[0] == first[2], res.output  # "N of N examples pass"
    assert int(first[0]) > 400


def test_check_of_a_folder_the_config_also_names(tmp_path: Path) -> None:
    cfg = _config(tmp_path, SITE_PACK)
    res = CliRunner().invoke(
        cli, ["rules", "--config", str(cfg), "--check", str(tmp_path / "site")]
    )
    assert res.exit_code == 0, res.output


def test_check_fails_on_an_example_its_rule_does_not_match(tmp_path: Path) -> None:
    site = tmp_path / "packs"
    site.mkdir()
    (site / "ours.toml").write_text(BORROWED, encoding="utf-8")
    proc = nanwatch("rules", "--check", str(site), check=False)
    assert proc.returncode == 1, proc.stdout
    assert "ours.toml: rule 'site.loss_exploded', example 1: not matched by its own rule" in (
        proc.stderr
    )
    assert "mmengine.nonfinite" in proc.stderr
    res = CliRunner().invoke(cli, ["rules", "--check", str(site), "--json"])
    assert res.exit_code == 1
    rows = [json.loads(line) for line in res.output.splitlines()]
    assert [(r["rule"], r["example"]) for r in rows] == [("site.loss_exploded", 1)]


CONTEXT_PACK = """
[pack]
id = "site"
title = "Our trainer"

[[rule]]
id = "site.phase"
type = "context"
literals = ["phase "]
pattern = 'phase (?P<stage>train|eval)\\b'
[[rule.example]]
line = "phase eval begins"
state = { stage = "val" }
[[rule.example]]
note = "claims the rule reads nothing here, but it reads the stage"
line = "phase train of the warm-up"
state = {}
"""


def test_check_fails_on_a_context_example_that_says_nothing_is_read_but_is(
    tmp_path: Path,
) -> None:
    site = tmp_path / "packs"
    site.mkdir()
    (site / "ours.toml").write_text(CONTEXT_PACK, encoding="utf-8")
    res = CliRunner().invoke(cli, ["rules", "--check", str(site), "--json"])
    assert res.exit_code == 1, res.output
    rows = [json.loads(line) for line in res.output.splitlines()]
    assert [(r["rule"], r["example"]) for r in rows] == [("site.phase", 1)]
    (site / "ours.toml").write_text(
        CONTEXT_PACK.replace("phase train of the warm-up", "warm-up only"), encoding="utf-8"
    )
    res = CliRunner().invoke(cli, ["rules", "--check", str(site), "--json"])
    assert res.exit_code == 0, res.output


def test_a_claimed_example_passes_only_through_the_rule_it_names(tmp_path: Path) -> None:
    site = tmp_path / "packs"
    site.mkdir()
    claimed = BORROWED.replace(
        '[[rule.example]]\nline = "Epoch(train)',
        '[[rule.example]]\nclaimed_by = "mmengine.nonfinite"\nline = "Epoch(train)',
    )
    assert claimed != BORROWED
    (site / "ours.toml").write_text(claimed, encoding="utf-8")
    res = CliRunner().invoke(cli, ["rules", "--check", str(site)])
    assert res.exit_code == 0, res.output
    (site / "ours.toml").write_text(
        claimed.replace('claimed_by = "mmengine.nonfinite"', 'claimed_by = "oom.cuda_error"'),
        encoding="utf-8",
    )
    res = CliRunner().invoke(cli, ["rules", "--check", str(site)])
    assert res.exit_code == 1
    assert "not claimed by oom.cuda_error" in res.output + (res.stderr or "")


def test_site_pack_with_a_failing_example_is_a_config_error_at_start(tmp_path: Path) -> None:
    cfg = _config(tmp_path, BORROWED)
    log = tmp_path / "train.log"
    log.write_text("!!! LOSS EXPLODED at step 3\n", encoding="utf-8")
    db = tmp_path / "db.sqlite"
    proc = nanwatch("scan", "--config", str(cfg), "--db", str(db), str(log), check=False)
    assert proc.returncode == 1
    assert "ours.toml: rule 'site.loss_exploded', example 1" in proc.stderr
    assert "nanwatch rules --check" in proc.stderr


def test_numeric_priority_is_refused_with_the_tier_to_use(tmp_path: Path) -> None:
    cfg = _config(tmp_path, SITE_PACK.replace('kind = "nan"\n', 'kind = "nan"\npriority = 25\n'))
    res = CliRunner().invoke(cli, ["rules", "--config", str(cfg)])
    assert res.exit_code == 1
    assert "ours.toml: rule 'site.loss_exploded'" in res.output
    assert 'replace it with `tier = "specific"`' in res.output


def test_unknown_tier_names_the_tiers(tmp_path: Path) -> None:
    cfg = _config(tmp_path, SITE_PACK.replace('kind = "nan"\n', 'kind = "nan"\ntier = "high"\n'))
    res = CliRunner().invoke(cli, ["rules", "--config", str(cfg)])
    assert res.exit_code == 1
    assert "tier must be one of specific, family, generic; got 'high'" in res.output


def test_a_site_rule_in_a_tier_comes_before_shipped_rules_of_that_tier(tmp_path: Path) -> None:
    """Site packs are tried first within a tier: a `family` site rule takes mmengine's line."""
    pack = SITE_PACK.replace("LOSS EXPLODED at step (?P<step>\\d+)", "loss: (?P<value>nan)")
    pack = pack.replace('literals = ["LOSS EXPLODED"]', 'literals = ["loss: nan"]')
    pack = pack.replace("!!! LOSS EXPLODED at step 412", "Epoch(train) [1][10/16]  loss: nan")
    pack = pack.replace('event = { kind = "nan", step = 412 }', 'event = { kind = "nan" }')
    cfg = _config(tmp_path, pack)
    res = CliRunner().invoke(
        cli, ["explain", "--json", "--config", str(cfg), "Epoch(train) [1][10/16]  loss: nan"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["events"][0]["fields"]["rule"] == "site.loss_exploded"
    cfg.unlink()
    cfg.write_text(f'[detect]\nrule_dirs = ["{tmp_path / "site"}"]\n', encoding="utf-8")
    (tmp_path / "site" / "ours.toml").write_text(
        pack.replace('kind = "nan"\n', 'kind = "nan"\ntier = "generic"\n', 1), encoding="utf-8"
    )
    # a generic site rule below mmengine's family rule: its own example no longer reaches it
    res = CliRunner().invoke(cli, ["rules", "--config", str(cfg)])
    assert res.exit_code == 1
    assert "not matched by its own rule (matched only by mmengine.nonfinite" in res.output
