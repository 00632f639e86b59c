"""A Jepsen-style randomized checker: does a shard ever lose or duplicate a committed update?

Materialize checks persist by running a workload over deliberately
unreliable Blob and Consensus and verifying the history it produced. This is
the same idea for pyspark-persist, runnable from CI for seconds and by hand
for as long as you like::

    python -m pyspark_persist.tools.checker --seconds 3600 --backend file-sqlite --processes 2
    python -m pyspark_persist.tools.checker --seed 1234 --seconds 30     # replay a seed

What runs, all at once, each client on its own state cache and its own
seeded :class:`~pyspark_persist.state.unreliable.UnreliableBlob` /
:class:`~pyspark_persist.state.unreliable.UnreliableConsensus` (lost
replies, refused calls, timeouts, slowness):

- **writers** (threads, and optionally spawned processes): each owns a
  writer id and appends numbered writes with ``compare_and_append`` and
  explicit tokens (token = write number), retrying errors and upper
  mismatches with the same token, so a lost reply resolves to
  ``AlreadyCommitted`` or a re-commit. Sometimes a writer *abandons* a write
  after an error and moves on, so unacknowledged writes exist too. Every row
  value is unique (``write_key * 1024 + k``) and a write's size is a
  function of its key, so exactness is checkable row by row;
- **snapshot readers**: snapshots at random ``as_of`` in ``[since, upper)``,
  downgrading their since as they go so compaction can advance times;
- **one listen** from the start of the shard, the reference history: it
  records each write's time, and its reader holds since just below its
  frontier (what a real consumer does);
- **maintenance**: ``compact()`` (fan-in 2-4) and ``gc()`` with the orphan
  sweep in a loop, on top of the clients' own background maintenance (small
  ``gc_interval``). Every lost compare-and-set reply of this client runs
  another compaction (concatenating part lists) into the window before the
  reply is reported: the race in which compaction once deleted a merge that
  had landed and been merged again;
- **a slow writer**: stages its parts in Blob, waits up to 3/4 of the
  orphan sweep's short grace (``GRACE_S``), then commits, so the sweep races
  it and commits meet ``StagedPartsExpired`` (then it stages again);
- **a replacer and its reader** on a second shard: every write replaces
  the shard's contents; snapshots at random ``as_of`` must show exactly one
  write, never an older one than was acknowledged by then, and the state
  must hold only a few part references per replace.

What is checked (each failure is a *violation* with details):

- every acknowledged write appears exactly once, whole, at a time it was
  attempted at (its expected upper); an unacknowledged one appears whole or
  not at all, and only if one of its compare-and-sets had an indeterminate
  outcome; no row appears that no writer wrote;
- every snapshot equals the reference collection at its ``as_of`` (the
  listen's history up to that time), with every diff +1 (no duplicates);
- the listen's consolidated output equals the final snapshot (read with
  faults off), events are contiguous, uppers only advance (per writer:
  commits strictly increase it; per client it never goes back);
- no *leased* read (snapshot or listen) fails with ``PartNotFound``: GC
  must not delete a part a reader leases; no compaction meets a missing part
  of batches still in state; every part the final state references exists;
- the final state satisfies its invariants (batches tile ``[0, upper)``).

Reproducibility: the seed fixes every random choice (the fault sequence of
every store wrapper, write sizes, abandon decisions, as_of choices, pauses).
Thread scheduling is the OS's, so a replay makes the same decisions but
may interleave them differently; the report prints the seed to replay with.

Exit status of :func:`main`: 0 with no violation, 1 otherwise.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import functools
import multiprocessing
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pyspark_persist.state import (
    TIME,
    AlreadyCommitted,
    Committed,
    PersistClient,
    PersistConfig,
    UpperMismatch,
)
from pyspark_persist.state.blob import Blob, BlobMeta, BlobValue, open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import (
    CaSResult,
    Consensus,
    SeqNo,
    VersionedData,
    open_consensus,
)
from pyspark_persist.state.errors import (
    CorruptData,
    Determinate,
    Indeterminate,
    InvalidFrontier,
    InvalidUsage,
    PartNotFound,
    PersistError,
)
from pyspark_persist.state.logs import configure as configure_logs
from pyspark_persist.state.registry import blob_kind, consensus_kind
from pyspark_persist.state.unreliable import (
    FAULT_KINDS,
    Faults,
    UnreliableBlob,
    UnreliableConsensus,
)

SCHEMA = pa.schema([("v", pa.int64())])
ROWS_PER_KEY = 1024
"""Row values are ``write_key * ROWS_PER_KEY + k``: a row names its write."""
KEY_PER_WRITER = 10_000_000
"""Write keys are ``writer_index * KEY_PER_WRITER + write_number``."""
BACKENDS = ("mem", "file-sqlite", "file-postgres")
POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
MAX_DETAILS = 50
"""Violations listed in full; further ones are counted."""
FINISH_TIMEOUT_S = 60.0
"""How long writers may take to finish their last write, and the listen to catch up."""
SLOW_INDEX = 800
"""Writer index of the slow writer (stages, waits, commits), whose parts the sweep races."""
REPLACE_INDEX = 900
"""Writer index of the replacer, which replaces a second shard's contents with each write."""


def write_size(key: int) -> int:
    """Rows of write ``key``: mostly tiny (inline in state), every fifth big (a Blob part)."""
    n = key % KEY_PER_WRITER
    return 600 if n % 5 == 4 else 1 + n % 3


def write_values(key: int) -> list[int]:
    """The unique row values of write ``key``."""
    return [key * ROWS_PER_KEY + k for k in range(write_size(key))]


def key_of(value: int) -> int:
    """The write a row value belongs to."""
    return value // ROWS_PER_KEY


# --- fault-injecting stores that also remember indeterminate commits ---------------------------


