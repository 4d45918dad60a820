"""Ending what a script left open when its interpreter ends.

Users write the plain script: make a strategy or a communicator, train, and fall off the end, with
no ``close()``, no ``shutdown()`` and no ``with``. Whatever that leaves open must then end the way the
script ended:

- **normally** (the last line ran, or ``sys.exit``): every strategy shuts down as if the script had
  called ``shutdown()`` (a chief tells the parameter servers that training is over, an ``in_graph``
  client releases its replicas), then every transport closes, saying goodbye to its peers;
- **by an uncaught exception** (``KeyboardInterrupt`` included): strategies leave with that error
  (the parameter servers report it, naming this task, and fail the job) and transports close, so
  that peers raise ``PeerLostError`` naming this task at once instead of waiting on it (a transport
  closes rather than aborts so that what it still has queued, such as the abort notices of a failed
  collective, reaches the peers).

Why not plain :mod:`atexit`: the interpreter joins the worker threads of ``concurrent.futures``
executors (grpc's server runs on one) *before* it runs atexit callbacks, and a handler thread that
serves a peer's stream never returns while the transport is open, so the process would wait forever.
The callback is therefore registered with :func:`threading._register_atexit`, which runs before those
threads are joined (the interpreter calls such callbacks newest first, and this module imports
``concurrent.futures.thread`` before registering, so ours runs before its join); plain atexit is the
fallback, and running twice is harmless.

Objects register with :func:`end_at_exit` and implement ``end_with_script(error)``, where ``error`` is
``None`` after a normal end, else a one-line description of the uncaught exception (the method was
called ``_end_at_exit`` before: an object whose class still overrides that name is refused at
registration, naming the fix, rather than left to end the wrong way at exit). They are ended
newest first (a strategy before the transport it made), through weak references: an object that was
already closed and dropped costs nothing. This registry is process-wide by nature (there is one
interpreter exit), like the plugin registry.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - imported first so its exit join runs after ours
import logging
import sys
import threading
import weakref

from stratagem.core import failures

log = logging.getLogger(__name__)


class _Registry:
    """The objects to end at exit, in registration order, and how the script ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: list[weakref.ref] = []
        self.installed = False
        self.ended = False
        self.error: str | None = None

    def add(self, obj) -> None:
        with self.lock:
            self.objects = [ref for ref in self.objects if ref() is not None]
            self.objects.append(weakref.ref(obj))
            if not self.installed:
                self.installed = True
                _install(self)

    def end_all(self) -> None:
        with self.lock:
            if self.ended:
                return
            self.ended = True
            objects = [ref() for ref in reversed(self.objects)]
            self.objects = []
        for obj in objects:
            if obj is None:
                continue
            try:
                obj.end_with_script(self.error)
            except BaseException as exc:  # noqa: BLE001 - ending the rest matters more
                log.warning("ending %r at interpreter exit failed: %s: %s", obj, type(exc).__name__, exc)


_REGISTRY = _Registry()

#: What ``end_with_script`` was called before (refused, see :func:`end_at_exit`).
OLD_NAME = "_end_at_exit"


def end_at_exit(obj) -> None:
    """End ``obj`` when the interpreter ends: ``obj.end_with_script(error)`` is called with ``None``
    after a normal end, else a description of the uncaught exception that ended the script. An object
    without that method is refused (``TypeError``) now, not at exit.

    >>> class Resource:
    ...     def end_with_script(self, error):
    ...         print("ended", "normally" if error is None else f"by {error}")
    >>> end_at_exit(Resource())   # at exit this would print 'ended normally'
    >>> class Old:
    ...     def _end_at_exit(self, error):
    ...         pass
    >>> end_at_exit(Old())
    Traceback (most recent call last):
    ...
    TypeError: Old defines _end_at_exit(error), the old name of the at-exit method: rename it end_with_script(error) ...
    """
    _check_ends(type(obj))
    _REGISTRY.add(obj)


def _check_ends(cls: type) -> None:
    """Refuse a class whose instances could not be ended at exit: no ``end_with_script``, or a
    subclass that overrides the old name ``_end_at_exit`` below the class that defines it (its
    override would never run)."""
    for klass in cls.__mro__:
        if "end_with_script" in vars(klass):
            return
        if OLD_NAME in vars(klass):
            raise TypeError(f"{klass.__qualname__} defines {OLD_NAME}(error), the old name of the at-exit method: "
                            f"rename it end_with_script(error) (stratagem.core.lifecycle)")
    raise TypeError(f"{cls.__qualname__} cannot be ended at exit: it has no end_with_script(error) method "
                    f"(stratagem.core.lifecycle)")


def note_failure(error: str, culprit=None) -> None:
    """Say that the script is ending because of ``error`` although it ends by ``SystemExit`` (which
    no exception hook sees): what is still open then ends as after an uncaught exception. ``culprit``:
    the task the failure blames, if any (told to the launcher: :mod:`stratagem.core.failures`).

    Used where Stratagem itself ends a process with a message and a non-zero status (an ``in_graph``
    replica whose client is gone)."""
    if _REGISTRY.error is None:
        _REGISTRY.error = error
    failures.report_failure(error, None if culprit is None else str(culprit))


def _install(registry: _Registry) -> None:
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        # Called for an uncaught exception of the main thread (never for SystemExit), before the
        # interpreter starts ending: remember it so that transports abort instead of closing.
        if registry.error is None:
            registry.error = f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__
        # Before anything else, so that the time is when the script failed: the launcher compares it
        # with the other tasks' to find the task that failed first.
        failures.report_failure(f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__,
                                failures.culprit_of(exc))
        previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(registry.end_all)
        except RuntimeError:  # the interpreter is already ending: atexit still runs
            pass
    atexit.register(registry.end_all)
