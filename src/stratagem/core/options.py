"""Options and settings every plugin shares: which keywords a plugin accepts, and the environment's say.

The plugin registry (:mod:`stratagem.plugins.manager`) and the strategies both check options here, so
a misspelt option is refused the same way whoever is asked; and the environment variables that choose
a transport or carry the cluster secret are named once.

    >>> reject_unknown_options("transport 'local'", {"fabrik": 1}, ["fabric", "timeout"])
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: transport 'local' does not accept option(s) 'fabrik' (did you mean 'fabric'?); it accepts: fabric, timeout
"""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any, Mapping

from stratagem.core.errors import ConfigurationError

#: The environment variable holding the cluster secret (``stratagem launch`` sets one per job).
SECRET_ENV = "STRATAGEM_SECRET"
#: The environment variable naming the transport a script gets when it names none
#: (``stratagem launch --transport T`` sets it; ``launch --mpi`` sets it to ``mpi``).
TRANSPORT_ENV = "STRATAGEM_TRANSPORT"
#: The environment variable giving every transport of the process its ``peer_timeout`` when the code
#: gives none (``STRATAGEM_PEER_TIMEOUT=10 stratagem launch ...`` sets it for every task of a job).
PEER_TIMEOUT_ENV = "STRATAGEM_PEER_TIMEOUT"
#: The transport a script gets when neither its code nor its environment names one.
DEFAULT_TRANSPORT = "zmq"
#: Marks a constructor option with no default in :func:`constructor_options`.
REQUIRED = inspect.Parameter.empty


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret from ``STRATAGEM_SECRET`` (``None`` when unset or empty).

    >>> secret_from_env({"STRATAGEM_SECRET": "s3cret"})
    b's3cret'
    >>> secret_from_env({}) is None
    True
    """
    value = (os.environ if environ is None else environ).get(SECRET_ENV) or None
    return value.encode() if value else None


def transport_name_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The transport ``STRATAGEM_TRANSPORT`` names, or ``None`` when it names none."""
    return (os.environ if environ is None else environ).get(TRANSPORT_ENV, "").strip() or None


def peer_timeout_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """The seconds ``STRATAGEM_PEER_TIMEOUT`` gives (``None`` when unset or empty); anything but a
    number of seconds > 0 is refused, naming the variable and the fix.

    >>> peer_timeout_from_env({"STRATAGEM_PEER_TIMEOUT": "7.5"})
    7.5
    >>> peer_timeout_from_env({}) is None
    True
    >>> peer_timeout_from_env({"STRATAGEM_PEER_TIMEOUT": "soon"})
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: STRATAGEM_PEER_TIMEOUT='soon' in the environment is not a number of seconds > 0: set it to one (e.g. 30) or unset it
    """
    value = (os.environ if environ is None else environ).get(PEER_TIMEOUT_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigurationError(f"{PEER_TIMEOUT_ENV}={value!r} in the environment is not a number of seconds > 0: "
                                 f"set it to one (e.g. 30) or unset it")
    return seconds


def declared_options(cls: type) -> dict[str, Any]:
    """The options a plugin class declares and their defaults: the ``options`` of ``cls`` and of its
    bases, a subclass's overriding its base's.

    >>> class Base: options = {"a": 1, "b": 2}
    >>> class Sub(Base): options = {"b": 3}
    >>> declared_options(Sub)
    {'a': 1, 'b': 3}
    """
    merged: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        merged.update(klass.__dict__.get("options", {}))
    return merged


def reject_unknown_options(what: str, options: Mapping[str, Any], accepted) -> None:
    """Raise ``ConfigurationError`` naming the options ``what`` does not accept and those it does."""
    unknown = sorted(set(options) - set(accepted))
    if not unknown:
        return
    message = f"{what} does not accept option(s) {', '.join(repr(o) for o in unknown)}"
    close = difflib.get_close_matches(unknown[0], list(accepted), n=1)
    if close:
        message += f" (did you mean {close[0]!r}?)"
    message += f"; it accepts: {', '.join(sorted(accepted)) or 'none'}"
    raise ConfigurationError(message)


def constructor_options(cls: type, skip: tuple = ("self", "cluster", "task")) -> dict[str, Any] | None:
    """The keyword options ``cls(...)`` accepts, with their defaults (:data:`REQUIRED` if none).

    Follows ``**kwargs`` up the class hierarchy: a subclass that forwards ``**common`` to its base
    accepts the base's options too. ``None`` means the signature cannot be read (accept anything).

    >>> from stratagem.transports.local import LocalTransport
    >>> sorted(constructor_options(LocalTransport))
    ['fabric', 'limits', 'peer_timeout', 'recorder', 'secret', 'timeout']
    """
    found: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            break
        try:
            signature = inspect.signature(init)
        except (TypeError, ValueError):
            return None
        forwards = False
        for param in signature.parameters.values():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                forwards = True
            elif param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                if param.name not in skip:
                    found.setdefault(param.name, param.default)
        if not forwards:
            break
    return found
