"""Two lanes for ``pytest -n 2`` (pytest-xdist): Spark's tests in one worker, the rest beside it.

On its own, a run keeps about half of the machine's two cores busy: the
Spark tests mostly wait (on a JVM starting, a trigger's interval, a child
``spark-submit``), the JVM-free tests (state, pubsub, tools) are CPU work in
one process. Run in two xdist workers, the JVM-free tests fill the Spark
tests' waits. Which test runs where is not left to chance:

* ``session`` tests use the run's SparkSession (``spark``); they all go, in
  their collection order and as soon as the run starts, to the first worker
  (``gw0``), so the run still starts one SparkSession and every one of those
  tests shares it, as in a run without xdist.
* ``jvm`` tests start Spark jobs of their own (``spark-submit``, a local
  cluster, Spark Connect: marked ``spark`` or asking for a fixture that
  builds such jobs). A work unit is a module, or a directory with its own
  ``conftest.py`` (``tests/ops``), so a unit's module- and session-scoped
  fixtures are made once; units are handed out whole, the largest first.
* ``free`` tests start no JVM; they are handed out a few at a time.

The first worker takes the session tests first. After that, and from the
start on every other worker, a worker takes a ``jvm`` unit that is ready, else
``free`` tests, else a ``jvm`` unit that is not ready yet. A unit is ready once
the jobs that ``early`` runs in the background for its fixtures (the class-data
sharing archive, the wheel, the fresh install) are done: until then its tests
would only wait. So the long ``jvm`` units start as soon as they can, beside the
session tests, and the many short ``free`` tests even out the end of the run.

The kinds are decided where the items are (in each worker, at collection:
``write_kinds``), from the items' fixtures and marks, and read by the
scheduler in the controlling process (``LaneScheduling``) from a file
beside the workers' base temporary directories. A test missing from that
file counts as ``free``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import early
import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScheduling
from xdist.workermanage import WorkerController

SESSION_FIXTURES = frozenset({"spark", "spark_session"})
"""Fixtures that are (or use) the run's one SparkSession."""
JVM_FIXTURES = frozenset({"spark_submit_java_options", "built", "fresh_install"})
"""Fixtures behind tests that start Spark jobs of their own."""
FREE_CHUNK = 8
"""At most this many ``free`` tests are sent to a worker at once (fewer near the end)."""
SESSION_WORKER = "gw0"

_TESTS = Path(__file__).resolve().parent


def kind(item: pytest.Item) -> str:
    """``session``, ``jvm:<unit>`` or ``free`` (see the module's doc)."""
    names = set(getattr(item, "fixturenames", ()))
    if names & SESSION_FIXTURES:
        return "session"
    if names & JVM_FIXTURES or item.get_closest_marker("spark") is not None:
        path = item.path.resolve()
        unit = path
        for parent in path.parents:
            if parent == _TESTS or _TESTS not in parent.parents:
                break
            if (parent / "conftest.py").is_file():
                unit = parent
        return f"jvm:{unit.relative_to(_TESTS.parent)}"
    return "free"


def _kinds_file(basetemp: Path, worker: str) -> Path:
    return basetemp / f"lanes-{worker}.json"


