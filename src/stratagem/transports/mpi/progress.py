"""How the ``mpi`` transport makes progress: reading its communicator, waiting, and liveness.

MPI has no blocking wait with a timeout (and Open MPI's blocking calls spin a core), so every wait
polls (``MPI_Improbe``, ``MPI_Test``): it spins for a quarter of a millisecond, then sleeps with a
back-off up to a millisecond. One thread at a time holds the *reader role* and reads the
communicator: a ``recv()`` that waits reads for itself; a native collective takes the role for its
duration (and hears heartbeats meanwhile); a background thread reads when nobody else does (early
messages, heartbeats, and progress for sends in flight) and lets go the moment another thread asks.

Liveness: heartbeats every ``peer_timeout / 4`` seconds to every peer, a peer silent for
``peer_timeout`` is lost; a goodbye marks it lost at once; so does MPI's report of a failed process
(ULFM: ``MPI_ERR_PROC_FAILED``, then ``MPI_Comm_get_failed``/``MPI_Comm_ack_failed``). Silence while
this process did not listen (stopped, starved, or its transport closed) is its own: it does not count
against the peers, so a process that wakes from a stall does not take every peer for lost at once. A
peer that said goodbye still gets heartbeats until its process ends: at the end of its script it waits
for every peer to leave or be lost before ``MPI_Finalize`` (:meth:`MpiProgress.await_departures`). A native
collective hears goodbyes too (a member that left in the middle of it never completes it): the
goodbye travels on another communicator than the collective's data, so it may overtake the last data
of a member that completed its part and then left; the collective therefore raises only if it is
still incomplete ``DEPARTED_GRACE`` seconds after the goodbye.

Guarded blocking calls. Where MPI can revoke a communicator (ULFM) and threads may call MPI at once
(``MPI_THREAD_MULTIPLE``), a native collective makes MPI's own *blocking* call (``MPI_Allreduce``:
the tuned algorithms, no polling) instead of polling a nonblocking one. It registers a
:class:`Guard` first; while guards are active, the background reader is their watchdog: every few
milliseconds it hears heartbeats and goodbyes and checks each guard's peers and deadline, and when a
peer is lost, the call overruns its timeout or the transport closes, it records the error and
revokes the guard's communicator (``MPI_Comm_revoke``). That makes the blocked call return, on every
member, with ``MPI_ERR_REVOKED``; the caller raises the recorded error (``PeerLostError``,
``TransportTimeout``, ``TransportClosed``), the other members the error MPI gives them. A member whose
process dies fails the call by itself (ULFM: ``MPI_ERR_PROC_FAILED``). One case a revoke cannot end: a
member that makes no MPI progress at all (a stopped process, or one stuck in native code holding the
GIL, so that even its background reader stands still) -- Open MPI then finishes the revoked call only
when that member moves again. A call still blocked ``REVOKE_GRACE`` seconds after its revoke therefore
aborts the MPI job (``MPI_Abort``, with the reason on stderr) rather than hang for ever.

:class:`MpiProgress` does this for one :class:`~stratagem.transports.mpi.transport.MpiTransport`, which owns
it and gives it what it reads (the communicator, the mailbox, the lock around MPI calls); its native
collectives (:mod:`~stratagem.transports.mpi.collectives`) wait and take the reader role through it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Callable

import numpy as np

from stratagem.core.failures import said_goodbye
from stratagem.core import wire
from stratagem.core.cluster import TaskId
from stratagem.core.errors import CommunicationError, PeerLostError, ProtocolError, TransportClosed, TransportTimeout
from stratagem.transport_kit.mailbox import Mailbox
from stratagem.core.transport import Message
from stratagem.core.wire import Kind, Limits

log = logging.getLogger("stratagem.transports.mpi.transport")


TAG_ENVELOPE = 1
TAG_DATA = 2
TAG_GOODBYE = 3
TAG_HEARTBEAT = 4
#: Largest single MPI message: counts are C ints, so big buffers go in pieces.
MAX_PIECE_BYTES = 1 << 30

_SPIN_SECONDS = 250e-6     # a wait polls without sleeping this long (a reply often comes within it)...
_FIRST_SLEEP = 20e-6       # then sleeps double from this...
_MAX_SLEEP = 1e-3          # ...up to this
_EAGER = (100e-6, 2e-3)    # a collective's wait: (longest sleep, spin) -- MPI progresses only when polled
_USER_POLL = 0.1           # a waiting recv() returns to the mailbox (losses, timeouts) this often
_BACKGROUND_SLEEP = 2e-3   # the background reader's sleep when nothing arrives
_BACKGROUND_GRACE = 0.02   # the background reader stays away this long after a recv() read
#: Seconds a collective still waits for a member that said goodbye (see the module doc).
DEPARTED_GRACE = 2.0
#: The watchdog's sleep between checks of the guarded calls (a lost peer or a timeout is acted on
#: this late at most; sparse, so that it takes little CPU from the ranks' blocking calls).
_WATCH_SLEEP = 5e-3
#: ...and hears heartbeats and goodbyes this often meanwhile. An MPI call from a second thread stalls
#: the blocked one (Open MPI's progress lock; worse when a core is oversubscribed), so rarely: a
#: goodbye has DEPARTED_GRACE anyway, and heartbeats go every peer_timeout / 4.
_WATCH_DRAIN = 0.1
#: Seconds a revoked call may stay blocked before the MPI job is aborted (see _abort_wedged).
REVOKE_GRACE = 10.0


class Guard:
    """The guard of one communicator's blocking calls (see the module doc), reused from call to call:
    ``arm()`` before the calls, ``disarm()`` after, and the watchdog may fail them meanwhile.

    ``guards``: the transport's set of armed guards (the watchdog's list). ``peers``: the members
    whose loss fails the calls. ``what()``: the call, for error messages (made only for an error).
    """

    __slots__ = ("guards", "comm", "peers", "deadline", "timeout", "what", "error", "fired_at", "lock")

    def __init__(self, guards: set, comm, peers):
        self.guards = guards
        self.comm = comm
        self.peers = tuple(peers)
        self.deadline: float | None = None
        self.timeout: float | None = None
        self.what: Callable[[], str] = lambda: "a collective"
        self.error: Exception | None = None    # set by the watchdog before it revokes
        self.fired_at = 0.0
        self.lock = threading.Lock()

    def arm(self, timeout: float | None, what: Callable[[], str]) -> None:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout, self.what, self.error = timeout, what, None
        self.guards.add(self)

    def disarm(self) -> Exception | None:
        """Stop watching; the watchdog's error if it failed the calls (and revoked the communicator)."""
        with self.lock:  # from here on the watchdog leaves these calls alone
            self.guards.discard(self)
        return self.error


