"""Errors the user caused, printed as one line per task instead of a traceback wall.

A configuration or usage mistake (``ConfigurationError``, ``IncompatibleError``, ``PluginError``: a
typo'd option, ``mode="bounded"`` without ``staleness``, an unknown transport) that ends a script
uncaught is printed as one line on stderr, under ``stratagem launch`` prefixed with its task::

    [worker:0] stratagem: ConfigurationError: strategy 'mirrored' does not accept option(s) 'buket_bytes' (did you mean 'bucket_bytes'?); ... (train.py:4; STRATAGEM_TRACEBACK=1 shows the traceback)

The message already says what is wrong and how to fix it; the place is the line of the user's code
that made the call. ``STRATAGEM_TRACEBACK=1`` prints Python's usual traceback instead. Only the
printing changes: the script still ends by that exception (exit status 1), and what it left open
still ends as after an uncaught exception (:mod:`stratagem.core.lifecycle`), so its peers learn at
once that it failed. Every other exception is printed as Python prints it.

The hook is installed once, when ``stratagem`` is imported; it wraps the ``sys.excepthook`` it finds.
"""

from __future__ import annotations

import os
import sys
import traceback

from stratagem.core.errors import ConfigurationError, IncompatibleError, PluginError

#: Set to 1 to print the full traceback of a user error.
TRACEBACK_ENV = "STRATAGEM_TRACEBACK"
#: The errors a user's configuration or usage caused.
USER_ERRORS = (ConfigurationError, IncompatibleError, PluginError)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, USER_ERRORS)


def one_line(exc: BaseException, tb=None) -> str:
    """``stratagem: Kind: message (where; how to see the traceback)`` on one line.

    >>> one_line(ConfigurationError("unknown option 'x'"))
    "stratagem: ConfigurationError: unknown option 'x' (STRATAGEM_TRACEBACK=1 shows the traceback)"
    """
    message = " ".join(str(exc).split())
    where = _user_frame(tb)
    hint = f"{TRACEBACK_ENV}=1 shows the traceback"
    return f"stratagem: {type(exc).__name__}: {message} ({where + '; ' if where else ''}{hint})"


def _user_frame(tb) -> str | None:
    """``file:line`` of the last frame outside stratagem in ``tb`` (the user's call), if any."""
    found = None
    for frame, line in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        if not os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep) and not filename.startswith("<frozen"):
            found = f"{os.path.basename(filename)}:{line}"
    return found


def install() -> None:
    """Print uncaught user errors as one line (idempotent)."""
    if not isinstance(sys.excepthook, OneLineHook):
        sys.excepthook = OneLineHook(sys.excepthook)


class OneLineHook:
    """The ``sys.excepthook`` that prints a user error as one line (unless ``STRATAGEM_TRACEBACK=1``)
    and hands every other exception to ``previous``, the hook it replaced."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, exc_type, exc, tb) -> None:
        if exc is not None and is_user_error(exc) and os.environ.get(TRACEBACK_ENV, "") in ("", "0"):
            try:
                print(one_line(exc, tb), file=sys.stderr, flush=True)
                return
            except Exception:  # noqa: BLE001 - fall back to Python's own report
                pass
        self.previous(exc_type, exc, tb)
