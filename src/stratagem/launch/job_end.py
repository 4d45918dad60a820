"""The launcher's record of a job's end, which its tasks read (:mod:`stratagem.core.job_state`).

A job is finished once its chief has exited 0. :class:`JobEndRecord` makes a private file for one
launch, names it in every task's environment (``STRATAGEM_JOB_STATE``) and, from a watching thread,
writes ``finished`` into it the moment the chief's process is seen to have exited 0. A task that was
stopped or slow when the others ended, or a restarted worker still in its handshake, then learns that
the job finished without it and exits 0 instead of failing the job (or waiting out a timeout).

It reads only the exit status the supervisor's own polling stores in the chief's ``Popen``
(``returncode``), so it never reaps a process the supervisor watches.
"""

from __future__ import annotations

import threading

from stratagem.core.job_state import JOB_STATE_ENV, record_finished
from stratagem.launch.scratch import ScratchDir

#: Seconds between two looks at the chief's exit status.
WATCH_INTERVAL = 0.05


class JobEndRecord:
    """One launch's job-state file and the thread that records the chief's normal end (see the module doc)."""

    def __init__(self) -> None:
        self._dir = ScratchDir("job")
        self.path = f"{self._dir.path}/state"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        """What every task's environment gets."""
        return {JOB_STATE_ENV: self.path}

    def watch(self, chief_process) -> None:
        """Record ``finished`` once ``chief_process`` (a ``Popen`` the supervisor polls) has exited 0."""
        def run() -> None:
            while not self._stop.wait(WATCH_INTERVAL):
                code = chief_process.returncode
                if code is not None:
                    if code == 0:
                        record_finished(self.path)
                    return

        self._thread = threading.Thread(target=run, name="stratagem-job-end", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching and remove the file (every task has ended by then)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._dir.close()
