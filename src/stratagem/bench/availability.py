"""Whether a transport can run a bench here, and how its processes start: one answer for both benches.

    >>> check_transport("local").skip
    'in-process only: it connects threads of one process, and the bench runs every task in a process of its own'
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransportCheck:
    """``skip``: why it cannot run here (None: it can); ``mpi_job``: its tasks are the ranks of one
    ``mpiexec`` job (the transport class says ``launcher = "mpiexec"``); ``max_np``: one GPU per
    process, so no more processes than GPUs."""

    name: str
    skip: str | None = None
    mpi_job: bool = False
    max_np: int | None = None


def not_installed(reason: str, hint: str | None) -> str:
    """``No module named 'cupy'`` -> ``cupy not installed (pip install ...)``."""
    if reason.startswith("No module named "):
        reason = f"{reason[len('No module named '):].strip(chr(39))} not installed"
    return f"{reason} ({hint})" if hint and hint not in reason else reason


def mpi_job_problem() -> str | None:
    """Why a local ``mpiexec`` job cannot start here (no mpiexec, no private network namespace), or None."""
    from stratagem.launch.mpi import find_mpiexec, no_mpiexec, private_netns

    if find_mpiexec() is None:
        return no_mpiexec()
    prefix, why = private_netns()
    if prefix is None:
        return (f"cannot make a private network namespace for the MPI job ({why}); Open MPI's launcher "
                f"would listen on every interface")
    return None


def check_transport(name: str) -> TransportCheck:
    """What the bench needs to know of transport ``name`` (an unknown name raises ``PluginError``,
    listing the known ones)."""
    from stratagem.plugins.manager import plugin_manager

    pm = plugin_manager()
    spec = pm.spec("transport", name)
    why = pm.usable("transport", name, check=True)
    if why is not None:
        return TransportCheck(name, not_installed(why, spec.install_hint))
    cls = pm.transport_class(name)
    if getattr(cls, "in_process", False):
        return TransportCheck(name, "in-process only: it connects threads of one process, and the bench "
                                    "runs every task in a process of its own")
    mpi_job = getattr(cls, "launcher", None) == "mpiexec"
    max_np = None
    if getattr(cls, "device_buffers", False):  # nccl: usable means cupy imports and sees a GPU
        import cupy

        max_np = cupy.cuda.runtime.getDeviceCount()
    return TransportCheck(name, mpi_job_problem() if mpi_job else None, mpi_job, max_np)
