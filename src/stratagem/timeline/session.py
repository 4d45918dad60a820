"""``stratagem launch --timeline OUT``: where the tasks of one job write their timelines, and the merge.

The launcher gives every task ``STRATAGEM_TIMELINE=<folder>/{task}.json``, the folder a fresh hidden
one beside ``OUT``; when the job has ended (however it ended: a failed job's timeline is the one
worth reading), the files found there are merged into ``OUT`` and the folder is removed. A task
that left no file (killed by SIGKILL, or it never started a strategy or communicator) is named.

The same from Python, around :func:`stratagem.launch.launcher.launch`::

    session = TimelineSession("trace.json")
    result = launch(["python", "train.py"], workers=2, env=session.env)
    session.finish(result.cluster.tasks())        # writes trace.json; prints where it went
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from typing import Iterable, TextIO

from stratagem.core.errors import ConfigurationError, TimelineError
from stratagem.core.timeline import ENV, task_slug


class TimelineSession:
    """The timeline of one launched job, to be merged into ``out`` (see the module doc).

    Raises ``ConfigurationError`` if ``out`` cannot be written (before anything starts).
    """

    def __init__(self, out: str):
        out = os.path.abspath(out)
        parent = os.path.dirname(out)
        if os.path.isdir(out):
            raise ConfigurationError(f"--timeline {out}: is a directory; name the merged trace's file (trace.json)")
        if not os.path.isdir(parent):
            raise ConfigurationError(f"--timeline {out}: the directory {parent} does not exist; create it first")
        if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
            raise ConfigurationError(f"--timeline {out}: cannot write there (permission denied); name a file "
                                     f"in a writable directory")
        self.out = out
        try:
            self.folder = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tasks", dir=parent)
        except OSError as exc:
            raise ConfigurationError(f"--timeline {out}: cannot create the tasks' folder in {parent}: "
                                     f"{exc.strerror or exc}") from None

    @property
    def env(self) -> dict[str, str]:
        """The variables every task gets."""
        return {ENV: os.path.join(self.folder, "{task}.json")}

    def finish(self, tasks: Iterable = (), stream: TextIO | None = None) -> dict | None:
        """Merge what the tasks wrote into ``out`` and report it on ``stream`` (default stderr);
        returns the merged document, or ``None`` if there was nothing to merge or it failed (the
        tasks' files are then kept, and the message says where)."""
        from stratagem.timeline.merge import merge_files

        stream = stream if stream is not None else sys.stderr
        files = sorted(glob.glob(os.path.join(self.folder, "*.json")))
        found = {os.path.basename(path)[:-len(".json")] for path in files}
        missing = [str(task) for task in tasks if task_slug(task) not in found]
        if not files:
            shutil.rmtree(self.folder, ignore_errors=True)
            stream.write(f"stratagem launch: no task wrote a timeline (a task records one once it starts a "
                         f"strategy or a communicator); {self.out} not written\n")
            return None
        try:
            merged = merge_files(self.out, files)
        except TimelineError as exc:
            stream.write(f"stratagem launch: timeline not merged: {exc}; the tasks' files are kept in "
                         f"{self.folder}\n")
            return None
        shutil.rmtree(self.folder, ignore_errors=True)
        note = f"; no timeline from {', '.join(missing)} (killed before it could write?)" if missing else ""
        stream.write(f"stratagem launch: timeline of {len(files)} task(s) in {self.out} (open it in "
                     f"https://ui.perfetto.dev, or: stratagem timeline summary {self.out}){note}\n")
        return merged
