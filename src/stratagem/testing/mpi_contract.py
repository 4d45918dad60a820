"""The transport contract suite for transports whose endpoints are ranks of an MPI job.

The contract tests (:mod:`stratagem.testing.contract`) build worlds of endpoints in one process. An
MPI transport cannot: each endpoint is a rank of an ``mpiexec`` job. So the same test bodies run
inside one:

* ``python -m stratagem.testing.mpi_contract --transport mpi --report PATH [TEST ...]`` runs under
  ``mpiexec -n 4``. Rank 0, the *driver*, runs each contract test unchanged. In it,
  ``self.world(n)`` starts one endpoint on each of the ranks ``0..n-1`` (a fresh communicator per
  world) and returns the driver's own endpoint and *proxies* for the others: calling ``send``,
  ``recv``, ``close``, ``abort`` or ``lost_peers`` on a proxy runs that call on its rank, from a
  thread of its own, and returns the result or raises the error there. The calls travel over a
  private MPI communicator as ``core/wire`` frames (nothing is pickled). Results go to PATH (JSON)
  after every test, so a job that dies still reports what it finished.
* :class:`MpiTransportContract` is the pytest side: one test per contract test, each answered by an
  ``mpiexec`` job of its own. ``stratagem.testing.run_contract(name)`` returns it for a transport class that
  declares ``launcher = "mpiexec"``, so ``tests/test_transport_contract.py`` covers such a transport
  with no change. Such a transport must accept a ``comm`` option: the mpi4py communicator of its
  world (one per test).

Some contract tests cannot take this form and are skipped with the reason: a peer *process* killed
with SIGKILL (an MPI job's ranks are not spawned by the test; the transport's own tests kill a rank),
the native collectives (every rank must call them at once; the transport's own tests do, inside
``mpiexec``) and, for a transport that authenticates nobody (``authenticates_peers = False``), the
secret mismatch.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import itertools
import json
import os
import sys
import tempfile
import threading
import time
import traceback

import pytest

from stratagem.core import errors as stratagem_errors
from stratagem.core import wire
from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.transport import COMPLETED, Message
from stratagem.core.wire import Kind
from stratagem.testing.contract import CALL_TIMEOUT, PEER_TIMEOUT, TransportContract

#: The MPI tag of requests (driver -> rank); a response comes back under ``_RESPONSE + call id``.
_REQUEST = 1
_RESPONSE = 1000
#: Slack added to a call's own timeout before the driver gives up on the rank running it.
_RPC_SLACK = 60.0
#: Ranks of the job: the largest world a contract test builds.
DEFAULT_RANKS = 4


# -- calls between ranks ---------------------------------------------------------------------------

def _encode_error(exc: BaseException) -> dict:
    error = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, stratagem_errors.PeerLostError):
        error["task"] = str(exc.task)
    return error


def _decode_error(error: dict) -> BaseException:
    """The exception a remote call raised, rebuilt from its class name (errors and builtins only)."""
    cls = getattr(stratagem_errors, error["type"], None) or getattr(builtins, error["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return RuntimeError(f"{error['type']}: {error['message']}")
    exc = cls.__new__(cls)
    exc.args = (error["message"],)
    if "task" in error:
        exc.task = TaskId.parse(error["task"])
    return exc


class _Channel:
    """Frames between ranks over one MPI communicator, polled (no blocking MPI call, no pickle)."""

    def __init__(self, comm, MPI):
        self.comm, self.MPI = comm, MPI

    def send(self, dest: int, tag: int, op: str, meta: dict, buffers=()) -> None:
        frame = wire.encode_bytes(Kind.DATA, op, meta, list(buffers))
        request = self.comm.Isend([frame, self.MPI.BYTE], dest, tag)
        while not request.Test():
            time.sleep(0.0005)

    def receive(self, source: int, tag: int, timeout: float | None):
        """``(op, meta, buffers, source)`` of the next frame, or None after ``timeout`` seconds."""
        MPI = self.MPI
        status = MPI.Status()
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0001
        while True:
            message = self.comm.Improbe(source, tag, status)
            if message is not None:
                data = bytearray(status.Get_count(MPI.BYTE))
                message.Recv([data, MPI.BYTE])
                frame = wire.decode(data)
                return frame.tag, frame.meta, frame.buffers, status.Get_source()
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.002)


class _Driver:
    """Rank 0's side: numbered calls to the other ranks, from any thread."""

    def __init__(self, channel: _Channel):
        self.channel = channel
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def call(self, rank: int, op: str, meta: dict | None = None, buffers=(), timeout: float | None = None):
        with self._lock:
            call_id = next(self._ids)
        self.channel.send(rank, _REQUEST, op, {"id": call_id, **(meta or {})}, buffers)
        limit = (CALL_TIMEOUT if timeout is None else timeout) + _RPC_SLACK
        reply = self.channel.receive(rank, _RESPONSE + call_id, limit)
        if reply is None:
            raise TimeoutError(f"rank {rank} did not answer {op} within {limit:g} s")
        _, result, buffers, _ = reply
        if "error" in result:
            raise _decode_error(result["error"])
        return result, buffers