def write_kinds(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """In an xdist worker: write each collected test's kind for the scheduler to read."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    basetemp = getattr(config.option, "basetemp", None)
    if not worker or not basetemp:
        return
    kinds = {item.nodeid: kind(item) for item in items}
    needs: dict[str, set[str]] = {}
    for item in items:
        jobs = early.jobs_of(getattr(item, "fixturenames", ()))
        if kinds[item.nodeid].startswith("jvm:"):
            needs.setdefault(kinds[item.nodeid], set()).update(jobs)
    path = _kinds_file(Path(basetemp).parent, worker)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"kinds": kinds, "needs": {u: sorted(n) for u, n in needs.items()}}))
    tmp.replace(path)


def is_lane_worker() -> bool:
    """Whether this process runs the background lane of ``early``: the last xdist worker (which
    starts with the JVM-free tests), or the only process of a run without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return True
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return worker == f"gw{count - 1}"


class LaneScheduling(LoadScheduling):
    """xdist's load scheduling, with the queues and the rules of the module's doc."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        self.session_q: list[int] = []
        self.units: list[list[int]] = []
        self.free_q: list[int] = []
        self.kinds: dict[int, str] = {}
        self.needs: dict[str, list[str]] = {}
        """For each ``jvm`` unit, the ``early`` jobs its tests wait for."""

    # --- queues -------------------------------------------------------------------------

    def _basetemp(self) -> Path:
        return Path(self.config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]

    def _read_kinds(self) -> dict[str, str]:
        kinds: dict[str, str] = {}
        for node in self.node2collection:
            try:
                written = json.loads(_kinds_file(self._basetemp(), node.gateway.id).read_text())
            except (OSError, ValueError):
                continue
            kinds.update(written["kinds"])
            self.needs.update(written["needs"])
        return kinds

    def _ready(self, unit: list[int]) -> bool:
        """Whether the ``early`` jobs the unit's tests wait for are done."""
        jobs = self.needs.get(self.kinds[unit[0]], [])
        return all(early.done(self._basetemp(), job) for job in jobs)

    def _queue(self, indices: Sequence[int], front: bool = False) -> None:
        """Put tests (back) in the queue of their kind, in collection order."""
        session = [i for i in indices if self.kinds[i] == "session"]
        free = [i for i in indices if self.kinds[i] == "free"]
        units: dict[str, list[int]] = {}
        for i in indices:
            if self.kinds[i].startswith("jvm:"):
                units.setdefault(self.kinds[i], []).append(i)
        if front:
            self.session_q[:0] = session
            self.free_q[:0] = free
            self.units[:0] = list(units.values())
        else:
            self.session_q += session
            self.free_q += free
            self.units += sorted(units.values(), key=len, reverse=True)

    @property
    def pending(self) -> list[int]:  # type: ignore[override]
        """Every test not sent to a worker yet (xdist's ``LoadScheduling`` reads this)."""
        return self.session_q + [i for u in self.units for i in u] + self.free_q

    @pending.setter
    def pending(self, value: list[int]) -> None:
        if value:
            self._queue(value)

    def _session_node(self) -> WorkerController | None:
        for node in self.node2pending:
            if node.gateway.id == SESSION_WORKER and not node.shutting_down:
                return node
        return None

    def _take(self, node: WorkerController) -> list[int]:
        """The next tests for ``node``, by its lane's order; empty when none are for it."""
        session_node = self._session_node()
        if self.session_q and node is (session_node or node):
            taken, self.session_q = self.session_q, []
            return taken
        for unit in self.units:
            if self._ready(unit):
                self.units.remove(unit)
                return unit
        if self.free_q:
            chunk = max(1, min(FREE_CHUNK, len(self.free_q) // (4 * len(self.node2pending))))
            taken, self.free_q = self.free_q[:chunk], self.free_q[chunk:]
            return taken
        if self.units:
            return self.units.pop(0)
        return []

    # --- xdist's scheduling protocol --------------------------------------------------------

    @property
    def tests_finished(self) -> bool:
        if not self.collection_is_completed or self.pending:
            return False
        return all(len(p) < 2 for p in self.node2pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.pending) or any(self.node2pending.values())

    def mark_test_pending(self, item: str) -> None:
        assert self.collection is not None
        self._queue([self.collection.index(item)], front=True)
        for node in self.node2pending:
            self.check_schedule(node)

    def check_schedule(self, node: WorkerController, duration: float = 0) -> None:
        if node.shutting_down:
            return
        # A worker runs a test once it holds the next one (its teardown depends on it), or
        # once it is told that no more will come: so it holds two, or gets shut down.
        pending = self.node2pending[node]
        sent: list[int] = []
        while len(pending) + len(sent) < 2:
            taken = self._take(node)
            if not taken:
                break
            sent += taken
        if sent:
            pending.extend(sent)
            node.send_runtest_some(sent)
        if not self.pending:
            node.shutdown()

    def remove_node(self, node: WorkerController) -> str | None:
        pending = self.node2pending.pop(node)
        if not pending:
            return None
        assert self.collection is not None
        crashitem = self.collection[pending.pop(0)]
        self._queue(pending, front=True)
        for other in self.node2pending:
            self.check_schedule(other)
        return crashitem

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:
            for node in self.nodes:
                self.check_schedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        if not self.collection:
            return
        named = self._read_kinds()
        self.kinds = {i: named.get(nodeid, "free") for i, nodeid in enumerate(self.collection)}
        self._queue(range(len(self.collection)))
        # The session worker first: it gets the session tests even if another is ready sooner.
        for node in sorted(self.nodes, key=lambda n: n.gateway.id != SESSION_WORKER):
            self.check_schedule(node)
