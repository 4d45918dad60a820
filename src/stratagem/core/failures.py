"""How a failing task tells its launcher when it failed and which task it blames.

When one task of a job fails, its peers fail after it, each naming it (``PeerLostError: lost peer
/job:worker/task:1``), and a stopped (``SIGSTOP``) task never fails at all: its peers fail for it
once the peer timeout has passed. The launcher sees processes exit, in whatever order they manage to;
the order of exits does not say which task failed first. So a task that fails says so: the time, its
error and the task its error names (its *culprit*), in a small JSON file at the path the launcher gave
it in ``STRATAGEM_FAILURE_FILE``. The launcher (:mod:`stratagem.launch.failures`) follows the culprits
from the earliest failure to the task that failed first, and names that one.

The report is written once per process (the first failure is the one that counts), by the exception
hook of :mod:`stratagem.core.lifecycle` for an uncaught exception and by :func:`note_failure` there
for a failure that ends the script with ``SystemExit``. Without the variable nothing is written.

A report alone cannot tell a task cut off from the network from a peer it lost: the cut-off task hears
nobody and fails naming a peer that is alive, and that peer may go on without it (a parameter-server
coordinator reruns a lost worker's closures) and report nothing. So every task also notes each peer it
loses, failing or not (:func:`note_lost`, called by the transports' mailboxes: one line per loss in
the file beside the report, ``<report>.lost``). The cut-off task lost every peer it had and they all
lost it; a stopped task was lost by every peer and lost nobody: the launcher reads the losses
(:func:`read_losses`) to name the one task that every loss involves.

    >>> from stratagem.core.errors import PeerLostError
    >>> culprit_of(PeerLostError("/job:worker/task:1", "connection lost"))
    '/job:worker/task:1'
    >>> culprit_of(RuntimeError("my own bug")) is None
    True
"""

from __future__ import annotations

import json
import os
import time

from stratagem.core.errors import PeerLostError
from stratagem.core.options import PEER_TIMEOUT_ENV

#: The variable naming the file a task writes its failure report to (set by ``stratagem launch``).
FAILURE_FILE_ENV = "STRATAGEM_FAILURE_FILE"
#: Replaced by the MPI rank in that file's path (see :func:`report_failure`).
RANK_FIELD = "{rank}"
#: The variables an MPI launcher gives each rank its rank in (Open MPI's, PMIx's, PMI's).
MPI_RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
#: Added to the report's path for the file of the peers the task lost (:func:`note_lost`).
LOSSES_SUFFIX = ".lost"
#: What every transport's reason says of a peer that said goodbye (it closed its transport: it ended,
#: cleanly or after failing itself). No loss of a peer a fault cut off or stopped, so not noted.
SAID_GOODBYE = "closed its transport"


def said_goodbye(task) -> str:
    """The reason every transport gives for a peer ``task`` that said goodbye (closed its transport):
    built here only, so that :func:`note_lost` knows it whatever the transport."""
    return f"{task} {SAID_GOODBYE}"


def culprit_of(error: BaseException | None) -> str | None:
    """The task ``error`` blames for itself, as text (``/job:worker/task:1``), or None if it names none.

    A ``PeerLostError`` blames its ``task``; any error may carry a ``culprit`` attribute (an abort
    notice says which rank failed the collective). The causes of ``error`` are looked at too, so that
    an error raised while handling a lost peer still names it.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        culprit = getattr(error, "culprit", None)
        if culprit is None and isinstance(error, PeerLostError):
            culprit = error.task
        if culprit is not None:
            return str(culprit)
        error = error.__cause__ or error.__context__
    return None


def report_failure(error: str, culprit: str | None = None) -> None:
    """Write this task's failure report, unless one is there already (the first failure is the one
    that counts); nothing without ``STRATAGEM_FAILURE_FILE``. A ``{rank}`` in that path is this
    process's MPI rank (``stratagem launch --mpi`` gives every rank the same environment).

    Never raises: a report that cannot be written leaves the launcher with the order of exits."""
    path = _report_path()
    if path is None:
        return
    record = {"time": time.time(), "pid": os.getpid(), "error": error[:2000],
              "culprit": None if culprit is None else str(culprit), "peer_timeout": _peer_timeout()}
    scratch = f"{path}.{os.getpid()}.tmp"
    try:
        with open(scratch, "w") as f:
            json.dump(record, f)
        os.link(scratch, path)   # whole, and only if no report is there yet
    except OSError:
        pass
    finally:
        try:
            os.unlink(scratch)
        except OSError:
            pass


def note_lost(peer, reason: str = "") -> None:
    """Note that this task lost ``peer`` (its transport declared it gone), for the launcher: a line
    appended to ``<report>.lost``, the report's path with ``.lost`` added; nothing without
    ``STRATAGEM_FAILURE_FILE``. Called for every loss, whether this task then fails or goes on; a peer
    that said goodbye (``reason`` has :data:`SAID_GOODBYE`) is not noted: it ended on its own.

    Never raises: a note that cannot be written leaves the launcher with the reports alone."""
    path = _report_path()
    if path is None or SAID_GOODBYE in reason:
        return
    line = json.dumps({"time": time.time(), "peer": str(peer), "reason": str(reason)[:300]}) + "\n"
    try:
        fd = os.open(path + LOSSES_SUFFIX, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())   # one write of a short line: whole, whoever else appends
        finally:
            os.close(fd)
    except OSError:
        pass


def read_losses(path: str) -> list[tuple[float, str]]:
    """The losses noted beside the report at ``path`` (:func:`note_lost`): ``(time, peer)`` each, in
    the order noted; none when there is no such file. A line that is not a note is skipped."""
    try:
        with open(path + LOSSES_SUFFIX) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    losses = []
    for line in lines:
        try:
            note = json.loads(line)
        except ValueError:
            continue
        if isinstance(note, dict) and isinstance(note.get("time"), (int, float)) and isinstance(note.get("peer"), str):
            losses.append((float(note["time"]), note["peer"]))
    return losses


def _report_path() -> str | None:
    """This process's report path (``STRATAGEM_FAILURE_FILE``, its ``{rank}`` replaced), or None."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if not path:
        return None
    if RANK_FIELD in path:
        rank = next((os.environ[v] for v in MPI_RANK_ENV if os.environ.get(v, "").isdigit()), None)
        if rank is None:
            return None
        path = path.replace(RANK_FIELD, rank)
    return path


def _peer_timeout() -> float | None:
    """The peer timeout ``STRATAGEM_PEER_TIMEOUT`` gives this task, if it is a number > 0 (the launcher
    sizes its wait for the other tasks' losses by it; a bad value is the transport's to refuse)."""
    try:
        seconds = float(os.environ.get(PEER_TIMEOUT_ENV, ""))
    except ValueError:
        return None
    return seconds if 0 < seconds < float("inf") else None


def read_report(path: str) -> dict | None:
    """A report written by :func:`report_failure`, or None if there is none (or it is not one)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("time"), (int, float)):
        return None
    culprit, peer_timeout = record.get("culprit"), record.get("peer_timeout")
    return {"time": float(record["time"]), "pid": record.get("pid"), "error": str(record.get("error", "")),
            "culprit": culprit if isinstance(culprit, str) else None,
            "peer_timeout": float(peer_timeout) if isinstance(peer_timeout, (int, float)) else None}