class _RemoteEndpoint:
    """A transport endpoint living on another rank, as the contract tests see it."""

    def __init__(self, driver: _Driver, rank: int, cluster: ClusterSpec, task: TaskId):
        self._driver, self.rank, self.cluster, self.task = driver, rank, cluster, task

    def start(self) -> None:
        pass  # started when the world was made

    def send(self, dst, tag, msg, timeout=None) -> None:
        self._driver.call(self.rank, "send", {"dst": str(TaskId.parse(dst)), "tag": tag, "timeout": timeout,
                                              "meta": msg.meta}, msg.buffers, timeout)

    def send_async(self, dst, tag, msg, timeout=None):
        self.send(dst, tag, msg, timeout)
        return COMPLETED

    def recv(self, src, tag, timeout=None) -> Message:
        result, buffers = self._driver.call(
            self.rank, "recv", {"src": None if src is None else str(TaskId.parse(src)), "tag": tag,
                                "timeout": timeout}, (), timeout)
        return Message(result["meta"], list(buffers), TaskId.parse(result["src"]))

    def close(self) -> None:
        self._driver.call(self.rank, "close")

    def abort(self) -> None:
        self._driver.call(self.rank, "abort")

    def lost_peers(self) -> dict:
        result, _ = self._driver.call(self.rank, "lost_peers")
        return {TaskId.parse(t): why for t, why in result["lost"].items()}

    def __repr__(self) -> str:
        return f"<remote endpoint {self.task} on rank {self.rank}>"


# -- worlds ----------------------------------------------------------------------------------------

class _Job:
    """What every rank of the runner holds: MPI, the communicators, and the current world."""

    def __init__(self, transport: str):
        from mpi4py import MPI

        self.MPI = MPI
        self.transport = transport
        world = MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.base = world.Dup()       # split into each test's world
        self.channel = _Channel(world.Dup(), MPI)
        for comm in (self.base, self.channel.comm):
            comm.Set_errhandler(MPI.ERRORS_RETURN)  # an MPI error is a Python exception, not an abort
        self.endpoint = None
        self.sub = None

    def make_world(self, size: int, options: dict):
        """Collective over the job: ranks below ``size`` start an endpoint of a fresh world."""
        from stratagem.plugins.manager import plugin_manager

        inside = self.rank < size
        self.sub = self.base.Split(0 if inside else self.MPI.UNDEFINED, self.rank)
        if not inside:
            return None
        cluster = ClusterSpec({"worker": [None] * size})
        self.endpoint = plugin_manager().create_transport(
            self.transport, cluster=cluster, task=TaskId("worker", self.rank), comm=self.sub, **options)
        self.endpoint.start()
        return self.endpoint

    def end_world(self) -> None:
        if self.endpoint is not None:
            with contextlib.suppress(Exception):
                self.endpoint.close()
        # The world's communicator is not freed: a late message to a freed one could reach whatever
        # communicator reuses its context id (see MpiTransport.close).
        self.endpoint = self.sub = None


def _serve(job: _Job) -> None:
    """Ranks other than 0: run the driver's calls until it says stop."""
    threads = []
    while True:
        op, meta, buffers, _ = job.channel.receive(0, _REQUEST, None)
        call_id = meta.pop("id")
        if op in ("world", "end_world", "shutdown"):  # in order, on this thread: they are collective
            try:
                if op == "world":
                    job.make_world(meta["size"], meta["options"])
                elif op == "end_world":
                    job.end_world()
                result = {}
            except Exception as exc:
                result = {"error": _encode_error(exc)}
            job.channel.send(0, _RESPONSE + call_id, "reply", result)
            if op == "shutdown":
                break
            continue
        thread = threading.Thread(target=_run_call, args=(job, job.endpoint, call_id, op, meta, buffers),
                                  daemon=True)
        thread.start()
        threads.append(thread)
        threads = [t for t in threads if t.is_alive()]
    for thread in threads:
        thread.join(CALL_TIMEOUT)


