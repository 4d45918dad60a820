"""This process's timeline recorder: the one place that reads ``STRATAGEM_TIMELINE``.

:func:`process_recorder` makes it on first use (a :class:`~stratagem.core.timeline.Recorder` that
measures its clock over the first transport attached and is written when the interpreter ends or on
SIGTERM), or returns :data:`~stratagem.core.timeline.OFF` when the variable is not set. The transport
factory (``stratagem.plugins``: ``stratagem.strategy()``, ``open_communicator``, ``stratagem.transport``)
hands it to every transport it makes, as it hands the cluster secret from the environment; from
there it reaches everything that records (see :mod:`stratagem.core.timeline`). A transport
constructed by its class records to the ``recorder=`` it is given, else nowhere.

    >>> import os
    >>> from stratagem.core.timeline import OFF
    >>> "STRATAGEM_TIMELINE" in os.environ or process_recorder() is OFF
    True
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading

from stratagem.core.lifecycle import end_at_exit
from stratagem.core.timeline import (DEFAULT_MAX_EVENTS, ENV, MAX_EVENTS_ENV, OFF, NullRecorder, Recorder)
from stratagem.core.timeline_clock import synchronise


@functools.cache
def process_recorder() -> Recorder | NullRecorder:
    """This process's recorder (see the module doc). Made once: a process writes one timeline."""
    path = os.environ.get(ENV)
    if not path:
        return OFF
    try:
        max_events = int(os.environ.get(MAX_EVENTS_ENV, DEFAULT_MAX_EVENTS))
    except ValueError:
        max_events = DEFAULT_MAX_EVENTS
    recorder = Recorder(path, max_events=max(0, max_events), clock_exchange=synchronise)
    # Registered before the transport being made and any strategy: written after they ended.
    end_at_exit(recorder)
    _write_on_sigterm(recorder)
    return recorder


def _write_on_sigterm(recorder: Recorder) -> None:
    """The launcher stops tasks with SIGTERM: write the file, then die of the signal as before."""
    def on_sigterm(signum, frame) -> None:
        recorder.flush_now("terminated by SIGTERM")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, on_sigterm)