class TrackingConsensus(UnreliableConsensus):
    """An UnreliableConsensus that counts, per thread, compare_and_sets with unknown outcome.

    Why: a write that was never acknowledged may appear only if one of its
    compare-and-sets had an indeterminate outcome. The error a writer finally
    sees does not say so (the machine retries an Indeterminate and may then
    time out on a StoreUnavailable), so the checker asks the store.
    """

    def __init__(self, inner: Consensus, faults: Faults, *, enabled: bool = True) -> None:
        super().__init__(inner, faults, enabled=enabled)
        self._local = threading.local()
        self.on_lost_reply: Callable[[], None] | None = None
        """Run after a compare-and-set whose reply is lost, before the caller hears of it:
        the maintenance client races another compaction into exactly that window."""

    def indeterminate_cas(self) -> int:
        """Compare-and-sets of the calling thread that raised Indeterminate so far."""
        return int(getattr(self._local, "n", 0))

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """The unreliable compare_and_set, counting Indeterminate outcomes of this thread."""
        try:
            return super().compare_and_set(key, expected, new)
        except Indeterminate:
            self._local.n = self.indeterminate_cas() + 1
            hook = self.on_lost_reply
            if hook is not None:
                hook()
            raise


class LossyBlob(UnreliableBlob):
    """Sabotage: a Blob that *claims* to store every third part but drops it (a lying store).

    Only used to prove the checker catches lost data; never a model of a real store.
    """

    def __init__(self, inner: Blob, faults: Faults, *, enabled: bool = True) -> None:
        super().__init__(inner, faults, enabled=enabled)
        self._n = 0
        self._lock = threading.Lock()
        self._dropped: dict[str, int] = {}

    def set(self, key: str, value: BlobValue) -> None:
        """Drop every third part write (silently), pass everything else on."""
        if "/part/" in key:
            with self._lock:
                self._n += 1
                drop = self._n % 3 == 0
                if drop:
                    self._dropped[key] = len(value)
            if drop:
                return
        super().set(key, value)

    def stat_many(self, keys: Iterable[str]) -> dict[str, BlobMeta]:
        """Lie consistently: a dropped part is reported stored (so commits check out)."""
        checked = list(keys)
        out = super().stat_many(checked)
        with self._lock:
            out.update({k: BlobMeta(k, self._dropped[k]) for k in checked if k in self._dropped})
        return out


SABOTAGE = ("fresh_tokens", "lossy_blob", "delete_after_unknown")
"""Deliberate bugs the checker must detect: a writer that takes a new token per retry
(duplicates after a lost reply), a Blob that loses acknowledged parts, and compaction's
cleanup as it once was (a refused merge deletes its parts even after a lost reply, when the
merge may have landed and been merged again)."""


@contextlib.contextmanager
def sabotaged(sabotage: str | None) -> Iterator[None]:
    """Patch in the ``delete_after_unknown`` bug for the run's threads, and undo it after."""
    if sabotage != "delete_after_unknown":
        yield
        return
    from unittest import mock

    from pyspark_persist.state import maintenance

    def old_rule(machine: Any, parts: Sequence[Any], info: Any) -> list[Any]:
        return [p for p in parts if p.key is not None]

    # Compaction's lookup of the rule (a writer's own cleanup keeps the real one).
    with mock.patch.object(maintenance, "never_committed", old_rule):
        yield


@dataclass(frozen=True)
class Location:
    """Where the shard lives: URIs, plus a directory to remove afterwards."""

    blob_uri: str
    consensus_uri: str
    cleanup: str | None = None


def make_location(backend: str, root: str | None = None) -> Location:
    """A fresh location of ``backend`` (``mem``, ``file-sqlite``, ``file-postgres``)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    tag = uuid.uuid4().hex
    if backend == "mem":
        return Location(f"mem://check-{tag}", f"mem://check-{tag}")
    directory = tempfile.mkdtemp(prefix="persist-check-", dir=root)
    blob = f"file://{directory}/blob"
    if backend == "file-sqlite":
        return Location(blob, f"sqlite:///{directory}/consensus.db", directory)
    return Location(blob, os.environ.get("PERSIST_CHECK_POSTGRES", POSTGRES_URL), directory)


def default_faults(seed: int, *, reader: bool = False) -> tuple[Faults, Faults]:
    """(blob, consensus) faults of one client: frequent enough to hit every retry path.

    A reader's snapshot fetches every part, so its Blob faults are rarer: at the writers'
    rate a snapshot of 30 parts would almost never succeed and little would be checked.
    """
    b = 0.004 if reader else 0.03
    return (
        Faults(seed=seed, fail_before=b, fail_after=b, timeout=b / 3, slow=0.02, slow_s=0.002),
        Faults(
            seed=seed + 1, fail_before=0.05, fail_after=0.05, timeout=0.02, slow=0.05, slow_s=0.002
        ),
    )


GRACE_S = 4.0
"""The orphan sweep's grace: short, so the sweep really races slow writers and compactions
(commits refuse parts past half of it: StagedPartsExpired, then the writer stages again)."""


def worker_config(rng: random.Random) -> PersistConfig:
    """Knobs that make compaction, GC, rollups, sweeps and retries happen constantly."""
    return PersistConfig(
        part_target_bytes=16 * 1024,
        compaction_fan_in=rng.randint(2, 4),
        gc_interval=2,
        rollup_interval=8,
        # Half the clients hand every store error straight to the caller, so caller-level
        # retries with the same token are exercised, not only the machine's own.
        retry_timeout_s=rng.choice((1e-9, 0.3)),
        heartbeat_interval_s=0.2,
        reader_lease_s=120.0,
        staged_part_grace_s=GRACE_S,
        listen_poll_max_s=0.02,
    )


class FaultyClient:
    """A client on its own cache over fault-injecting wrappers of a location's stores."""

    def __init__(
        self,
        loc: Location,
        seed: int,
        config: PersistConfig,
        sabotage: str | None = None,
        *,
        reader: bool = False,
    ) -> None:
        blob_faults, cons_faults = default_faults(seed, reader=reader)
        blob_cls = LossyBlob if sabotage == "lossy_blob" else UnreliableBlob
        if sabotage == "fresh_tokens":  # make sure lost replies reach the (buggy) caller
            config = dataclasses.replace(config, retry_timeout_s=1e-9)
        self.blob = blob_cls(open_blob(loc.blob_uri), blob_faults, enabled=False)
        self.consensus = TrackingConsensus(
            open_consensus(loc.consensus_uri), cons_faults, enabled=False
        )
        self.client = PersistClient(self.blob, self.consensus, config=config, cache=StateCache())

    def enable(self, on: bool = True) -> None:
        """Switch faults on or off (off for setup and the final verification)."""
        self.blob.enabled = on
        self.consensus.enabled = on

    def faults(self) -> collections.Counter[str]:
        """Faults injected so far, by kind."""
        out: collections.Counter[str] = collections.Counter()
        for kind in FAULT_KINDS:
            out[kind] += self.blob.injected[kind] + self.consensus.injected[kind]
        return out

    def close(self) -> None:
        """Close the client (and with it the stores)."""
        with contextlib.suppress(Exception):
            self.client.close()


