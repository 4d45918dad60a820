"""Checkpoints: variables, optimizer state, step and extra metadata in one ``.npz`` file, written atomically.

A directory holds ``ckpt-<step:08d>.npz`` files and a pointer file ``latest`` naming the newest::

    >>> import numpy as np, tempfile
    >>> directory = tempfile.mkdtemp()
    >>> path = save(directory, {"w": np.arange(3, dtype=np.float32)}, None, step=7, extra={"loss": 0.5})
    >>> latest_checkpoint(directory) == path, path.endswith("ckpt-00000007.npz")
    (True, True)
    >>> ckpt = load(directory)
    >>> ckpt.step, ckpt.variables["w"], ckpt.extra
    (7, array([0., 1., 2.], dtype=float32), {'loss': 0.5})
    >>> import shutil; shutil.rmtree(directory)

Atomicity: each file is written to a temporary file in the same directory, flushed and fsync'ed, then
renamed over its final name (``os.replace``), and the directory is fsync'ed; the checkpoint is written
before ``latest`` is updated. A crash at any point therefore leaves ``latest`` naming a complete
checkpoint (the previous one, or the new one), never a partial file; temporary files left by a crash
are ignored, and removed by the next successful save.

Format: a plain (uncompressed) numpy ``.npz`` archive read with ``np.load(..., allow_pickle=False)``:
nothing in it can execute code. The member ``__meta__`` is UTF-8 JSON (as a uint8 array) with the
format version, the step, ``extra``, the optimizer's ``iterations`` and, for every array member, its
role (variable or optimizer slot), its name and its dtype. Arrays whose dtype numpy cannot store without
pickle (bfloat16 and the other ``ml_dtypes`` types) are stored as unsigned-integer views of the same
bytes and restored from the dtype name in the metadata. Members are numbered (``var_00000`` ...),
so variable names may contain any character.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import zipfile
from typing import Any, Mapping

import numpy as np

from stratagem.core.errors import StratagemError
from stratagem.training.variables import Variable

__all__ = ["Checkpoint", "CheckpointError", "CheckpointNotFoundError", "save", "load", "latest_checkpoint"]

FORMAT = "stratagem-checkpoint"
VERSION = 1
POINTER = "latest"
META = "__meta__"
_CKPT_RE = re.compile(r"^ckpt-(\d+)\.npz$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(StratagemError, ValueError):
    """A checkpoint cannot be written or read; the message names the file and the problem."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint where one was asked for."""


@dataclasses.dataclass
class Checkpoint:
    """What :func:`load` returns.

    Attributes:
        variables: ``{name: numpy array}`` in the order they were saved.
        optimizer_state: ``{"iterations": int, "slots": {var: {slot: array}}}`` (``Optimizer.state_dict``
            form, for ``load_state_dict``), or ``None`` if none was saved.
        step: the training step it was saved at.
        extra: the JSON-serialisable dict passed to :func:`save` (``{}`` if none).
        path: the file it was read from.
    """

    variables: dict[str, np.ndarray]
    optimizer_state: dict[str, Any] | None
    step: int
    extra: dict[str, Any]
    path: str | None = None


# -- dtypes -----------------------------------------------------------------------------------------

def _ml_dtype(name: str) -> np.dtype | None:
    import ml_dtypes

    scalar = getattr(ml_dtypes, name, None)
    if scalar is None or not isinstance(scalar, type):
        return None
    return np.dtype(scalar)


def _encode(array, what: str) -> tuple[np.ndarray, str]:
    """The array as npz can store it without pickle, and the dtype name to restore it with."""
    if type(array).__module__.startswith("cupy"):
        array = array.get()
    elif isinstance(array, Variable):
        array = array.numpy()
    elif type(array).__module__.startswith("torch"):
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    if array.dtype.kind in "biufc" and not array.dtype.isnative:
        array = array.astype(np.dtype(array.dtype.name))  # stored (and restored) in native byte order
    dtype = array.dtype
    if dtype.kind in "biufc" and dtype.isbuiltin == 1:
        return array, dtype.name
    if dtype.type.__module__.startswith("ml_dtypes") and _ml_dtype(dtype.name) == dtype:
        raw = np.dtype(f"u{dtype.itemsize}")
        return np.ascontiguousarray(array).view(raw), dtype.name
    raise CheckpointError(
        f"cannot checkpoint {what}: dtype {dtype} cannot be stored without pickle; "
        f"use a numeric dtype (float16/32/64, bfloat16, ints, bool, complex)"
    )


