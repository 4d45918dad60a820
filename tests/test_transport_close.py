"""The base Transport's close/abort template: each transport implements only ``_shutdown(graceful)``, and
the base runs it once, whichever of close() and abort() comes first and from however many threads. The
transport contract (stratagem.testing.contract) checks the same on every real transport; here a minimal
subclass counts the calls, which a real transport cannot show."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stratagem.core.transport import Transport
from stratagem.testing.world import local_cluster

SRC = Path(__file__).resolve().parents[1] / "src"


class Counting(Transport):
    """A transport whose only job is to record how it was ended (slowly, so that calls overlap)."""

    name = "counting"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shutdowns: list[bool] = []
        self.inside = threading.Event()
        self.release = threading.Event()

    def start(self) -> None:
        pass

    def send(self, dst, tag, msg, timeout=None) -> None:
        raise NotImplementedError

    def recv(self, src, tag, timeout=None):
        raise NotImplementedError

    def _shutdown(self, graceful: bool) -> None:
        self.shutdowns.append(graceful)
        self.inside.set()
        self.release.wait(10)


def make() -> Counting:
    transport = Counting(local_cluster(1), "worker:0")
    transport.release.set()
    return transport


def test_a_second_close_does_nothing():
    t = make()
    t.close()
    t.close()
    assert t.shutdowns == [True]


def test_close_after_abort_does_nothing_and_abort_after_close_neither():
    aborted = make()
    aborted.abort()
    aborted.close()
    assert aborted.shutdowns == [False]  # no goodbye after a crash-like end
    closed = make()
    closed.close()
    closed.abort()
    assert closed.shutdowns == [True]


def test_the_exit_hook_closes_once_too():
    t = make()
    t.close()
    t.end_with_script(None)
    assert t.shutdowns == [True]


def test_calls_from_many_threads_end_it_once_and_none_waits_for_the_first():
    t = Counting(local_cluster(1), "worker:0")
    first = threading.Thread(target=t.close)
    first.start()
    assert t.inside.wait(10)             # the first call is inside _shutdown...
    others = [threading.Thread(target=t.abort if i % 2 else t.close) for i in range(8)]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join(10)
    assert not any(thread.is_alive() for thread in others)  # ...and the others returned meanwhile
    t.release.set()
    first.join(10)
    assert t.shutdowns == [True]


# -- the at-exit method: end_with_script(error) ------------------------------------------------------

_AT_EXIT_SCRIPT = """
import sys
from stratagem.core.transport import Transport
from stratagem.testing.world import local_cluster

class Ending(Transport):
    name = "ending"
    def start(self): pass
    def send(self, dst, tag, msg, timeout=None): raise NotImplementedError
    def recv(self, src, tag, timeout=None): raise NotImplementedError
    def _shutdown(self, graceful): print("shutdown", graceful, flush=True)
    def end_with_script(self, error):
        print("ended by", error, flush=True)
        super().end_with_script(error)

transport = Ending(local_cluster(1), "worker:0")
if sys.argv[1] == "fail":
    raise RuntimeError("boom")
"""


def _run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("ending, said", [("normal", "ended by None"), ("fail", "ended by RuntimeError: boom")])
def test_a_script_that_falls_off_the_end_ends_its_transport_through_end_with_script(ending, said):
    done = _run_child(_AT_EXIT_SCRIPT, ending)
    assert done.stdout.splitlines() == [said, "shutdown True"], done.stdout + done.stderr
    assert done.returncode == (0 if ending == "normal" else 1), done.stderr


def test_a_transport_that_overrides_the_old_name_is_refused_with_the_fix():
    """``_end_at_exit`` was the method's name: an override of it would never run now, so such a
    transport is refused when made, not left to end the wrong way at exit."""
    code = _AT_EXIT_SCRIPT.replace("def end_with_script(self, error):", "def _end_at_exit(self, error):")
    done = _run_child(code, "normal")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == ("TypeError: Ending defines _end_at_exit(error), the old name of the at-exit method: rename it "
                    "end_with_script(error) (stratagem.core.lifecycle)"), done.stderr
