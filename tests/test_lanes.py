"""The xdist scheduler of ``tests/lanes.py``, driven by simulated workers (no process started).

A simulated worker runs its first pending test only while it holds a second one or has
been told to shut down, as xdist's workers do: a schedule that leaves a worker holding a
single test with no shutdown hangs the run, and the simulation fails instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import early
import pytest
from lanes import SESSION_WORKER, LaneScheduling


class Worker:
    """What the scheduler sees of an xdist worker, recording what it was sent."""

    def __init__(self, wid: str) -> None:
        self.gateway = SimpleNamespace(id=wid)
        self.shutting_down = False
        self.ran: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        pass

    def shutdown(self) -> None:
        self.shutting_down = True


def _config(basetemp: Path, workers: int) -> SimpleNamespace:
    values = {"tx": [f"{workers}*popen"], "maxschedchunk": None}
    return SimpleNamespace(
        getvalue=values.__getitem__,
        getoption=values.__getitem__,
        _tmp_path_factory=SimpleNamespace(getbasetemp=lambda: basetemp),
    )


def _run(
    basetemp: Path, kinds: dict[str, str], needs: dict[str, list[str]], workers: int = 2
) -> tuple[list[Worker], list[str]]:
    """Schedule ``kinds`` (nodeid -> kind) on simulated workers, one test at a time, round
    robin; the early job ``cds`` is done once 4 tests have run. Returns the workers and the
    order the tests ran in."""
    nodeids = list(kinds)
    (basetemp / "lanes-gw0.json").write_text(json.dumps({"kinds": kinds, "needs": needs}))
    sched = LaneScheduling(_config(basetemp, workers))  # type: ignore[arg-type]
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)  # type: ignore[arg-type]
    for node in nodes:
        sched.add_node_collection(node, nodeids)  # type: ignore[arg-type]
    assert sched.collection_is_completed
    sched.schedule()
    order: list[str] = []
    while not sched.tests_finished:
        progressed = False
        for node in nodes:
            pending = sched.node2pending[node]  # type: ignore[index]
            if pending and (len(pending) >= 2 or node.shutting_down):
                index = pending[0]
                node.ran.append(index)
                order.append(nodeids[index])
                if len(order) == 4:
                    (basetemp / "early-jobs").mkdir()
                    (basetemp / "early-jobs" / "cds.pickle").write_bytes(b"")
                sched.mark_test_complete(node, index)  # type: ignore[arg-type]
                progressed = True
        assert progressed, "every worker waits: the run would hang"
    # The tests each worker still held when the scheduler saw the end: run them too.
    for node in nodes:
        for index in sched.node2pending[node]:  # type: ignore[index]
            node.ran.append(index)
            order.append(nodeids[index])
    assert sorted(order) == sorted(nodeids), "every test runs exactly once"
    return nodes, order


def _kinds(session: int, units: dict[str, int], free: int) -> dict[str, str]:
    kinds = {f"s{i}": "session" for i in range(session)}
    for unit, n in units.items():
        kinds.update({f"{unit}{i}": f"jvm:{unit}" for i in range(n)})
    kinds.update({f"f{i}": "free" for i in range(free)})
    return kinds


@pytest.mark.parametrize("free", [0, 1, 2, 3, 40])
@pytest.mark.parametrize("session", [0, 1, 5])
def test_every_test_runs_once_and_session_tests_on_one_worker(
    tmp_path: Path, session: int, free: int
) -> None:
    kinds = _kinds(session, {"ops": 3, "kill": 1}, free)
    nodes, _ = _run(tmp_path, kinds, {"jvm:ops": ["cds"], "jvm:kill": []})
    ids = list(kinds)
    by_worker = {n.gateway.id: {ids[i] for i in n.ran} for n in nodes}
    assert {i for i in ids if kinds[i] == "session"} <= by_worker[SESSION_WORKER]
    for unit in ("ops", "kill"):
        members = {i for i in ids if kinds[i] == f"jvm:{unit}"}
        assert any(members <= ran for ran in by_worker.values()), f"{unit} split"


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_unit_waits_for_its_early_jobs_while_free_tests_remain(
    tmp_path: Path, workers: int
) -> None:
    kinds = _kinds(2, {"ops": 2}, 30)
    _, order = _run(tmp_path, kinds, {"jvm:ops": ["cds"]}, workers)
    first_ops = min(order.index(i) for i in kinds if i.startswith("ops"))
    assert first_ops >= 4, order  # not before "cds" was done


def test_few_tests_few_per_worker_still_finish(tmp_path: Path) -> None:
    for n in range(1, 6):
        base = tmp_path / str(n)
        base.mkdir()
        _run(base, _kinds(0, {}, n), {})


def test_done_reads_the_shared_result(tmp_path: Path) -> None:
    assert not early.done(tmp_path, "cds")
    (tmp_path / "early-jobs").mkdir()
    (tmp_path / "early-jobs" / "cds.pickle").write_bytes(b"")
    assert early.done(tmp_path, "cds")