class _Backoff:
    """Spin a little, then sleep with exponential back-off: the shape of every wait here."""

    def __init__(self, max_sleep: float = _MAX_SLEEP, spin: float = _SPIN_SECONDS):
        self.spin_until = time.monotonic() + spin
        self.sleep = _FIRST_SLEEP
        self.max_sleep = max_sleep

    def pause(self, remaining: float | None = None, wake: threading.Event | None = None) -> None:
        if time.monotonic() < self.spin_until:
            return
        delay = self.sleep if remaining is None else max(0.0, min(self.sleep, remaining))
        if wake is None:
            time.sleep(delay)
        else:
            wake.wait(delay)
        self.sleep = min(self.sleep * 2, self.max_sleep)


class MpiProgress:
    """Reading, waiting and liveness for one :class:`~stratagem.transports.mpi.transport.MpiTransport`
    (see the module doc).

    Args:
        task: the transport's task.
        tasks: the cluster's tasks, in rank order (rank r is ``tasks[r]``).
        mailbox: where messages read are filed, and losses noted.
        limits: the wire limits messages are held to.
        peer_timeout: seconds of silence after which a peer is lost (heartbeats go 4 times as often).

    The transport hands over MPI when it starts: :meth:`use` (the module and the lock around MPI
    calls, before its first MPI call) and :meth:`begin` (the point-to-point communicator, once made).
    """

    def __init__(self, task: TaskId, tasks: list[TaskId], mailbox: Mailbox, limits: Limits, peer_timeout: float):
        self.task = task
        self._tasks = tasks
        self._rank_of = {t: r for r, t in enumerate(tasks)}
        self._mailbox = mailbox
        self.limits = limits
        self.peer_timeout = peer_timeout
        self.MPI = None
        self.mpi_lock: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._comm = None
        self._stopping = False
        self._reader = threading.Lock()   # whoever holds it reads the communicator
        self._user_read_at = 0.0
        self._wanted = 0                  # threads waiting for the reader role (collectives)
        self._wake = threading.Event()    # set by a thread that wants the role: the background lets go
        self._last_heard: dict[TaskId, float] = {}
        self._next_heartbeat = 0.0
        self._housekept_at = 0.0           # the last housekeeping (see its own-silence rule)
        self._small_sends: list = []       # (request, frame) of inline sends still in flight
        self._small_lock = threading.Lock()
        self._abandoned: list = []         # requests given up on, with the memory MPI may still read
        self._refused: set[TaskId] = set()  # peers that broke the protocol
        self._heartbeats_read_at = 0.0
        self._departed: dict[TaskId, float] = {}   # peers whose goodbye a collective heard, and when
        self._goodbyes: set[TaskId] = set()        # peers that said goodbye (however it was heard)
        self._failed: set[TaskId] = set()          # peers MPI (ULFM) reports failed
        self.guards: set = set()          # guarded blocking calls in progress (see Guard)
        self._watch_drained_at = 0.0
        self._retired_at = 0.0

    # -- what the transport tells ------------------------------------------------------------------
    def use(self, MPI, mpi_lock: contextlib.AbstractContextManager) -> None:
        """MPI is initialised: its module, and the lock every MPI call is made under."""
        self.MPI, self.mpi_lock = MPI, mpi_lock

    def begin(self, comm) -> None:
        """The point-to-point communicator is made: every peer counts as just heard from."""
        self._comm = comm
        now = time.monotonic()
        self._last_heard = {t: now for t in self._tasks if t != self.task}
        self._next_heartbeat = now
        self._housekept_at = now

    def track(self, request, frame) -> None:
        """An inline send in flight (``frame``, the memory MPI reads, is kept until it completes)."""
        with self._small_lock:
            self._small_sends.append((request, frame))

    def small_requests(self) -> list:
        """The inline sends (and heartbeats) still in flight."""
        with self._small_lock:
            return [r for r, _ in self._small_sends]

    def stop(self) -> None:
        """The transport is closing: stop reading (waiting calls raise ``TransportClosed``)."""
        self._stopping = True

    def wait_stopped(self, timeout: float) -> bool:
        """Wait until no thread reads any more; False if one still does after ``timeout`` seconds."""
        if not self._reader.acquire(timeout=timeout):  # a recv() still reading lets go within _USER_POLL
            return False
        self._reader.release()
        return True

    # -- waiting on MPI requests -------------------------------------------------------------------
    def test_all(self, requests: list, peers) -> bool:
        with self.mpi_lock:
            try:
                return self.MPI.Request.Testall(requests)
            except self.MPI.Exception as exc:
                raise self.translate(exc, self._comm, peers, "a send") from None

    def wait_requests(self, requests: list, timeout: float | None, peers, what: str, comm=None,
                      on_poll: Callable[[], None] | None = None, eager: bool = False) -> None:
        """Poll ``requests`` until all complete; raise ``PeerLostError`` if one of ``peers`` is lost,
        ``TransportTimeout`` after ``timeout`` seconds, ``TransportClosed`` if we are closing.

        ``eager``: poll harder (a collective: MPI moves its data only while it is polled)."""
        MPI = self.MPI
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = _Backoff(*_EAGER) if eager else _Backoff()
        while True:
            with self.mpi_lock:
                try:
                    if MPI.Request.Testall(requests):
                        return
                except MPI.Exception as exc:
                    raise self.translate(exc, comm or self._comm, peers, what) from None
            for peer in peers:
                reason = self._mailbox.is_lost(peer) or self._departed_reason(peer)
                if reason is not None:
                    raise PeerLostError(peer, f"{reason} (during {what})")
            if self._stopping:
                raise TransportClosed(f"{self.task}: transport closed during {what}")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TransportTimeout(f"{self.task}: {what} did not complete within {timeout:g} s")
            if on_poll is not None:
                on_poll()
            backoff.pause(remaining)

    def abandon(self, requests: list, keep) -> None:
        """Requests we stop waiting for: keep them and the memory MPI may still read, for good."""
        self._abandoned.append((requests, keep))

    # -- guarded blocking calls --------------------------------------------------------------------
    def blocking_failure(self, exc, guard: Guard) -> Exception:
        """The error for a guarded call MPI failed: a failed process (ULFM), else a revoke by a peer
        -- for its own timeout (ours is then near: say so) or a failure MPI has not named yet."""
        error = self.translate(exc, guard.comm, guard.peers, guard.what())
        if (isinstance(error, CommunicationError) and guard.deadline is not None
                and exc.Get_error_class() == getattr(self.MPI, "ERR_REVOKED", None)):
            # The members of a call started together and time out together: the first to time out
            # revoked the communicator; if ours expired meanwhile, that is what happened here too.
            # (translate already waited up to 2 s for MPI to name a failure.)
            if time.monotonic() >= guard.deadline:
                return TransportTimeout(f"{self.task}: {guard.what()} did not complete within "
                                        f"{guard.timeout:g} s")
        return error

    def _watch_guards(self) -> None:
        """The watchdog's round: fail the calls that must end; now and then hear heartbeats and goodbyes
        first (MPI calls from this thread slow the blocked call down, so only every _WATCH_DRAIN s)."""
        now = time.monotonic()
        if now - self._watch_drained_at >= _WATCH_DRAIN and self._reader.acquire(blocking=False):
            self._watch_drained_at = now  # (a recv() holding the reader role hears them itself)
            try:
                self._drain_heartbeats()
            finally:
                self._reader.release()
        self._check_guards(time.monotonic())

    def _check_guards(self, now: float) -> None:
        """Fail the guarded calls that must end (a lost peer, a timeout, closing); also run by every
        reader's housekeeping, so a thread that keeps the reader role (a long message) still watches."""
        for guard in list(self.guards):
            if guard.error is not None:  # revoked, and still blocked
                if now - guard.fired_at > REVOKE_GRACE:
                    self._abort_wedged(guard)
                continue
            error = self._guard_failure(guard, now)
            if error is not None:
                self._fire(guard, error)

    def _guard_failure(self, guard: Guard, now: float) -> Exception | None:
        for peer in guard.peers:
            reason = self._mailbox.is_lost(peer) or self._departed_reason(peer)
            if reason is not None:
                return PeerLostError(peer, f"{reason} (during {guard.what()})")
        if self._stopping:
            return TransportClosed(f"{self.task}: transport closed during {guard.what()}")
        if guard.deadline is not None and now >= guard.deadline:
            return TransportTimeout(f"{self.task}: {guard.what()} did not complete within {guard.timeout:g} s")
        return None

    def _fire(self, guard: Guard, error: Exception) -> None:
        """Fail a guarded call: record why, then revoke its communicator (every member's call returns)."""
        with guard.lock:
            if guard not in self.guards or guard.error is not None:
                return  # it completed meanwhile, or was already failed
            guard.error = error
            guard.fired_at = time.monotonic()
        log.info("%s: revoking a collective's communicator: %s", self.task, error)
        try:
            guard.comm.Revoke()
        except (NotImplementedError, AttributeError, self.MPI.Exception) as exc:  # pragma: no cover - ULFM checked at start
            log.error("%s: MPI_Comm_revoke failed (%s); the blocked collective may not return", self.task, exc)

    # -- errors ------------------------------------------------------------------------------------
    def translate(self, exc, comm, peers, what: str) -> Exception:
        """The Stratagem error for an MPI error: ``PeerLostError`` naming the task when MPI (ULFM)
        reports a failed process (``MPI_ERR_PROC_FAILED``, or a communicator revoked after one)."""
        MPI = self.MPI
        failed = self.note_failures(comm) or self.note_failures(self._comm)
        revoked = exc.Get_error_class() in {getattr(MPI, "ERR_REVOKED", None), MPI.ERR_IN_STATUS}
        deadline = time.monotonic() + 2.0
        while not failed and revoked and time.monotonic() < deadline:
            # A peer revoked the communicator, likely for a failure MPI has not told us about yet.
            time.sleep(0.05)
            failed = self.note_failures(self._comm) or [p for p in peers if self._mailbox.is_lost(p)]
        if failed:
            lost = [p for p in peers if p in failed] or failed
            return PeerLostError(lost[0], f"{self._mailbox.is_lost(lost[0]) or 'its process failed'} (during {what})")
        if exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", None):
            return CommunicationError(f"{self.task}: {what} failed: a peer revoked the communicator after "
                                      f"a failure of its own ({exc})")
        return CommunicationError(f"{self.task}: MPI error during {what}: {exc}")

    def note_failures(self, comm=None) -> list[TaskId]:
        """Ask MPI (ULFM) which processes failed; mark their tasks lost and acknowledge them."""
        MPI = self.MPI
        comm = comm or self._comm
        try:
            with self.mpi_lock:
                group = comm.Get_failed()
                ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), self._comm.Get_group())
                comm.Ack_failed()
        except (NotImplementedError, MPI.Exception, AttributeError):
            return []
        failed = [self._tasks[r] for r in ranks if r is not None and 0 <= r < len(self._tasks)]
        self._failed.update(failed)
        for task in failed:
            if self._mailbox.is_lost(task) is None:
                log.warning("%s: MPI reports the process of %s failed", self.task, task)
                self._mailbox.mark_lost(task, f"its process died (MPI reports {task} failed)")
        return failed

    # -- reading -----------------------------------------------------------------------------------
    def pump_for_waiter(self, remaining: float | None) -> bool:
        """Read for a waiting ``recv`` if no other thread is reading; False if one is."""
        if self._stopping or self._wanted:  # a collective is taking the communicator: let it
            return False
        self._user_read_at = time.monotonic()
        self._wake.set()  # the background reader lets go at once
        if not self._reader.acquire(timeout=_BACKGROUND_SLEEP):
            return False
        try:
            self._read(_USER_POLL if remaining is None else min(remaining, _USER_POLL), _MAX_SLEEP)
        finally:
            self._user_read_at = time.monotonic()
            self._reader.release()
            self._mailbox.notify()  # another waiter may want to take over reading
        return True

    def _abort_wedged(self, guard: Guard) -> None:
        """A revoked call that still does not return: a member makes no MPI progress at all (stopped,
        or stuck in native code holding the GIL), and ULFM's revoke cannot end a call that waits on it.
        Rather than hang for ever, end the whole MPI job, saying why."""
        message = (f"{self.task}: {guard.what()} stayed blocked {REVOKE_GRACE:g} s after its communicator "
                   f"was revoked ({guard.error}); a peer makes no MPI progress (stopped or stuck), so the "
                   f"MPI job is aborted instead of hanging (blocking_collectives=False polls instead, and "
                   f"raises without aborting)")
        log.critical("%s", message)
        with contextlib.suppress(Exception):
            print(f"stratagem: {message}", file=sys.stderr, flush=True)
        self.MPI.COMM_WORLD.Abort(1)

    def read_in_background(self) -> None:
        """The background reader's loop (its own thread, until the transport stops)."""
        while not self._stopping:
            if self.guards:  # a guarded blocking call is in progress: be its watchdog
                self._watch_guards()
                time.sleep(_WATCH_SLEEP)
                continue
            quiet = time.monotonic() - self._user_read_at
            if quiet < _BACKGROUND_GRACE:
                time.sleep(_BACKGROUND_GRACE - quiet)
                continue
            if self._wanted or not self._reader.acquire(timeout=0.05):
                time.sleep(_BACKGROUND_GRACE)
                continue
            self._wake.clear()
            try:
                self._read(0.05, _BACKGROUND_SLEEP, background=True)
            except Exception:  # never die silently: log, and keep serving
                log.exception("%s: the mpi transport's reader failed", self.task)
                time.sleep(0.05)
            finally:
                self._reader.release()
        for guard in list(self.guards):  # closing: no call stays blocked
            self._fire(guard, TransportClosed(f"{self.task}: transport closed during {guard.what()}"))
        while self.guards:  # ...nor blocked for ever (see _abort_wedged)
            self._check_guards(time.monotonic())
            time.sleep(_WATCH_SLEEP)

    def failed(self, task: TaskId) -> bool:
        """Whether MPI (ULFM) reported ``task``'s process failed."""
        return task in self._failed

    def await_departures(self) -> dict[TaskId, str]:
        """At the end of the script, the transport closed (its goodbye sent): read heartbeats and
        goodbyes until every peer has said goodbye or is lost; return the peers lost otherwise (no
        heartbeat for ``peer_timeout``; its process failed, even after a goodbye), in the order they
        were lost, with why.

        ``MPI_Finalize`` waits for every rank, and under ULFM its agreement never completes once a rank
        stalled or died (it spins, holding the GIL), so a rank must not enter it before its peers are
        done. A peer that is slow but alive goes on sending heartbeats (to a peer that said goodbye
        too), so it is waited for as long as it runs; one stopped is lost ``peer_timeout`` after it
        was last heard, as during training."""
        if self._comm is None:
            return {}
        peers = set(self._last_heard)
        with self._reader:         # nobody else reads any more (the transport is closed)
            while True:
                lost = self._mailbox.lost()
                if peers <= lost.keys() | self._goodbyes:
                    return {task: why for task, why in lost.items()
                            if task in peers and (task not in self._goodbyes or task in self._failed)}
                try:
                    if self._read_one():
                        continue
                    self.housekeeping()
                except Exception:  # never leave the wait on a bad message: log it, and keep hearing
                    log.exception("%s: reading while waiting for the peers to leave failed", self.task)
                time.sleep(_BACKGROUND_SLEEP)

    @contextlib.contextmanager
    def reading(self, timeout: float | None):
        """Hold the reader role (a native collective: nobody else polls the communicator meanwhile)."""
        self._wanted += 1
        self._wake.set()  # the background reader lets go at once
        try:
            if not self._reader.acquire(timeout=-1 if timeout is None else timeout):
                raise TransportTimeout(f"{self.task}: the communicator stayed busy for {timeout:g} s")
        finally:
            self._wanted -= 1
        try:
            yield self._drain_heartbeats  # the holder calls it while it polls
        finally:
            self._reader.release()

    def _read(self, seconds: float, max_sleep: float, background: bool = False) -> bool:
        """Read (holding the reader role) until something is filed or ``seconds`` pass; the
        background reader also stops as soon as another thread wants the role."""
        started = time.monotonic()
        deadline = started + seconds
        # The background reader does not spin: its polls compete with the application's MPI calls
        # (every MPI call of the process shares Open MPI's progress engine).
        backoff = _Backoff(max_sleep, spin=0.0 if background else _SPIN_SECONDS)
        while not self._stopping:
            if self._read_one():
                return True
            self.housekeeping()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._wanted or (background and (self._wake.is_set() or self.guards)):
                return False
            backoff.pause(remaining, self._wake if background else None)
        return False

    def _read_one(self) -> bool:
        """Handle the next message if there is one; True if a data message was filed."""
        MPI = self.MPI
        status = MPI.Status()
        try:
            with self.mpi_lock:
                message = self._comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        except MPI.Exception as exc:
            self.translate(exc, self._comm, (), "a probe")  # notes failed processes (ULFM)
            return False
        if message is None:
            return False
        source, mpi_tag, count = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
        task = self._tasks[source]
        self._last_heard[task] = time.monotonic()
        too_big = count > self.limits.max_frame_bytes
        data = bytearray(1 if too_big else count)
        try:
            with self.mpi_lock:
                message.Recv([data, MPI.BYTE])
        except MPI.Exception as exc:
            self._refuse(task, f"an MPI message of {count} bytes under tag {mpi_tag} could not be read: {exc}")
            return False
        if task in self._refused:
            return False  # what is left of a stream we stopped trusting
        if too_big:
            self._refuse(task, f"sent an MPI message of {count} bytes, over the limits")
        elif mpi_tag == TAG_ENVELOPE:
            return self._file(task, data)
        elif mpi_tag == TAG_GOODBYE:
            self._goodbyes.add(task)
            self._mailbox.mark_lost(task, said_goodbye(task))
        elif mpi_tag != TAG_HEARTBEAT:
            self._refuse(task, f"sent an unexpected MPI message (tag {mpi_tag})")
        return False

    def _file(self, task: TaskId, data: bytearray) -> bool:
        """Decode an envelope (and read the data pieces that follow it); file the message."""
        try:
            header = wire.read_header(data, self.limits)
            end = wire.HEADER_SIZE + header.envelope_len
            if header.kind != Kind.DATA:
                raise ProtocolError(f"unexpected frame kind {header.kind.name}")
            if len(data) == end + header.payload_len:
                frame = wire.decode(data, self.limits)
                tag, meta, buffers = frame.tag, frame.meta, frame.buffers
            elif len(data) == end:
                tag, meta, specs = wire.read_envelope(header, memoryview(data)[wire.HEADER_SIZE:end], self.limits)
                buffers = self._receive_data(task, specs)
                if buffers is None:
                    return False
            else:
                raise ProtocolError(f"envelope message of {len(data)} bytes does not match its header")
        except ProtocolError as exc:
            self._refuse(task, f"sent a malformed message: {exc}")
            return False
        self._mailbox.put(task, tag, Message(meta, buffers, task))
        return True

    def _receive_data(self, task: TaskId, specs) -> list | None:
        """Receive the raw pieces of each buffer straight into freshly allocated arrays."""
        MPI = self.MPI
        arrays = [np.empty(s.shape, dtype=s.dtype) for s in specs]
        requests = []
        with self.mpi_lock:
            for array in arrays:
                raw = array.reshape(-1).view(np.uint8)
                for start in range(0, raw.size, MAX_PIECE_BYTES):
                    requests.append(self._comm.Irecv([raw[start:start + MAX_PIECE_BYTES], MPI.BYTE],
                                                     self._rank_of[task], TAG_DATA))
        try:
            self.wait_requests(requests, None, [task], f"a message from {task}", on_poll=self._drain_heartbeats)
        except (PeerLostError, TransportClosed, CommunicationError) as exc:
            log.info("%s: gave up on a message from %s: %s", self.task, task, exc)
            for request in requests:
                with contextlib.suppress(Exception), self.mpi_lock:
                    request.Cancel()
            self.abandon(requests, arrays)
            return None
        return arrays

    def _drain_heartbeats(self) -> None:
        """While a long message or a collective is in progress, keep hearing everybody's heartbeats
        and goodbyes (and sending our heartbeats). At most every few milliseconds: it costs a probe."""
        now = time.monotonic()
        if now - self._heartbeats_read_at < 0.005:
            return
        self._heartbeats_read_at = now
        MPI = self.MPI
        status = MPI.Status()
        for tag in (TAG_HEARTBEAT, TAG_GOODBYE):
            while True:
                try:
                    with self.mpi_lock:
                        message = self._comm.Improbe(MPI.ANY_SOURCE, tag, status)
                        if message is not None:
                            message.Recv([bytearray(max(1, status.Get_count(MPI.BYTE))), MPI.BYTE])
                except MPI.Exception:
                    break
                if message is None:
                    break
                task = self._tasks[status.Get_source()]
                self._last_heard[task] = time.monotonic()
                if tag == TAG_GOODBYE:
                    # Not marked lost yet: its data sent before the goodbye may still be unread.
                    self._departed.setdefault(task, time.monotonic())
                    self._goodbyes.add(task)
        self.housekeeping()

    def _departed_reason(self, task: TaskId) -> str | None:
        """Why ``task`` counts as gone for a collective: it said goodbye over ``DEPARTED_GRACE`` ago."""
        left = self._departed.get(task)
        if left is None or time.monotonic() - left < DEPARTED_GRACE:
            return None
        self._mailbox.mark_lost(task, said_goodbye(task))
        return said_goodbye(task)

    def _refuse(self, task: TaskId, reason: str) -> None:
        """A peer broke the protocol: its stream cannot be trusted any more, so it is lost."""
        log.error("%s: %s %s; treating it as lost", self.task, task, reason)
        self._refused.add(task)
        self._mailbox.mark_lost(task, f"{task} {reason}")

    # -- liveness ----------------------------------------------------------------------------------
    def housekeeping(self) -> None:
        """Retire finished small sends, send heartbeats when due, and declare silent peers lost."""
        MPI = self.MPI
        now = time.monotonic()
        gap, self._housekept_at = now - self._housekept_at, now
        if gap > self.peer_timeout / 4:
            # Nobody here listened meanwhile (this process was stopped or starved, or its transport was
            # closed): the silence was ours, so it does not count against the peers. A process that
            # wakes from a stall does not take every peer for lost at once; they speak up, or stay
            # silent for a whole peer timeout from now.
            for task in self._last_heard:
                self._last_heard[task] += gap
        if self.guards:
            self._check_guards(now)
        if self._small_sends and now - self._retired_at > 0.001:
            self._retired_at = now
            with self._small_lock:
                still = []
                for request, frame in self._small_sends:
                    try:
                        with self.mpi_lock:
                            done = request.Test()
                    except MPI.Exception:
                        done = True  # a failed peer: nothing more will happen to this send
                    if not done:
                        still.append((request, frame))
                self._small_sends = still
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.peer_timeout / 4
        lost = self._mailbox.lost()
        heartbeats = []
        for task, heard in self._last_heard.items():
            # A peer that said goodbye still gets heartbeats until its process ends: at the end of
            # its script it waits for every peer to leave or be lost (await_departures), and tells
            # the slow from the stalled by them.
            if task in lost and (task not in self._goodbyes or task in self._failed):
                continue
            if task not in lost and now - heard > self.peer_timeout:
                log.warning("%s: nothing from %s for %.1f s; declaring it lost", self.task, task, now - heard)
                self._mailbox.mark_lost(task, f"no heartbeat from {task} for {self.peer_timeout:g} s "
                                              f"(its process hung, died, or aborted its transport)")
                continue
            try:
                with self.mpi_lock:
                    heartbeats.append((self._comm.Isend([b"h", MPI.BYTE], self._rank_of[task], TAG_HEARTBEAT), None))
            except MPI.Exception as exc:
                self.translate(exc, self._comm, [task], "a heartbeat")
        with self._small_lock:
            self._small_sends += heartbeats
