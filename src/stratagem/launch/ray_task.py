"""One task of a stratagem job on Ray: the body of the actor that :mod:`stratagem.launch.ray` places.

The actor holds a port on its node until the task starts (:meth:`TaskRunner.reserve`), then runs the
task as a child process exactly as ``stratagem launch`` starts one (its own process group, killed
with the actor, see :func:`stratagem.launch.supervisor.start_task`), and hands the child's output and
exit status to the driver when asked (:meth:`TaskRunner.poll`): the driver prefixes and prints the
lines and supervises the job with the launcher's own loop.

A Python function is run the same way, in a child process (``python -m stratagem.launch.ray_task
FUNCTION_FILE RESULT_FILE``), so every task gets a fresh interpreter whose environment holds its
``STRATAGEM_CONFIG``, as a script would; its return value comes back through :meth:`TaskRunner.value`.
The function file is written by the actor from what the driver sent it through Ray (cloudpickle),
never read from the network by the task itself.

This module imports no Ray at import time: it is also what the task's child process runs.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
from typing import Mapping, Sequence

from stratagem.core.cluster import TaskId
from stratagem.transport_kit.ports import format_address, reserve_ports

_READ_SIZE = 65536


class _PipeCollector:
    """Reads one pipe to its end in a thread, keeping what arrived until the driver takes it."""

    def __init__(self, pipe):
        self._pipe = pipe
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="stratagem-ray-pipe")
        self._thread.start()

    def _read(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self._pipe.fileno(), _READ_SIZE)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                with self._lock:
                    self._chunks.append(chunk)
        finally:
            self._pipe.close()
            self.ended.set()

    def take(self) -> bytes:
        with self._lock:
            data, self._chunks = b"".join(self._chunks), []
        return data


class TaskRunner:
    """The actor of one task: reserve a port, start the task, report its output and exit status."""

    def __init__(self, task: str):
        self.task = TaskId.parse(task)
        self._holder = None
        self._process = None
        self._out: _PipeCollector | None = None
        self._err: _PipeCollector | None = None
        self._result_file: str | None = None
        self._workdir: str | None = None
        self._group_killed = False

    def reserve(self, host: str | None = None) -> str:
        """Hold a free port on this node (``host``, default the node's Ray address) until :meth:`start`;
        return the task's address, ``ip:port``."""
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        ip, (self._holder,) = reserve_ports(host, 1)
        return format_address(ip, self._holder.getsockname()[1])

    def node(self) -> str:
        """The Ray node this actor runs on (its node id)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def start(self, command: Sequence[str], env: Mapping[str, str | None], *, cwd: str | None = None,
              function: bytes | None = None, script: bool = False) -> int:
        """Start the task: ``command`` (``script``: a script and its arguments, run with this node's
        Python; ``function``: a cloudpickled callable run by this module instead) in this actor's
        environment updated by ``env`` (a value of None removes a variable), in ``cwd`` if this node
        has that folder. Returns the child's pid."""
        from stratagem.launch.supervisor import start_task

        child_env = dict(os.environ)
        for key, value in env.items():
            if value is None:
                child_env.pop(key, None)
            else:
                child_env[key] = value
        if function is not None:
            self._workdir = tempfile.mkdtemp(prefix="stratagem-ray-")
            function_file = os.path.join(self._workdir, "function.pkl")
            self._result_file = os.path.join(self._workdir, "result.pkl")
            with open(function_file, "wb") as f:
                f.write(function)
            command = [sys.executable, "-m", __name__, function_file, self._result_file]
        elif script:
            command = [sys.executable, *command]
        if cwd is not None and not os.path.isdir(cwd):
            cwd = None  # the driver's folder is not on this node: run where the actor runs
        if self._holder is not None:
            self._holder.close()  # free the port as late as possible: see transport_kit.ports
            self._holder = None
        self._process = start_task(self.task, list(command), child_env, cwd=cwd)
        self._out = _PipeCollector(self._process.stdout)
        self._err = _PipeCollector(self._process.stderr)
        return self._process.pid

    def poll(self) -> tuple[bytes, bytes, int | None, bool]:
        """``(stdout, stderr, returncode, ended)``: the output since the last call, the exit status
        (None while running; ``-N``: killed by signal N), and whether both pipes have ended."""
        code = self._process.poll()
        if code is not None and not self._group_killed:
            # As the launcher does: what the task left in its process group goes with it.
            self._group_killed = True
            _signal_group(self._process.pid, signal.SIGKILL)
        ended = code is not None and self._out.ended.is_set() and self._err.ended.is_set()
        return self._out.take(), self._err.take(), code, ended

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the task's process group if the task still runs; say whether it did."""
        if self._process is None or self._process.poll() is not None:
            return False
        _signal_group(self._process.pid, sig)
        return True

    def value(self) -> bytes | None:
        """A function task's pickled return value, once it has exited 0 (None for a command)."""
        if self._result_file is None or not os.path.exists(self._result_file):
            return None
        with open(self._result_file, "rb") as f:
            return f.read()

    def close(self) -> None:
        """Kill what is left of the task and remove the function's files."""
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        if self._process is not None:
            _signal_group(self._process.pid, signal.SIGKILL)
            self._process.wait()
        if self._workdir is not None:
            import shutil

            shutil.rmtree(self._workdir, ignore_errors=True)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_function(function_file: str, result_file: str) -> int:
    """The child process of a function task: load the function its actor wrote, call it, write its
    return value next to it."""
    import pickle

    import cloudpickle  # noqa: F401  (the file was written with it; unpickling needs its helpers)

    with open(function_file, "rb") as f:
        function = pickle.load(f)  # written by our own actor from what the driver sent through Ray
    value = function()
    with open(result_file + ".part", "wb") as f:
        cloudpickle.dump(value, f)
    os.replace(result_file + ".part", result_file)
    return 0


if __name__ == "__main__":
    sys.exit(_run_function(sys.argv[1], sys.argv[2]))
