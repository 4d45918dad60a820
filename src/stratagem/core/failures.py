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

#: The variable naming the file a task writes its failure report to (set by ``stratagem launch``).
FAILURE_FILE_ENV = "STRATAGEM_FAILURE_FILE"
#: Replaced by the MPI rank in that file's path (see :func:`report_failure`).
RANK_FIELD = "{rank}"
#: The variables an MPI launcher gives each rank its rank in (Open MPI's, PMIx's, PMI's).
MPI_RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


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
    path = os.environ.get(FAILURE_FILE_ENV)
    if not path:
        return
    if RANK_FIELD in path:
        rank = next((os.environ[v] for v in MPI_RANK_ENV if os.environ.get(v, "").isdigit()), None)
        if rank is None:
            return
        path = path.replace(RANK_FIELD, rank)
    record = {"time": time.time(), "pid": os.getpid(), "error": error[:2000],
              "culprit": None if culprit is None else str(culprit)}
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


def read_report(path: str) -> dict | None:
    """A report written by :func:`report_failure`, or None if there is none (or it is not one)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("time"), (int, float)):
        return None
    culprit = record.get("culprit")
    return {"time": float(record["time"]), "pid": record.get("pid"), "error": str(record.get("error", "")),
            "culprit": culprit if isinstance(culprit, str) else None}
