"""Every error Stratagem raises on purpose, in one place.

Each message names the problem and how to fix it; the classes let callers tell the failure kinds
apart (a lost peer is not a bad configuration).
"""

from __future__ import annotations


class StratagemError(Exception):
    """Base class of every error Stratagem raises on purpose."""


class ConfigurationError(StratagemError, ValueError):
    """The cluster, task, options or environment are wrong; the message says what and how to fix it."""


class PluginError(StratagemError, LookupError):
    """A strategy or transport name is unknown, or the plugin cannot be used on this machine."""


class IncompatibleError(StratagemError):
    """A strategy cannot run over the chosen transport (or another combination that cannot work)."""


class FunctionNotFound(ConfigurationError):
    """A task cannot find, or refuses, the function a peer named (see :mod:`stratagem.strategies.remote_calls.functions`)."""


class ProtocolError(StratagemError):
    """A frame is malformed, oversized, of another protocol version, or fails authentication."""


class AuthenticationError(ProtocolError):
    """A peer failed the cluster-secret challenge, or the secrets differ."""


class CommunicationError(StratagemError):
    """Base class of failures to move data between tasks."""


class TransportTimeout(CommunicationError, TimeoutError):
    """A blocking call did not complete within its timeout."""


class TransportClosed(CommunicationError):
    """The transport was closed while a call was waiting on it."""


class PeerLostError(CommunicationError):
    """A peer task died or became unreachable; ``task`` names it."""

    def __init__(self, task, detail: str = ""):
        self.task = task
        message = f"lost peer {task}"
        if detail:
            message += f": {detail}"
        super().__init__(message)

    def __reduce__(self):  # keep the error picklable for multiprocessing-based callers
        return (type(self), (self.task, ""))


class CollectiveMismatchError(CommunicationError):
    """Ranks called different collectives (or with different dtypes/shapes) at the same step."""


class TimelineError(StratagemError, ValueError):
    """A timeline file (``STRATAGEM_TIMELINE``, ``stratagem timeline ...``) cannot be written, read or
    understood; the message names the file and what to do."""


class WorldChangedError(CommunicationError):
    """The members of an elastic world changed in the middle of a step (``on_failure="shrink"``).

    ``lost`` names the tasks that were lost (empty when a restarted worker is joining). Inside
    ``strategy.elastic(fn)`` it is handled for you: every member rolls back to the last commit, the
    world is re-formed and ``fn`` runs again. Raised outside of it, the message says so.
    """

    def __init__(self, message: str, lost=()):
        self.lost = tuple(lost)
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.lost))


class JobFailedError(StratagemError):
    """A task that serves others (an ``in_graph`` replica, a ``parameter_server`` worker) stops because
    the job failed elsewhere: its client or coordinator said so before it left. ``task`` names the task
    that failed (None when the client or coordinator could not tell which)."""

    def __init__(self, task, message: str):
        self.task = task
        if task is not None:
            self.culprit = task      # what the launcher follows to name the task that failed first
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.task, str(self)))