def _run_call(job: _Job, endpoint, call_id: int, op: str, meta: dict, buffers) -> None:
    reply_buffers: list = []
    try:
        if endpoint is None:
            raise RuntimeError(f"rank {job.rank} holds no endpoint (it is outside the current world)")
        if op == "send":
            endpoint.send(TaskId.parse(meta["dst"]), meta["tag"], Message(meta["meta"], list(buffers)),
                          timeout=meta["timeout"])
            result: dict = {}
        elif op == "recv":
            src = None if meta["src"] is None else TaskId.parse(meta["src"])
            message = endpoint.recv(src, meta["tag"], timeout=meta["timeout"])
            result, reply_buffers = {"meta": message.meta, "src": str(message.src)}, message.buffers
        elif op == "close":
            endpoint.close()
            result = {}
        elif op == "abort":
            endpoint.abort()
            result = {}
        elif op == "lost_peers":
            result = {"lost": {str(t): why for t, why in endpoint.lost_peers().items()}}
        else:
            raise RuntimeError(f"unknown call {op!r}")
    except Exception as exc:
        result, reply_buffers = {"error": _encode_error(exc)}, []
    job.channel.send(0, _RESPONSE + call_id, "reply", result, reply_buffers)


class _InJobContract(TransportContract):
    """The contract, run by the driver rank: worlds are made of ranks."""

    job: _Job
    driver: _Driver

    @contextlib.contextmanager
    def world(self, size, **options):
        if size > self.job.size:
            raise RuntimeError(f"a world of {size} needs mpiexec -n {size} at least (this job has {self.job.size})")
        merged = {"timeout": CALL_TIMEOUT, "peer_timeout": PEER_TIMEOUT, **self.options, **options}
        errors: dict = {}
        threads = [threading.Thread(target=lambda r=r: errors.__setitem__(r, self._call_safely(
            r, "world", {"size": size, "options": merged}, timeout=merged["timeout"])))
            for r in range(1, self.job.size)]
        for t in threads:
            t.start()
        try:
            mine = self.job.make_world(size, merged)
        except BaseException as exc:
            errors[0] = exc
        finally:
            for t in threads:
                t.join()
        failures = [f"rank {r}: {e}" for r, e in sorted(errors.items()) if e is not None]
        if failures:
            self._end_world()
            raise RuntimeError("could not make the world: " + "; ".join(failures))
        cluster = ClusterSpec({"worker": [None] * size})
        endpoints = [mine] + [_RemoteEndpoint(self.driver, r, cluster, TaskId("worker", r)) for r in range(1, size)]
        try:
            yield endpoints
        finally:
            self._end_world()

    def _call_safely(self, rank, op, meta, timeout=None):
        try:
            self.driver.call(rank, op, meta, timeout=timeout)
        except BaseException as exc:  # reported by the caller
            return exc
        return None

    def _end_world(self) -> None:
        threads = [threading.Thread(target=self._call_safely, args=(r, "end_world", {}))
                   for r in range(1, self.job.size)]
        for t in threads:
            t.start()
        self.job.end_world()
        for t in threads:
            t.join()

    def test_sigkilled_peer_process_raises_peer_lost(self):
        pytest.skip(f"the {self.transport} transport's peers are ranks of one MPI job, not processes a test "
                    f"can spawn; its own tests kill a rank with SIGKILL instead")

    def test_natives_decide_alike_on_every_rank_before_anything_moves(self):
        pytest.skip(f"the {self.transport} transport's natives run on every rank of the MPI job at once, which "
                    f"this suite's one driving rank cannot do; its own tests run them inside mpiexec")

    test_natives_give_core_results_and_every_call_is_numbered_once = \
        test_natives_decide_alike_on_every_rank_before_anything_moves

    def test_secret_mismatch_is_refused(self):
        if getattr(self.transport_class(), "authenticates_peers", True) is False:
            pytest.skip(f"the {self.transport} transport has no connections to authenticate: the MPI job "
                        f"is the trust boundary (a cluster secret is accepted and not used)")
        super().test_secret_mismatch_is_refused()


def contract_tests() -> list[str]:
    """The names of the contract's tests, in a stable order."""
    return sorted(name for name in dir(TransportContract) if name.startswith("test_"))


