"""The read side's store API: records under the CLI's filters."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.store import Store
from nanwatch.store.reads import Reads
from nanwatch.store.records import EventRow, IncidentRow, Run, RunSummary
from nanwatch.store.runs import Runs

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def hccl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two NPU nodes whose ranks time out on HCCL (EI0002) after rank 5 was killed."""
    tmp = tmp_path_factory.mktemp("reads")
    shutil.copytree(FIXTURES / "npu_rank_killed_hccl" / "logs", tmp / "logs")
    db = tmp / "nw.db"
    r = CliRunner().invoke(cli, ["scan", "--db", str(db), str(tmp / "logs")])
    assert r.exit_code == 0, r.output
    return db


def test_records_and_filters(hccl: Path) -> None:
    store = Store.open(hccl, readonly=True)
    try:
        runs = Runs(store)
        (summary,) = runs.summaries()
        assert isinstance(summary, RunSummary) and summary.status == "failing"
        run = runs.by_name(summary.run.name)
        assert isinstance(run, Run) and run == summary.run and runs.by_name("nope") is None
        assert runs.names() == [run.name] == runs.names_of([run.id, 999])
        assert runs.facts(run.id) == run.facts
        reads = Reads(store)
        incidents = reads.incidents()
        assert incidents and all(isinstance(i, IncidentRow) for i in incidents)
        assert all(i.run == run for i in incidents)
        rank = incidents[0].incident.ranks[0]
        assert all(rank in i.incident.ranks for i in reads.incidents(rank=rank))
        assert reads.incidents(rank=12345) == []
        assert reads.incidents(status="resolved") == []
        assert len(reads.incidents(status="open")) == reads.open_count()
        rows = list(reads.events(rank=5))
        assert rows and all(isinstance(r, EventRow) and r.event.rank == 5 for r in rows)
        assert all(r.run == run.name and r.file for r in rows)
        assert list(reads.events(runs=["nope"])) == []
        iid = incidents[0].incident.id
        timeline = reads.timeline(iid)
        total = sum(t.count for t in timeline)
        assert total == len(list(reads.events(incident=iid)))
    finally:
        store.close()
