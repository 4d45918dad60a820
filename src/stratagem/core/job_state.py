"""Whether the job this task belongs to has finished, as its supervisor records it.

A job is finished when its chief ended normally (exit status 0). A task that was stopped or slow
(SIGSTOP, a long pause), or a worker started again by ``--restart-workers`` that is not back yet, may
find only closed connections when it goes on: its peers are gone because the job is over, not because
they failed. Without being told, it would report them lost and fail a job that succeeded, or wait out
its handshake timeout for a chief that will never answer.

``stratagem launch`` tells it: every task's environment names a file (:data:`JOB_STATE_ENV`) in which
the launcher writes ``finished`` as soon as the chief has exited 0. Where a task waits for a peer or
meets a lost one, it asks :func:`finished`; if so, :func:`leave_if_finished` prints one line saying
the job had finished without this task and ends the script with status 0 (:class:`JobFinished`, a
``SystemExit``). Under a supervisor that sets no such file nothing changes: a lost peer is an error.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "state")
    >>> finished({JOB_STATE_ENV: path})
    False
    >>> record_finished(path)
    >>> finished({JOB_STATE_ENV: path})
    True
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Mapping, TypeVar

from stratagem.core.errors import TransportTimeout

_T = TypeVar("_T")

#: The environment variable naming the file where the supervisor records the job's end.
JOB_STATE_ENV = "STRATAGEM_JOB_STATE"
#: What the file holds once the chief has ended normally.
FINISHED = "finished"
#: Seconds a task that met a lost peer gives the supervisor to record the end it may have just seen
#: (the chief's exit closes its connections at once; the supervisor notices it within a poll).
SETTLE = 0.3
#: Longest slice of a wait for a peer (:func:`wait_for_peer`) between two looks at the job's state.
WAIT_SLICE = 1.0


class JobFinished(SystemExit):
    """The job finished without this task: the script ends here, with status 0 (``SystemExit(0)``).

    ``str()`` of it says why; it was printed when it was raised."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


def finished(environ: Mapping[str, str] | None = None) -> bool:
    """True once the supervisor recorded that the chief ended normally (False when it records nothing)."""
    path = (os.environ if environ is None else environ).get(JOB_STATE_ENV)
    if not path:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(len(FINISHED)) == FINISHED
    except OSError:
        return False


def record_finished(path: str) -> None:
    """Record that the job finished (the supervisor's side): written whole, then renamed into place."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(FINISHED + "\n")
    os.replace(partial, path)


def leave_if_finished(task, what: str, *, settle: bool = True) -> None:
    """If the job has finished, say so and end the script with status 0 (raise :class:`JobFinished`).

    ``what`` is what this task met (``"lost peer /job:ps/task:0: ..."``, ``"no answer from the chief"``):
    it is named in the line, so that the reason is visible, but not as an error."""
    if not os.environ.get(JOB_STATE_ENV):
        return
    if not finished():
        if not settle:
            return
        time.sleep(SETTLE)
        if not finished():
            return
    message = (f"stratagem: {task}: the job had finished without this task (its chief ended normally "
               f"while this task was stopped, slow or starting again; it then met: {what}); exiting with status 0")
    print(message, file=sys.stderr, flush=True)
    raise JobFinished(message)


def wait_for_peer(call: Callable[[float | None], _T], timeout: float | None, *, task, what: str) -> _T:
    """``call(seconds)`` (a send or receive that may raise ``TransportTimeout``), waiting up to
    ``timeout`` in all, but in slices of :data:`WAIT_SLICE` between which a finished job ends the script
    (:func:`leave_if_finished`, naming ``what`` was awaited): a restarted worker whose chief ended
    while it was starting learns it at once instead of after the whole timeout. Outside a job whose
    supervisor records its end, a single ``call(timeout)``. ``call`` must have done nothing when it
    raises ``TransportTimeout`` (a send that could not be queued, a receive that got nothing)."""
    if not os.environ.get(JOB_STATE_ENV) or (timeout is not None and timeout <= WAIT_SLICE):
        return call(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        last = remaining is not None and remaining <= WAIT_SLICE
        try:
            return call(max(0.0, remaining) if last else WAIT_SLICE)
        except TransportTimeout as exc:
            if last:
                raise TransportTimeout(f"{exc} ({timeout:g} s in all)") from None
            leave_if_finished(task, f"no answer yet while waiting for {what}", settle=False)
