"""What every way of launching a job shares before a task starts: its options checked, its secret,
its transport, and each task's environment (``stratagem launch``, ``--mpi``, ``--ray``, ``k8s``).

    >>> from stratagem.core.cluster import ClusterSpec, TaskId
    >>> cluster = ClusterSpec({"worker": ["127.0.0.1:2222"]})
    >>> env = task_env({}, cluster, TaskId("worker", 0), "s3cret", "grpc")
    >>> env["STRATAGEM_CONFIG"], env["STRATAGEM_TRANSPORT"]
    ('{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}', 'grpc')
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Mapping, Sequence

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError, PluginError

#: Seconds between SIGTERM and SIGKILL when the launcher stops tasks.
DEFAULT_GRACE = 5.0
#: Seconds ps tasks may keep serving after every worker has finished, before they are stopped.
DEFAULT_PS_GRACE = 30.0


def job_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``env`` applied (a value of None removes a variable)."""
    merged = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def check_options(command: Sequence[str], workers: int, ps: int, chief: bool, secret: str | None,
                  timeout: float | None, grace: float, ps_grace: float, path: str | None,
                  check_program: bool = True) -> None:
    """Refuse, with ``ConfigurationError`` naming the fix, options no job can run with."""
    if not command:
        raise ConfigurationError(
            "no command to launch: put it after '--', e.g. stratagem launch --worker 2 -- python train.py"
        )
    for name, value in (("workers", workers), ("ps", ps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}")
    if workers + (1 if chief else 0) == 0:
        raise ConfigurationError("nothing would compute: give at least one worker (--worker N) or --chief")
    if secret is not None and not secret:
        raise ConfigurationError("the secret is empty: give a non-empty --secret, or leave it out to get a random one")
    if timeout is not None and not timeout > 0:
        raise ConfigurationError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    for name, value in (("grace", grace), ("ps_grace", ps_grace)):
        if not value >= 0:
            raise ConfigurationError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if check_program and shutil.which(command[0], path=path) is None:
        raise ConfigurationError(
            f"cannot find the program {command[0]!r} to launch: check the command after '--' "
            f"(is it installed and on PATH?)"
        )


def job_secret(secret: str | None, env: Mapping[str, str]) -> str:
    """The cluster secret of a job (``launch`` and ``launch --mpi`` alike): ``secret`` if given, else
    ``STRATAGEM_SECRET`` of ``env``, else a fresh random one, so a launched job is authenticated."""
    return secret or env.get("STRATAGEM_SECRET") or secrets.token_hex(32)


def check_transport(transport: str | None) -> None:
    """Refuse a ``--transport`` that names no registered transport (with a did-you-mean) or one whose
    libraries are missing here (with the install hint): a usage error before any task starts, rather
    than every task failing the same way. Looks modules up; imports no plugin."""
    if transport is None:
        return
    from stratagem.plugins.manager import plugin_manager

    manager = plugin_manager()
    try:
        why = manager.usable("transport", transport)
    except PluginError as exc:
        raise ConfigurationError(f"--transport: {exc}") from None
    if why is not None:
        hint = manager.spec("transport", transport).install_hint
        raise ConfigurationError(f"--transport {transport}: not usable here: {why}"
                                 + (f"; install it with: {hint}" if hint else ""))


def task_env(base: Mapping[str, str], cluster: ClusterSpec, task: TaskId, secret: str,
             transport: str | None) -> dict[str, str]:
    """``base`` plus what a task of a launched job is told: its place (``STRATAGEM_CONFIG``), the
    secret, the transport (when chosen) and unbuffered output."""
    env = dict(base)
    env["STRATAGEM_CONFIG"] = json.dumps(
        {"cluster": cluster.as_dict(), "task": {"type": task.job, "index": task.index}}
    )
    env["STRATAGEM_SECRET"] = secret
    if transport:
        env["STRATAGEM_TRANSPORT"] = transport
    env["PYTHONUNBUFFERED"] = "1"
    return env