def _builtin_dtype(name: str) -> np.dtype | None:
    """numpy's own numeric dtype called ``name`` (never object, string or record dtypes)."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        return None
    if dtype.kind in "biufc" and dtype.isbuiltin == 1 and dtype.name == name:
        return dtype
    return None


def _decode(raw: np.ndarray, dtype_name: str, shape, where: str) -> np.ndarray:
    dtype = _builtin_dtype(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None and isinstance(dtype_name, str):
        dtype = _ml_dtype(dtype_name)
    if dtype is None:
        raise CheckpointError(f"{where}: unknown dtype {dtype_name!r} in the metadata")
    if raw.dtype.itemsize != dtype.itemsize or list(raw.shape) != list(shape):
        raise CheckpointError(
            f"{where}: stored as {raw.dtype}{list(raw.shape)}, the metadata says {dtype_name}{list(shape)}"
        )
    return raw if raw.dtype == dtype else raw.view(dtype)


# -- writing ------------------------------------------------------------------------------------------

def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles (Windows)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(directory: str, name: str, write) -> str:
    """Call ``write(file)`` on a temp file in ``directory``, fsync it and rename it to ``name``."""
    final = os.path.join(directory, name)
    # not tempfile.mkstemp: its files are private (0600); a checkpoint gets the usual permissions (umask)
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(directory)
    return final


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
    return int(step)


def save(directory: str | os.PathLike, variables: Mapping[str, Any], optimizer_state: Mapping[str, Any] | None,
         step: int, extra: Mapping[str, Any] | None = None, max_to_keep: int | None = 5) -> str:
    """Write ``ckpt-<step:08d>.npz`` into ``directory`` atomically, point ``latest`` at it; return its path.

    Args:
        directory: created if missing.
        variables: ``{name: array}`` (numpy, cupy, ``Variable`` or CPU torch tensor); copied to the host.
        optimizer_state: ``opt.state_dict()``, or ``None``.
        step: the training step (an integer >= 0); a checkpoint of the same step is replaced.
        extra: JSON-serialisable metadata (epoch, loss, data position...).
        max_to_keep: keep this many checkpoints (the newest steps), delete the older ones; ``None`` keeps all.

    >>> import numpy as np, os, tempfile
    >>> directory = tempfile.mkdtemp()
    >>> for step in range(4):
    ...     _ = save(directory, {"w": np.full(2, step, np.float32)}, None, step, max_to_keep=2)
    >>> sorted(os.listdir(directory))
    ['ckpt-00000002.npz', 'ckpt-00000003.npz', 'latest']
    >>> import shutil; shutil.rmtree(directory)
    """
    directory = os.fspath(directory)
    step = _check_step(step)
    if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                    or max_to_keep < 1):
        raise CheckpointError(f"max_to_keep must be an integer >= 1 or None (keep all), got {max_to_keep!r}")
    if not isinstance(variables, Mapping):
        raise CheckpointError(f"variables must be a dict {{name: array}}, not {type(variables).__name__}")
    members: dict[str, np.ndarray] = {}
    arrays_meta: dict[str, dict[str, Any]] = {}

    def add(kind: str, what: str, value, **where) -> str:
        key = f"{kind}_{len(members):05d}"
        array, dtype_name = _encode(value, what)
        members[key] = array
        arrays_meta[key] = {"dtype": dtype_name, "shape": list(array.shape), **where}
        return key

    variable_keys = {}
    for name, value in variables.items():
        if not isinstance(name, str):
            raise CheckpointError(f"variable names must be strings, got {name!r}")
        variable_keys[name] = add("var", f"variable {name!r}", value)
    optimizer_meta = None
    if optimizer_state is not None:
        if (not isinstance(optimizer_state, Mapping) or "iterations" not in optimizer_state
                or not isinstance(optimizer_state.get("slots"), Mapping)):
            raise CheckpointError(
                "optimizer_state must be opt.state_dict(): {'iterations': int, 'slots': {var: {slot: array}}}"
            )
        slots_meta: dict[str, dict[str, str]] = {}
        for var_name, slots in optimizer_state["slots"].items():
            if not isinstance(slots, Mapping):
                raise CheckpointError(f"optimizer slots of {var_name!r} must be a dict {{slot: array}}")
            slots_meta[str(var_name)] = {
                str(slot): add("slot", f"optimizer slot {slot!r} of {var_name!r}", array)
                for slot, array in slots.items()
            }
        iterations = optimizer_state["iterations"]
        if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)):
            raise CheckpointError(f"optimizer_state['iterations'] must be an integer, got {iterations!r}")
        optimizer_meta = {"iterations": int(iterations), "slots": slots_meta}
    meta = {"format": FORMAT, "version": VERSION, "step": step, "extra": dict(extra or {}),
            "variables": variable_keys, "optimizer": optimizer_meta, "arrays": arrays_meta}
    try:
        meta_bytes = json.dumps(meta, allow_nan=True).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"extra must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from None
    members[META] = np.frombuffer(meta_bytes, dtype=np.uint8)

    os.makedirs(directory, exist_ok=True)
    name = f"ckpt-{step:08d}.npz"
    path = _write_atomically(directory, name, lambda file: np.savez(file, **members))
    _write_atomically(directory, POINTER, lambda file: file.write((name + "\n").encode("utf-8")))
    _prune(directory, max_to_keep, keep=name)
    return path


def _checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, file name)`` of the complete checkpoints in ``directory``, oldest first."""
    found = []
    for entry in os.listdir(directory):
        match = _CKPT_RE.match(entry)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _prune(directory: str, max_to_keep: int | None, keep: str) -> None:
    stale = []
    if max_to_keep is not None:  # the checkpoint just written, and the newest steps of the others
        others = [name for _, name in _checkpoints(directory) if name != keep]
        stale = others[:max(0, len(others) - (max_to_keep - 1))]
    stale += [entry for entry in os.listdir(directory) if entry.startswith(_TMP_PREFIX)]
    for entry in stale:
        try:
            os.unlink(os.path.join(directory, entry))
        except FileNotFoundError:
            pass