def _drive(job: _Job, transport: str, names: list[str], report_path: str) -> None:
    driver = _Driver(job.channel)
    report: dict = {"transport": transport, "ranks": job.size, "tests": {}, "running": None}

    def save() -> None:
        with open(report_path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(report_path + ".tmp", report_path)

    contract = type(f"InJobContract_{transport}", (_InJobContract,), {"transport": transport, "job": job,
                                                                     "driver": driver})
    for name in names:
        report["running"] = name
        save()
        started = time.monotonic()
        try:
            getattr(contract(), name)()
            outcome, detail = "passed", ""
        except pytest.skip.Exception as exc:
            outcome, detail = "skipped", str(exc.msg if hasattr(exc, "msg") else exc)
        except BaseException as exc:  # noqa: BLE001 - a failed test, reported
            outcome, detail = "failed", "".join(traceback.format_exception(exc))
        report["tests"][name] = {"outcome": outcome, "detail": detail, "seconds": round(time.monotonic() - started, 2)}
        print(f"[mpi contract] {name}: {outcome} ({time.monotonic() - started:.1f}s)", file=sys.stderr, flush=True)
        report["running"] = None
        save()
    for rank in range(1, job.size):
        driver.call(rank, "shutdown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the transport contract inside an MPI job (under mpiexec).")
    parser.add_argument("--transport", default="mpi")
    parser.add_argument("--report", required=True, help="JSON file rank 0 writes the results to")
    parser.add_argument("tests", nargs="*", help="contract tests to run (default: all)")
    args = parser.parse_args(argv)
    names = args.tests or contract_tests()
    unknown = sorted(set(names) - set(contract_tests()))
    if unknown:
        parser.error(f"not contract tests: {', '.join(unknown)}")
    job = _Job(args.transport)
    if job.rank == 0:
        _drive(job, args.transport, names, args.report)
    else:
        _serve(job)
    job.base.Barrier()
    return 0


# -- the pytest side -------------------------------------------------------------------------------

def _make_test(name: str):
    original = getattr(TransportContract, name)

    def test(self):
        self._outcome(name)

    test.__name__ = test.__qualname__ = name
    test.__doc__ = original.__doc__
    test.__dict__.update(original.__dict__)  # its marks (slow, ...)
    return test


class MpiTransportContract(TransportContract):
    """The contract for a transport whose endpoints are MPI ranks: each test runs in an mpiexec job.

    Subclass and set ``transport`` (``stratagem.testing.run_contract(name)`` does it). Each test gets a job of
    its own and reports what happened to it there. One job per test, not per class, so that what a
    test leaves behind (a receive blocked until its timeout, a transport being torn down) cannot reach
    the next one: a fresh job inherits nothing. A failed test fails; it is not run again. Skipped,
    with the reason, where ``mpiexec`` or a private network namespace (``stratagem.launch.mpi``)
    is not available.
    """

    #: Ranks of the job (the largest world a contract test builds is 4).
    ranks: int = DEFAULT_RANKS
    #: Seconds one test's job may take.
    job_timeout: float = 300.0
    pytestmark = [pytest.mark.timeout(900)]

    @pytest.fixture(autouse=True)
    def _mpi_contract_job(self, request):
        # pytest runs a class's fixture on the test's own instance: the report stays with that test.
        self._mpi_report = _run_job(self.transport, [request.node.name], self.ranks, self.job_timeout)
        yield

    def _outcome(self, name: str) -> None:
        report = self._mpi_report
        if report.get("skip"):
            pytest.skip(report["skip"])
        result = report.get("tests", {}).get(name)
        if result is None:
            pytest.fail(f"the MPI job did not report {name}: {report.get('problem', 'unknown reason')}",
                        pytrace=False)
        if result["outcome"] == "skipped":
            pytest.skip(result["detail"])
        if result["outcome"] == "failed":
            pytest.fail(f"{name} failed inside the MPI job ({report['ranks']} ranks):\n{result['detail']}",
                        pytrace=False)


for _name in contract_tests():
    setattr(MpiTransportContract, _name, _make_test(_name))


def _run_job(transport: str, names: list[str], ranks: int, timeout: float) -> dict:
    from stratagem.core.errors import ConfigurationError
    from stratagem.launch.mpi import run_mpi_job

    env = {k: v for k, v in os.environ.items() if k not in ("STRATAGEM_CONFIG", "TF_CONFIG", "STRATAGEM_SECRET")}
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory(prefix="stratagem-mpi-contract-") as tmp:
        path = os.path.join(tmp, "report.json")
        command = [sys.executable, "-m", "stratagem.testing.mpi_contract", "--transport", transport,
                   "--report", path, *names]
        try:
            job = run_mpi_job(ranks, command, timeout=timeout, env=env)
        except ConfigurationError as exc:
            return {"skip": f"cannot run an MPI job here: {exc}"}
        report = {"tests": {}, "ranks": ranks}
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
    if job.timed_out or job.returncode != 0 or report.get("running"):
        how = f"timed out after {timeout:g} s" if job.timed_out else f"mpiexec exited with {job.returncode}"
        running = f" while running {report['running']}" if report.get("running") else ""
        report["problem"] = f"the job {how}{running}; its output ends:\n{job.output[-4000:]}"
    return report


if __name__ == "__main__":
    sys.exit(main())
