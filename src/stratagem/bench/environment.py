"""What a benchmark figure was measured on: versions, machine, load, and the cluster's shape.

    >>> env = describe_environment(np=2, transports=["zmq"])
    >>> env["cluster"], env["cores"]["logical"] >= 1, "numpy" in env["versions"]
    ({'np': 2, 'transports': ['zmq']}, True, True)

Versions come from the installed distributions' metadata (``importlib.metadata``), so describing the
environment imports none of grpc, mpi4py, torch or cupy (importing ``mpi4py.MPI`` would even start
MPI). The MPI library is named by ``mpiexec --version``. A package that is not installed is ``None``.
Everything here is best effort: a field that cannot be read is ``None``, never an error.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
from typing import Any

__all__ = ["describe_environment", "package_versions"]

#: Reported name -> the distributions that provide it (the first installed one wins).
_DISTRIBUTIONS = {
    "stratagem": ("stratagem",),
    "numpy": ("numpy",),
    "pyzmq": ("pyzmq",),
    "grpcio": ("grpcio",),
    "mpi4py": ("mpi4py",),
    "torch": ("torch",),
    "cupy": ("cupy", "cupy-cuda12x", "cupy-cuda11x", "cupy-cuda13x", "cupy-rocm-5-0"),
    "rich": ("rich",),
}


def package_versions() -> dict[str, str | None]:
    """``{"numpy": "2.1.3", "torch": None, ...}``: each package's installed version, or None."""
    versions: dict[str, str | None] = {}
    for name, dists in _DISTRIBUTIONS.items():
        versions[name] = None
        for dist in dists:
            try:
                versions[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def describe_environment(**cluster_shape: Any) -> dict:
    """A JSON-ready description of this machine and software; ``cluster_shape`` is recorded as given.

    Keys: ``date`` (UTC, ISO 8601), ``hostname``, ``python``, ``platform``, ``versions`` (see
    :func:`package_versions`, plus ``libzmq`` and ``mpi_library``), ``stratagem_source`` (git
    revision, ``+uncommitted`` when the checkout has edits, and a hash of the package's sources),
    ``cpu_model``, ``cores`` (``logical`` = ``os.cpu_count()``, ``usable`` = this process's CPU
    affinity), ``memory_bytes`` (total and available), ``loadavg`` and ``cluster``.
    """
    versions: dict[str, Any] = package_versions()
    versions["libzmq"] = _libzmq_version()
    versions["mpi_library"] = _mpi_library()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(terse=True),
        "machine": platform.machine(),
        "versions": versions,
        "stratagem_source": _stratagem_source(),
        "cpu_model": _cpu_model(),
        "cores": {"logical": os.cpu_count(),
                  "usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None},
        "memory_bytes": _memory(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "gpus": _gpus(),
        "cluster": dict(cluster_shape),
    }


def _run(*cmd: str) -> list[str] | None:
    """The non-empty lines ``cmd`` prints, or None if it is missing, fails or prints nothing."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return lines if proc.returncode == 0 and lines else None


def _libzmq_version() -> str | None:
    try:
        import zmq  # a dependency of stratagem, cheap to import (unlike grpc or mpi4py.MPI)

        return zmq.zmq_version()
    except Exception:
        return None


def _mpi_library() -> str | None:
    lines = _run("mpiexec", "--version")
    return lines[0] if lines else None


def _gpus() -> list[str] | None:
    """GPU names from ``nvidia-smi`` (None: no NVIDIA tooling here)."""
    return _run("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            models = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
        return ", ".join(sorted(models)) or platform.processor() or None
    except OSError:
        return platform.processor() or None


def _memory() -> dict | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = {key: int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "MemAvailable") if key in fields}
        return {"total": kib.get("MemTotal"), "available": kib.get("MemAvailable")}
    except (OSError, ValueError):
        return None


def _stratagem_source() -> dict:
    """Which code was measured: the git revision alone misses uncommitted edits, so hash the sources."""
    import stratagem

    package = os.path.dirname(os.path.abspath(stratagem.__file__))
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, package).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    revision = _run("git", "-C", package, "rev-parse", "--short", "HEAD")
    if revision:
        edits = _run("git", "-C", package, "status", "--porcelain", "--", ".")
        revision = [revision[0] + ("+uncommitted" if edits else "")]
    return {"git": revision[0] if revision else None, "sources_sha256": digest.hexdigest()[:16]}
