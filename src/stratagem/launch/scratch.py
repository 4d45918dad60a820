"""Private directories of one launch (the job's state file, the tasks' failure reports) that a
launcher killed outright (SIGKILL, no ``finally``) does not leave behind for good.

:class:`ScratchDir` makes a fresh ``stratagem-<kind>-*`` directory under the system's temporary
directory and holds an exclusive ``flock`` on its ``.owner`` file for as long as the launcher lives:
the kernel drops the lock when the process ends, however it ends. Each new :class:`ScratchDir`
first removes the directories of this user whose lock it can take (their launcher is gone). A
directory whose launcher is alive is never touched, even one in another PID namespace: the lock,
not a PID, says who is alive. ``close()`` removes the directory at once.

    >>> import os
    >>> first = ScratchDir("doc")
    >>> os.path.isdir(first.path), os.path.basename(first.path).startswith("stratagem-doc-")
    (True, True)
    >>> second = ScratchDir("doc")          # the first one's owner is alive: kept
    >>> os.path.isdir(first.path)
    True
    >>> first.close(); second.close()
    >>> os.path.exists(first.path), os.path.exists(second.path)
    (False, False)
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile

#: The file in each scratch directory whose lock its launcher holds.
OWNER_FILE = ".owner"


def _take_lock(path: str) -> int | None:
    """An fd holding ``path``'s exclusive lock, or None if another process holds it (or it is missing)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_orphans(root: str | None = None) -> list[str]:
    """Remove the scratch directories under ``root`` (default: the temporary directory) that are this
    user's and whose launcher has ended; return them."""
    removed = []
    for directory in glob.glob(os.path.join(root or tempfile.gettempdir(), "stratagem-*-*")):
        owner = os.path.join(directory, OWNER_FILE)
        try:
            if os.stat(directory).st_uid != os.getuid():
                continue
        except OSError:
            continue
        fd = _take_lock(owner)
        if fd is None:
            continue
        try:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
        finally:
            os.close(fd)
    return removed


class ScratchDir:
    """A ``stratagem-<kind>-*`` directory owned by this process until ``close()`` (see the module doc)."""

    def __init__(self, kind: str, *, root: str | None = None):
        sweep_orphans(root)
        self.path = tempfile.mkdtemp(prefix=f"stratagem-{kind}-", dir=root)
        self._lock: int | None = os.open(os.path.join(self.path, OWNER_FILE), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    def close(self) -> None:
        """Remove the directory and let go of it."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