# --- what the workers record ------------------------------------------------------------------


@dataclass
class WriteRecord:
    """What one writer learned about one write (JSON-able, to cross a process Queue)."""

    key: int
    acked: bool = False
    landed_at: int | None = None
    """The time it landed at when a Committed said so (None: acked by AlreadyCommitted)."""
    candidates: list[int] = field(default_factory=list)
    """Every expected upper it was attempted at: the only times it may have landed at."""
    errors: int = 0
    indeterminate: bool = False
    """Some compare-and-set of it had an unknown outcome: it may have landed unacknowledged."""


@dataclass
class Report:
    """The outcome of one checker run; see :meth:`render`."""

    seed: int
    backend: str
    duration_s: float = 0.0
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0
    final_upper: int = 0
    sabotage: str | None = None

    @property
    def ok(self) -> bool:
        """No violation found."""
        return self.violation_count == 0

    @property
    def operations_checked(self) -> int:
        """Writes verified plus snapshots compared plus listen events checked."""
        return (
            self.ops["writes_checked"]
            + self.ops["snapshots_checked"]
            + self.ops["listen_events"]
            + self.ops["replace_writes_checked"]
            + self.ops["replace_snapshots_checked"]
        )

    def render(self) -> str:
        """The human-readable report: seed, ops by kind, faults by kind, violations."""
        lines = [
            f"persist checker: seed={self.seed} backend={self.backend} "
            f"duration={self.duration_s:.1f}s final_upper={self.final_upper}"
            + (f" sabotage={self.sabotage}" if self.sabotage else ""),
            f"operations checked: {self.operations_checked}",
            "operations:",
            *(f"  {k:<28} {v}" for k, v in sorted(self.ops.items())),
            f"faults injected: {sum(self.faults.values())}",
            *(f"  {k:<28} {v}" for k, v in sorted(self.faults.items())),
            f"violations: {self.violation_count}",
            *(f"  - {v}" for v in self.violations),
        ]
        if self.violation_count > len(self.violations):
            lines.append(f"  ... and {self.violation_count - len(self.violations)} more")
        lines.append(
            f"replay with: python -m pyspark_persist.tools.checker --seed {self.seed} "
            f"--backend {self.backend}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able values."""
        return {
            "seed": self.seed,
            "backend": self.backend,
            "duration_s": round(self.duration_s, 3),
            "operations_checked": self.operations_checked,
            "ops": dict(self.ops),
            "faults": dict(self.faults),
            "faults_injected": sum(self.faults.values()),
            "violation_count": self.violation_count,
            "violations": self.violations,
            "final_upper": self.final_upper,
        }


class Recorder:
    """Thread-safe collection of ops, faults and violations during a run."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self._lock = threading.Lock()

    def op(self, kind: str, n: int = 1) -> None:
        """Count ``n`` operations of ``kind``."""
        with self._lock:
            self.report.ops[kind] += n

    def violation(self, text: str) -> None:
        """Record a violation (the first MAX_DETAILS in full)."""
        with self._lock:
            self.report.violation_count += 1
            if len(self.report.violations) < MAX_DETAILS:
                self.report.violations.append(text)


# --- the writer loop, shared by threads and processes -----------------------------------------


def write_loop(
    fc: FaultyClient,
    shard_name: str,
    index: int,
    seed: int,
    stop: threading.Event | Callable[[], bool],
    op: Callable[[str], None],
    violation: Callable[[str], None],
    *,
    sabotage: str | None = None,
    abandon_p: float = 0.15,
    slow_stage_s: float = 0.0,
) -> list[WriteRecord]:
    """Append numbered writes until ``stop``; return what was learned about each.

    Retries with the same token (the token is the write number) until the
    write is acknowledged, except that after an error it is abandoned with
    probability ``abandon_p``. With sabotage ``fresh_tokens`` every retry
    takes a new token, the bug idempotency tokens exist to prevent. With
    ``slow_stage_s`` each attempt stages its parts first and commits them up
    to that many seconds later: a slow writer the orphan sweep races.
    """
    stopped = stop.is_set if isinstance(stop, threading.Event) else stop
    rng = random.Random(seed)
    shard = fc.client.open_shard(shard_name)
    writer = shard.writer(f"writer-{index}")
    fc.enable()
    records: list[WriteRecord] = []
    upper = _retry(writer.fetch_upper, stopped, hard_s=FINISH_TIMEOUT_S)
    last_committed = -1
    last_seen = upper
    number = 0
    token = 0
    while not stopped():
        number += 1
        token += 1
        key = index * KEY_PER_WRITER + number
        rec = WriteRecord(key)
        records.append(rec)
        data = pa.table({"v": write_values(key)}, schema=SCHEMA)
        before = fc.consensus.indeterminate_cas()
        finish_by: float | None = None
        while True:
            if stopped():
                finish_by = finish_by or time.monotonic() + FINISH_TIMEOUT_S / 2
                if time.monotonic() > finish_by:
                    op("writes_unfinished_at_stop")
                    break
            new_upper = upper + rng.randint(1, 3)
            rec.candidates.append(upper)
            op("write_attempts")
            try:
                if slow_stage_s:
                    builder = writer.builder()
                    builder.add(data)
                    staged = builder.finish()
                    time.sleep(rng.uniform(0, slow_stage_s))
                    res = writer.compare_and_append_batches(
                        [staged], upper, new_upper, token=token, ts_rewrite=upper
                    )
                else:
                    res = writer.compare_and_append(data, upper, new_upper, token=token)
            except (Determinate, Indeterminate) as e:
                rec.errors += 1
                op("write_errors_" + type(e).__name__)
                with contextlib.suppress(PersistError):
                    upper = writer.fetch_upper()
                if sabotage == "fresh_tokens":
                    token += 1
                if rng.random() < abandon_p:
                    op("writes_abandoned")
                    break
                continue
            seen = res.current if isinstance(res, UpperMismatch) else res.upper
            if seen < last_seen:
                violation(f"writer-{index}: upper went back from {last_seen} to {seen} ({res})")
            last_seen = max(last_seen, seen)
            if isinstance(res, UpperMismatch):
                op("upper_mismatches")
                if res.current == upper:
                    violation(f"writer-{index}: UpperMismatch reports the expected upper {upper}")
                upper = res.current
                continue
            if isinstance(res, Committed):
                op("commits")
                if res.upper != new_upper:
                    violation(f"writer-{index}: Committed upper {res.upper}, asked {new_upper}")
                if res.upper <= last_committed:
                    violation(
                        f"writer-{index}: commit upper {res.upper} did not advance past "
                        f"{last_committed}"
                    )
                last_committed = res.upper
                rec.landed_at = upper
            else:
                assert isinstance(res, AlreadyCommitted)
                op("already_committed")
                if res.token < token:
                    violation(f"writer-{index}: AlreadyCommitted token {res.token} < asked {token}")
            rec.acked = True
            upper = res.upper
            break
        rec.indeterminate = fc.consensus.indeterminate_cas() > before
        if rec.acked:
            op("writes_acked")
        if rng.random() < 0.1:
            time.sleep(rng.uniform(0, 0.01))
    return records


def _retry(fn: Callable[[], Any], stopped: Callable[[], bool], hard_s: float) -> Any:
    """Call ``fn`` until it does not raise a store error (setup under faults)."""
    deadline = time.monotonic() + hard_s
    while True:
        try:
            return fn()
        except (Determinate, Indeterminate):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _process_writer(
    loc: Location,
    shard_name: str,
    index: int,
    seed: int,
    duration_s: float,
    sabotage: str | None,
    out: Any,
) -> None:
    """A spawned writer process: write for ``duration_s``, then report records and faults."""
    fc = FaultyClient(loc, seed, worker_config(random.Random(seed)), sabotage)
    ops: collections.Counter[str] = collections.Counter()
    violations: list[str] = []
    deadline = time.monotonic() + duration_s
    try:
        records = write_loop(
            fc,
            shard_name,
            index,
            seed,
            lambda: time.monotonic() > deadline,
            lambda k: ops.update([k]),
            violations.append,
            sabotage=sabotage,
        )
        fc.enable(False)
        out.put(
            {
                "index": index,
                "records": [vars(r) for r in records],
                "ops": dict(ops),
                "faults": dict(fc.faults()),
                "violations": violations,
            }
        )
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        out.put({"index": index, "error": f"{type(e).__name__}: {e}"})
    finally:
        fc.close()


# --- the reference history: one listen --------------------------------------------------------


class History:
    """The listen's view: each write's time, in time order, plus pending snapshot checks."""

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec
        self._lock = threading.Lock()
        self.time_of: dict[int, int] = {}
        self._times: list[int] = []  # sorted
        self._keys: list[int] = []  # parallel to _times
        self.frontier = 1
        self._pending: list[tuple[int, frozenset[int], str]] = []

    def add_event(self, lower: int, upper: int, table: pa.Table) -> None:
        """Check one listen event's updates and add them to the history."""
        rec = self._rec
        if lower != self.frontier or upper <= lower:
            rec.violation(
                f"listen: event [{lower}, {upper}) does not follow frontier {self.frontier}"
            )
        sums: collections.Counter[int] = collections.Counter()
        times: dict[int, set[int]] = collections.defaultdict(set)
        for v, t, d in zip(
            table.column("v").to_pylist(),
            table.column(TIME).to_pylist(),
            table.column("_diff").to_pylist(),
            strict=True,
        ):
            sums[v] += d
            times[key_of(v)].add(t)
        per_key: collections.Counter[int] = collections.Counter()
        for v, d in sums.items():
            if d != 1:
                rec.violation(
                    f"listen: row {v} (write {key_of(v)}) has diff {d} in event [{lower}, {upper})"
                )
            if d != 0:
                per_key[key_of(v)] += 1
        new: list[tuple[int, int]] = []
        for key, n in per_key.items():
            if n != write_size(key):
                rec.violation(
                    f"listen: write {key} appears partially ({n} of {write_size(key)} rows)"
                )
            ts = times[key]
            if len(ts) != 1:
                rec.violation(f"listen: write {key} appears at several times {sorted(ts)}")
            t = min(ts)
            if not lower <= t < upper:
                rec.violation(f"listen: write {key} at time {t} outside event [{lower}, {upper})")
            if key in self.time_of:
                rec.violation(
                    f"listen: write {key} emitted twice (times {self.time_of[key]} and {t})"
                )
                continue
            new.append((t, key))
        with self._lock:
            for t, key in sorted(new):
                self.time_of[key] = t
                i = bisect.bisect_right(self._times, t)
                self._times.insert(i, t)
                self._keys.insert(i, key)
            self.frontier = max(self.frontier, upper)
            due = [p for p in self._pending if p[0] < self.frontier]
            self._pending = [p for p in self._pending if p[0] >= self.frontier]
        for as_of, keys, who in due:
            self._compare(as_of, keys, who)

    def expected_at(self, as_of: int) -> frozenset[int]:
        """The writes the collection holds at ``as_of`` (as_of must be below the frontier)."""
        with self._lock:
            return frozenset(self._keys[: bisect.bisect_right(self._times, as_of)])

    def add_snapshot(self, as_of: int, keys: frozenset[int], who: str) -> None:
        """Compare a snapshot now if the history covers ``as_of``, else when it does."""
        with self._lock:
            if as_of >= self.frontier:
                self._pending.append((as_of, keys, who))
                return
        self._compare(as_of, keys, who)

    def flush(self) -> int:
        """Compare pending snapshots the history now covers; return how many stay unchecked."""
        with self._lock:
            due = [p for p in self._pending if p[0] < self.frontier]
            self._pending = [p for p in self._pending if p[0] >= self.frontier]
            left = len(self._pending)
        for as_of, keys, who in due:
            self._compare(as_of, keys, who)
        return left

    def _compare(self, as_of: int, keys: frozenset[int], who: str) -> None:
        expected = self.expected_at(as_of)
        self._rec.op("snapshots_checked")
        if keys != expected:
            missing = sorted(expected - keys)
            extra = sorted(keys - expected)
            self._rec.violation(
                f"{who}: snapshot as_of {as_of} differs from the reference: missing writes "
                f"{missing[:10]}{'...' if len(missing) > 10 else ''} ({len(missing)}), extra "
                f"{extra[:10]}{'...' if len(extra) > 10 else ''} ({len(extra)})"
            )


def snapshot_keys(table: pa.Table, who: str, as_of: int, rec: Recorder) -> frozenset[int]:
    """The writes a consolidated snapshot holds; each row must be there once, whole."""
    per_key: collections.Counter[int] = collections.Counter()
    for v, d in zip(table.column("v").to_pylist(), table.column("_diff").to_pylist(), strict=True):
        if d != 1:
            rec.violation(
                f"{who}: snapshot as_of {as_of} holds row {v} (write {key_of(v)}) with diff {d}"
            )
        per_key[key_of(v)] += 1
    for key, n in per_key.items():
        if n != write_size(key):
            rec.violation(
                f"{who}: snapshot as_of {as_of} holds write {key} partially "
                f"({n} of {write_size(key)} rows)"
            )
    return frozenset(per_key)


def _check_replaces(
    loc: Location,
    shard_name: str,
    acks: list[tuple[int, int | None, bool, bool]],
    seen: list[tuple[int, int | None]],
    rec: Recorder,
) -> None:
    """Verify the replaced shard: each snapshot shows exactly the newest replace at its time.

    A snapshot may show a write that was not acknowledged only if its outcome
    was unknown; never a mix, never an older write than one acknowledged at
    or before its time. The final state holds a few references per replace
    (it once doubled them with each).
    """
    rec.op("replace_writes_checked", len(acks))
    rec.op("replace_snapshots_checked", len(seen))
    landed = sorted((t, key) for key, t, acked, _ in acks if acked and t is not None)
    times = [t for t, _ in landed]
    for as_of, key in seen:
        i = bisect.bisect_right(times, as_of)
        if i and (key is None or key < landed[i - 1][1]):
            rec.violation(
                f"replace-reader: snapshot as_of {as_of} shows write {key}, older than write "
                f"{landed[i - 1][1]} acknowledged at time {landed[i - 1][0]}"
            )
    shown = [key for _, key in sorted(seen) if key is not None]
    if any(b < a for a, b in zip(shown, shown[1:], strict=False)):
        rec.violation("replace-reader: a later as_of showed an older replaced write")
    with PersistClient(
        open_blob(loc.blob_uri), open_consensus(loc.consensus_uri), cache=StateCache()
    ) as check:
        shard = check.open_shard(shard_name)
        with shard.reader("final-replace-check") as reader:
            state = shard.state()
            final = snapshot_keys(reader.snapshot_table(state.upper - 1), "final", 0, rec)
    acked = [key for key, _, ok, _ in acks if ok]
    maybe = {key for key, _, ok, unknown in acks if not ok and unknown}
    if acked and (len(final) != 1 or (max(final) != max(acked) and max(final) not in maybe)):
        rec.violation(f"replaced shard ends with writes {sorted(final)}, last acked {max(acked)}")
    refs = sum(len(b.parts) for b in state.batches.values())
    if refs > 3 * len(acks) + 16:
        rec.violation(f"replaced shard holds {refs} part references after {len(acks)} replaces")


# --- the run ------------------------------------------------------------------------------------


def run(
    seed: int | None = None,
    duration_s: float = 10.0,
    writers: int = 4,
    processes: int = 0,
    backend: str = "mem",
    *,
    readers: int = 2,
    sabotage: str | None = None,
    root: str | None = None,
    location: Location | None = None,
    target_ops: int | None = None,
) -> Report:
    """Run the workload for ``duration_s`` and verify its history; see the module doc.

    ``location`` runs it there instead of a fresh ``backend`` location.
    ``target_ops`` ends the workload early once about that many operations
    (acknowledged or abandoned writes, snapshots, listen events, replaces)
    are done; ``duration_s`` stays the cap.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 31)
    if sabotage is not None and sabotage not in SABOTAGE:
        raise ValueError(f"unknown sabotage {sabotage!r}: use one of {', '.join(SABOTAGE)}")
    if processes and backend == "mem" and location is None:
        raise ValueError(
            "writer processes need a shared location: use file-sqlite or file-postgres, not mem"
        )
    rng = random.Random(seed)
    where = backend if location is None else f"{location.blob_uri} + {location.consensus_uri}"
    report = Report(seed=seed, backend=where, sabotage=sabotage)
    rec = Recorder(report)
    loc = location or make_location(backend, root)
    shard_name = f"check-{seed}-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    clients: list[FaultyClient] = []
    try:
        with sabotaged(sabotage):
            _run(
                loc,
                shard_name,
                seed,
                rng,
                duration_s,
                writers,
                processes,
                readers,
                sabotage,
                rec,
                clients,
                target_ops,
            )
    finally:
        for fc in clients:
            report.faults.update(fc.faults())
            fc.close()
        if loc.cleanup:
            shutil.rmtree(loc.cleanup, ignore_errors=True)
    report.duration_s = time.monotonic() - started
    return report


def _run(
    loc: Location,
    shard_name: str,
    seed: int,
    rng: random.Random,
    duration_s: float,
    n_writers: int,
    n_processes: int,
    n_readers: int,
    sabotage: str | None,
    rec: Recorder,
    clients: list[FaultyClient],
    target_ops: int | None = None,
) -> None:
    report = rec.report

    def faulty(sub_seed: int, sab: str | None = None, reader: bool = False) -> FaultyClient:
        fc = FaultyClient(loc, sub_seed, worker_config(random.Random(sub_seed)), sab, reader=reader)
        clients.append(fc)
        return fc

    # Setup, reliable: the shard, and an empty batch [0, 1) so a listen from 0 sees every write.
    with PersistClient(
        open_blob(loc.blob_uri), open_consensus(loc.consensus_uri), cache=StateCache()
    ) as setup:
        shard = setup.open_shard(shard_name, SCHEMA)
        shard.writer("setup").compare_and_append(SCHEMA.empty_table(), 0, 1, token=1)
        replaced = setup.open_shard(shard_name + "-replaced", SCHEMA)
        replaced.writer("setup").compare_and_append(SCHEMA.empty_table(), 0, 1, token=1)

    stop = threading.Event()
    history = History(rec)
    errors: list[str] = []
    records: list[WriteRecord] = []
    records_lock = threading.Lock()

    def guard(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - a crashed worker is a failed run
                errors.append(f"{name} crashed: {type(e).__name__}: {e}")
                rec.violation(f"{name} crashed: {type(e).__name__}: {e}")

        return body

    def writer_thread(i: int) -> None:
        fc = faulty(rng_seeds[f"w{i}"], sabotage)
        out = write_loop(
            fc, shard_name, i, rng_seeds[f"w{i}"], stop, rec.op, rec.violation, sabotage=sabotage
        )
        with records_lock:
            records.extend(out)

    def reader_thread(i: int) -> None:
        fc = faulty(rng_seeds[f"r{i}"], reader=True)
        r = random.Random(rng_seeds[f"r{i}"])
        shard = fc.client.open_shard(shard_name)
        reader = shard.reader(f"reader-{i}")
        fc.enable()
        who = f"reader-{i}"
        last_upper = 0
        while not stop.is_set():
            try:
                latest = reader.latest_as_of()
            except (Determinate, Indeterminate):
                rec.op("snapshot_errors")
                continue
            if latest + 1 < last_upper:
                rec.violation(f"{who}: upper went back from {last_upper} to {latest + 1}")
            last_upper = max(last_upper, latest + 1)
            lo = reader.since
            if lo > latest:
                time.sleep(0.005)
                continue
            as_of = r.randint(lo, latest)
            try:
                table = reader.snapshot_table(as_of)
            except PartNotFound as e:
                rec.violation(f"{who}: leased snapshot as_of {as_of} failed: {e}")
                continue
            except CorruptData as e:
                rec.violation(f"{who}: snapshot as_of {as_of} read corrupt data: {e}")
                continue
            except (Determinate, Indeterminate):
                rec.op("snapshot_errors")
                continue
            except InvalidFrontier:
                # A downgrade whose reply was lost landed: the hold in state is ahead of
                # reader.since, which only a returned downgrade moves. Not a data error.
                rec.op("snapshots_behind_a_landed_downgrade")
                continue
            rec.op("snapshots")
            history.add_snapshot(as_of, snapshot_keys(table, who, as_of, rec), who)
            if r.random() < 0.3:
                with contextlib.suppress(Determinate, Indeterminate):
                    reader.downgrade_since(r.randint(lo, as_of))
                    rec.op("since_downgrades")
            time.sleep(r.uniform(0, 0.02))
        with contextlib.suppress(PersistError):
            reader.close()

    listen_done = threading.Event()
    final_upper_box: list[int] = []

    listen_setup: list[Any] = []
    """(client, reader, listen): registered before any other reader starts (see below)."""

    def listen_thread() -> None:
        fc, reader, listen = listen_setup
        fc.enable()
        r = random.Random(rng_seeds["listen"])
        deadline: float | None = None
        while True:
            if final_upper_box:
                if history.frontier >= final_upper_box[0]:
                    break
                deadline = deadline or time.monotonic() + FINISH_TIMEOUT_S
                if time.monotonic() > deadline:
                    rec.violation(
                        f"listen: stuck at frontier {history.frontier}, final upper "
                        f"{final_upper_box[0]}"
                    )
                    break
            try:
                event = listen.next(timeout_s=0.1)
            except (Determinate, Indeterminate):
                rec.op("listen_errors")
                continue
            if event is None:
                continue
            while True:
                try:
                    table = reader.fetch(event.parts)
                    break
                except PartNotFound as e:
                    rec.violation(
                        f"listen: leased event [{event.lower}, {event.upper}) failed: {e}"
                    )
                    table = None
                    break
                except (Determinate, Indeterminate):
                    rec.op("listen_errors")
            if table is None:
                history.frontier = max(history.frontier, event.upper)
                continue
            rec.op("listen_events")
            history.add_event(event.lower, event.upper, table)
            if r.random() < 0.3 and history.frontier > 1:
                with contextlib.suppress(Determinate, Indeterminate):
                    reader.downgrade_since(history.frontier - 1)
        listen.close()
        listen_done.set()
        with contextlib.suppress(PersistError):
            reader.close()

    def maintenance_thread() -> None:
        # Retrying (not failing at once) after a lost reply is what reaches compaction's
        # cleanup after an unknown outcome.
        seed = rng_seeds["maint"]
        fc = FaultyClient(
            loc, seed, dataclasses.replace(worker_config(random.Random(seed)), retry_timeout_s=0.3)
        )
        clients.append(fc)
        r = random.Random(rng_seeds["maint"])
        shard = fc.client.open_shard(shard_name)
        # Another compactor, racing into the window of every lost reply: it merges the merge
        # that may just have landed (concatenating part lists, so state keeps its parts).
        seed = rng_seeds["maint"] + 1
        config = dataclasses.replace(
            worker_config(random.Random(seed)), compaction_memory_bytes=1, compaction_fan_in=2
        )
        racer = FaultyClient(loc, seed, config)  # its faults stay off
        clients.append(racer)
        racer_shard = racer.client.open_shard(shard_name)

        def race() -> None:
            if stop.is_set():
                return
            try:
                racer_shard.compact()
                rec.op("compactions_raced_into_lost_replies")
            except PersistError:
                rec.op("maintenance_errors")

        fc.consensus.on_lost_reply = race
        fc.enable()
        while not stop.is_set():
            try:
                if r.random() < 0.6:
                    rec.op("compactions", len(shard.compact()))
                else:
                    shard.gc()  # with the orphan sweep
                    rec.op("gcs")
            except PartNotFound as e:
                # A compaction that lost its race to GC says so (applied=False); a missing
                # part of batches still in state is lost data.
                rec.violation(f"maintenance: compaction found a committed part missing: {e}")
            except PersistError:
                rec.op("maintenance_errors")
            stop.wait(r.uniform(0.01, 0.1))
        fc.consensus.on_lost_reply = None

    replace_acks: list[tuple[int, int | None, bool, bool]] = []
    """Per replace write: (key, landed time if a Committed said, acked, indeterminate)."""
    replace_seen: list[tuple[int, int | None]] = []
    """Per replace snapshot: (as_of, the one write it shows, or None)."""

    def replacer_thread() -> None:
        fc = faulty(rng_seeds["replace"])
        r = random.Random(rng_seeds["replace"])
        writer = fc.client.open_shard(shard_name + "-replaced").writer("replacer")
        fc.enable()
        upper = _retry(writer.fetch_upper, stop.is_set, hard_s=FINISH_TIMEOUT_S)
        number = 0
        while not stop.is_set():
            number += 1
            key = REPLACE_INDEX * KEY_PER_WRITER + number
            data = pa.table({"v": write_values(key)}, schema=SCHEMA)
            before = fc.consensus.indeterminate_cas()
            landed: int | None = None
            acked = False
            while not stop.is_set():
                rec.op("replace_attempts")
                try:
                    builder = writer.builder()
                    builder.add(data)
                    staged = builder.finish()
                    res = writer.compare_and_append_batches(
                        [staged], upper, upper + 1, token=number, ts_rewrite=upper, replace=True
                    )
                except (Determinate, Indeterminate) as e:
                    rec.op("replace_errors_" + type(e).__name__)
                    with contextlib.suppress(PersistError):
                        upper = writer.fetch_upper()
                    if r.random() < 0.15:
                        break
                    continue
                if isinstance(res, UpperMismatch):
                    upper = res.current
                    continue
                if isinstance(res, Committed):
                    landed = upper
                acked = True
                upper = res.upper
                break
            replace_acks.append((key, landed, acked, fc.consensus.indeterminate_cas() > before))
            rec.op("replaces_acked" if acked else "replaces_abandoned")

    def replace_reader_thread() -> None:
        fc = faulty(rng_seeds["replace-reader"], reader=True)
        r = random.Random(rng_seeds["replace-reader"])
        reader = fc.client.open_shard(shard_name + "-replaced").reader("replace-reader")
        fc.enable()
        while not stop.is_set():
            try:
                latest = reader.latest_as_of()
                as_of = r.randint(min(reader.since, latest), latest)
                table = reader.snapshot_table(as_of)
            except PartNotFound as e:
                rec.violation(f"replace-reader: leased snapshot failed: {e}")
                continue
            except (Determinate, Indeterminate, InvalidFrontier):
                rec.op("replace_snapshot_errors")
                continue
            keys = snapshot_keys(table, "replace-reader", as_of, rec)
            if len(keys) > 1:
                rec.violation(
                    f"replace-reader: snapshot as_of {as_of} mixes replaced writes {sorted(keys)}"
                )
            replace_seen.append((as_of, max(keys) if keys else None))
            rec.op("replace_snapshots")
            if r.random() < 0.3:
                with contextlib.suppress(Determinate, Indeterminate):
                    reader.downgrade_since(r.randint(reader.since, as_of))
            time.sleep(r.uniform(0, 0.01))
        with contextlib.suppress(PersistError):
            reader.close()

    def slow_writer_thread() -> None:
        seed = rng_seeds["slow"]
        config = dataclasses.replace(worker_config(random.Random(seed)), inline_write_max_bytes=1)
        fc = FaultyClient(loc, seed, config, sabotage)  # every part in Blob, where sweeps reach
        clients.append(fc)
        out = write_loop(
            fc,
            shard_name,
            SLOW_INDEX,
            rng_seeds["slow"],
            stop,
            rec.op,
            rec.violation,
            sabotage=sabotage,
            slow_stage_s=GRACE_S * 0.75,
        )
        with records_lock:
            records.extend(out)

    rng_seeds = {
        name: rng.randrange(1 << 31)
        for name in [
            *(f"w{i}" for i in range(n_writers)),
            *(f"r{i}" for i in range(n_readers)),
            *(f"p{i}" for i in range(n_processes)),
            "listen",
            "maint",
            "replace",
            "replace-reader",
            "slow",
        ]
    }
    threads = [
        threading.Thread(
            target=guard(f"writer-{i}", functools.partial(writer_thread, i)),
            name=f"check-writer-{i}",
        )
        for i in range(n_writers)
    ]
    threads += [
        threading.Thread(
            target=guard(f"reader-{i}", functools.partial(reader_thread, i)),
            name=f"check-reader-{i}",
        )
        for i in range(n_readers)
    ]
    threads.append(threading.Thread(target=guard("maintenance", maintenance_thread)))
    threads += [
        threading.Thread(target=guard(name, fn), name=f"check-{name}")
        for name, fn in (
            ("replacer", replacer_thread),
            ("replace-reader", replace_reader_thread),
            ("slow-writer", slow_writer_thread),
        )
    ]
    listener = threading.Thread(target=guard("listen", listen_thread), name="check-listen")

    procs: list[multiprocessing.process.BaseProcess] = []
    out_q: Any = None
    if n_processes:
        ctx = multiprocessing.get_context("spawn")
        out_q = ctx.Queue()
        for i in range(n_processes):
            idx = n_writers + i
            procs.append(
                ctx.Process(
                    target=_process_writer,
                    args=(loc, shard_name, idx, rng_seeds[f"p{i}"], duration_s, sabotage, out_q),
                    name=f"check-process-{idx}",
                )
            )
    # The listener registers before any other reader starts, so its hold keeps since at 0
    # until it listens (a reader downgrading first could move since past 0).
    listen_fc = faulty(rng_seeds["listen"], reader=True)
    listen_reader = listen_fc.client.open_shard(shard_name).reader("listener")
    listen_setup.extend([listen_fc, listen_reader, listen_reader.listen(0)])
    listener.start()
    for p in procs:
        p.start()
    for t in threads:
        t.start()
    ends = time.monotonic() + duration_s
    live = ("writes_acked", "writes_abandoned", "snapshots", "listen_events", "replace_snapshots")
    while not stop.wait(max(0.0, min(1.0, ends - time.monotonic()))):
        done = sum(report.ops[k] for k in live) + report.ops["replaces_acked"]
        if time.monotonic() >= ends or (target_ops is not None and done >= target_ops):
            break
    stop.set()
    proc_results: list[dict[str, Any]] = []
    for _ in procs:
        try:
            proc_results.append(out_q.get(timeout=FINISH_TIMEOUT_S + duration_s + 30))
        except queue.Empty:
            rec.violation("a writer process reported nothing (crashed or hung)")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    for t in threads:
        t.join(timeout=FINISH_TIMEOUT_S)
        if t.is_alive():
            rec.violation(f"{t.name} did not finish")
    for res in proc_results:
        if "error" in res:
            rec.violation(f"writer process {res['index']} failed: {res['error']}")
            continue
        records.extend(WriteRecord(**r) for r in res["records"])
        report.ops.update(res["ops"])
        report.faults.update(res["faults"])
        for v in res["violations"]:
            rec.violation(f"process {res['index']}: {v}")
    rec.op("writer_processes", len(proc_results))

    # Verification, faults off: the final state and snapshot through a reliable client. The
    # clients' background maintenance keeps compacting and collecting, so the final state is
    # read under a lease (a reader registered first), like any other read.
    for fc in clients:
        fc.enable(False)
    for fc in clients:
        fc.client.maintenance.wait_idle(10)
    with PersistClient(
        open_blob(loc.blob_uri), open_consensus(loc.consensus_uri), cache=StateCache()
    ) as check:
        shard = check.open_shard(shard_name)
        final_reader = shard.reader("final-check")
        state = shard.state()
        report.final_upper = state.upper
        final_upper_box.append(state.upper)
        listener.join(timeout=FINISH_TIMEOUT_S + 10)
        try:
            state.check_invariants()
        except CorruptData as e:
            rec.violation(f"final state breaks an invariant: {e}")
        for b in state.batches.values():
            for part in b.parts:
                if part.key is not None and check.blob.get(part.key) is None:
                    rec.violation(f"final state references part {part.key}, missing from Blob")
        try:
            final = final_reader.snapshot_table(state.upper - 1)
            final_keys = snapshot_keys(final, "final", state.upper - 1, rec)
        except PersistError as e:
            rec.violation(f"final snapshot failed: {type(e).__name__}: {e}")
            final_keys = frozenset()
        final_reader.close()
    left = history.flush()
    if left:
        rec.op("snapshots_unchecked", left)
    listened = frozenset(history.time_of)
    if listen_done.is_set() and listened != final_keys:
        rec.violation(
            f"listen output differs from the final snapshot: only listened "
            f"{sorted(listened - final_keys)[:10]}, only in snapshot "
            f"{sorted(final_keys - listened)[:10]}"
        )
    times = dict(history.time_of) if listen_done.is_set() else {}
    seen_keys: set[int] = set()
    for w in records:
        rec.op("writes_checked")
        seen_keys.add(w.key)
        present = w.key in final_keys
        if w.acked and not present:
            rec.violation(f"acknowledged write {w.key} is lost ({w})")
        elif not w.acked and present and not w.indeterminate:
            rec.violation(f"write {w.key} failed determinately yet appears ({w})")
        elif not w.acked and present:
            rec.op("unacked_writes_that_landed")
        landed = times.get(w.key)
        if landed is not None:
            if landed not in w.candidates:
                rec.violation(f"write {w.key} landed at time {landed}, never attempted there ({w})")
            elif w.landed_at is not None and landed != w.landed_at:
                rec.violation(f"write {w.key} committed at {w.landed_at} but is at time {landed}")
    for key in sorted(final_keys - seen_keys)[:MAX_DETAILS]:
        rec.violation(f"write {key} appears but no writer attempted it")
    _check_replaces(loc, shard_name + "-replaced", replace_acks, replace_seen, rec)
    if errors:
        rec.op("worker_crashes", len(errors))


DESCRIPTION = (
    "Check that persist never loses or duplicates a committed update: for --seconds, writers "
    "(threads, and --processes), snapshot readers, a listener, compaction and GC run at once "
    "against Blob and Consensus wrappers that inject faults (lost replies, refused calls, "
    "timeouts, slowness); then every acknowledged write must appear exactly once, every "
    "snapshot must equal the reference history at its time, uppers must only advance and no "
    "leased read may hit a deleted part. The location is a fresh --backend one, or the one "
    "--blob and --consensus name (the check's shard, check-SEED-..., is left there). Exit "
    "status 1 on any violation; --seed replays a run."
)
BACKEND_NAMES = {"mem-mem": "mem", **{b: b for b in BACKENDS}}
"""What ``--backend`` accepts: every backend, and ``mem-mem`` (Blob-Consensus, as the
benchmarks name locations) for ``mem``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``persist check`` to ``parser``."""
    parser.description = DESCRIPTION
    parser.add_argument("--seed", type=int, default=None, help="replay this seed")
    parser.add_argument("--seconds", type=float, default=30.0, help="workload duration")
    parser.add_argument(
        "--ops",
        type=int,
        default=None,
        help="end the workload once about this many operations are done (--seconds stays the cap)",
    )
    parser.add_argument("--writers", type=int, default=4, help="writer threads")
    parser.add_argument("--processes", type=int, default=0, help="writer processes (spawned)")
    parser.add_argument("--readers", type=int, default=2, help="snapshot reader threads")
    parser.add_argument(
        "--backend",
        choices=sorted(BACKEND_NAMES),
        default=None,
        help="a fresh location of this kind (default mem; mem-mem is the same)",
    )
    parser.add_argument("--blob", metavar="URI", default=None, help="run on this Blob instead")
    parser.add_argument(
        "--consensus", metavar="URI", default=None, help="run on this Consensus instead"
    )
    parser.add_argument(
        "--sabotage",
        choices=SABOTAGE,
        default=None,
        help="inject a deliberate bug (to see the checker catch it)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--log-level",
        default="ERROR",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="persist's own logging, as key=value lines on stderr (it logs every retried "
        "fault at INFO)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the checker, print the report, exit 1 on any violation."""
    parser = argparse.ArgumentParser(prog="python -m pyspark_persist.tools.checker")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def given_location(ns: argparse.Namespace) -> Location | None:
    """The location ``--blob`` and ``--consensus`` name (both or neither), checked by the
    registry every entry point uses; None for a fresh ``--backend`` location."""
    if ns.blob is None and ns.consensus is None:
        return None
    if ns.blob is None or ns.consensus is None or ns.backend is not None:
        raise InvalidUsage(
            "persist check: give --blob and --consensus together (a location of yours), or "
            "--backend alone (a fresh one)"
        )
    if ns.processes and "mem" in (blob_kind(ns.blob), consensus_kind(ns.consensus)):
        raise InvalidUsage(
            "writer processes need a shared location: --blob and --consensus must not be mem://"
        )
    return Location(ns.blob, ns.consensus)


def run_from_args(ns: argparse.Namespace) -> int:
    """Run the checker with parsed flags; exit status 1 on any violation."""
    location = given_location(ns)
    configure_logs(ns.log_level)  # persist's records only, as key=value lines (state/logs.py)
    report = run(
        ns.seed,
        ns.seconds,
        ns.writers,
        ns.processes,
        BACKEND_NAMES[ns.backend or "mem"],
        readers=ns.readers,
        sabotage=ns.sabotage,
        location=location,
        target_ops=ns.ops,
    )
    if ns.json:
        import json

        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