# -- reading -------------------------------------------------------------------------------------------

def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The path of the newest complete checkpoint in ``directory``, or ``None`` if there is none.

    It is the file ``latest`` names; if ``latest`` is missing (a crash between writing a checkpoint and
    its pointer) or names a file that was deleted, the checkpoint of the highest step.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     latest_checkpoint(directory) is None
    True
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    pointer = os.path.join(directory, POINTER)
    try:
        with open(pointer, "rb") as file:
            content = file.read(4096)
    except FileNotFoundError:
        content = None
    if content is not None:
        name = content.decode("utf-8", errors="replace").strip()
        if not _CKPT_RE.match(name):
            raise CheckpointError(
                f"{pointer}: does not name a checkpoint file (found {name[:80]!r}); delete it to fall "
                f"back to the newest ckpt-*.npz in the directory"
            )
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    found = _checkpoints(directory)
    return os.path.join(directory, found[-1][1]) if found else None


def load(path_or_directory: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint file, or the latest checkpoint of a directory.

    Raises :class:`CheckpointNotFoundError` if there is none, :class:`CheckpointError` naming the file
    if it is truncated, corrupt or not a Stratagem checkpoint.

    >>> import numpy as np, tempfile
    >>> import ml_dtypes
    >>> directory = tempfile.mkdtemp()
    >>> w = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    >>> _ = save(directory, {"w": w}, {"iterations": 3, "slots": {"w": {"m": np.ones(2, np.float32)}}}, 10)
    >>> ckpt = load(directory)
    >>> ckpt.variables["w"].dtype, ckpt.optimizer_state["iterations"]
    (dtype(bfloat16), 3)
    >>> import shutil; shutil.rmtree(directory)
    """
    target = os.fspath(path_or_directory)
    if os.path.isdir(target):
        path = latest_checkpoint(target)
        if path is None:
            raise CheckpointNotFoundError(f"{target}: no checkpoint in this directory (no ckpt-*.npz)")
    elif os.path.exists(target):
        path = target
    else:
        raise CheckpointNotFoundError(f"{target}: no such checkpoint file or directory")
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise CheckpointError(f"{path}: not a Stratagem checkpoint (a single array, not an .npz archive)")
        with archive:
            members = {key: archive[key] for key in archive.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, RuntimeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            f"{path}: not a readable checkpoint (truncated or corrupt: {type(exc).__name__}: {exc}); "
            f"restore an earlier checkpoint or delete this file"
        ) from exc
    return _parse(path, members)


def _parse(path: str, members: dict[str, np.ndarray]) -> Checkpoint:
    if META not in members:
        raise CheckpointError(f"{path}: not a Stratagem checkpoint (no {META} member)")
    try:
        meta = json.loads(members.pop(META).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a Stratagem checkpoint (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {meta.get('version')!r} is newer than this Stratagem reads "
            f"({VERSION}); upgrade stratagem"
        )
    try:
        arrays_meta = meta["arrays"]
        step = meta["step"]

        def array(key: str, what: str) -> np.ndarray:
            if key not in members or key not in arrays_meta:
                raise CheckpointError(f"{path}: {what} is missing (member {key!r})")
            info = arrays_meta[key]
            return _decode(members[key], info["dtype"], info["shape"], f"{path}: {what}")

        variables = {name: array(key, f"variable {name!r}") for name, key in meta["variables"].items()}
        optimizer_state = None
        if meta.get("optimizer") is not None:
            optimizer = meta["optimizer"]
            optimizer_state = {
                "iterations": int(optimizer["iterations"]),
                "slots": {var: {slot: array(key, f"optimizer slot {slot!r} of {var!r}") for slot, key in slots.items()}
                          for var, slots in optimizer["slots"].items()},
            }
        extra = meta.get("extra") or {}
        if not isinstance(extra, dict):
            raise TypeError(f"extra is a {type(extra).__name__}, not a dict")
        step = int(step)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{path}: malformed metadata ({type(exc).__name__}: {exc})") from None
    return Checkpoint(variables=variables, optimizer_state=optimizer_state, step=step, extra=extra, path=path)
