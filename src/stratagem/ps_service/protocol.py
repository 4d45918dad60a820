"""The parameter-server protocol: tags, operations, piece descriptions and the errors (shared by
:mod:`~stratagem.ps_service.server` and :mod:`~stratagem.ps_service.client`).

Every request is a wire :class:`~stratagem.core.transport.Message` sent under the tag ``ps`` to a ps
task: ``meta`` holds ``op`` (the operation), ``id`` (the requester's sequence number, echoed in the
reply) and the operation's plain-data arguments; ``buffers`` hold the arrays (values, gradients) in
the order ``meta["names"]`` lists them. The reply comes back under the tag ``ps.reply``, with
``ok: True`` or ``error`` (a message) and ``error_type``. Nothing is pickled.

A reply carrying values (``pull``, and ``push`` with ``pull``) of more than :data:`REPLY_PART_BYTES`
comes in parts: messages with ``part`` (0, 1, ...) and ``parts``, each with the ``names`` of its
buffers; only the last has ``ok`` and the rest of the reply. The requester copies a part into place
while the next is still on the wire, and a ps task answering an ``async`` push sends each part as
soon as its pieces are updated. Every part of a reply holds the same version of the values.

Operations (the server's ``_op_<name>`` methods):

==============  ==========================================================================================
``hello``       status: ``ready``, ``step``, ``stop``, the number of variables, ``restores`` (the
                chief's ``restore()`` calls loaded here); non-chief tasks poll it
``init``        the chief declares pieces (``vars``: specs) with initial values; existing ones are kept
``ready``       the chief says the variables are initialised (or restored): workers may start
``catalog``     every piece's spec, and the consistency settings
``pull``        values (and ``versions``) of the named pieces, or of all
``pull_rows``   rows of the named pieces: one int64 array of rows (from the piece's first row) per piece
``push``        gradients of the named pieces for the ``version`` the worker read; applied by the mode.
                ``rows``: pieces with row gradients (two buffers each, int64 rows and gradient rows,
                after the dense ones); ``skip``: pieces the reply (``pull``) leaves out
``assign``      overwrite values (``Variable.assign`` on a remote variable)
``optimizer``   the optimizer's config (``opt.get_config()``): the server builds its own and applies
``snapshot``    values, optimizer slots, iterations and step, for a checkpoint
``load``        the same, from a checkpoint; ``restore``: which of the chief's ``restore()`` calls it is.
                A sync round's pushes still waiting are dropped (made on the values it replaces)
``stop``        the chief asks every worker to stop (``should_stop()`` becomes true)
``idle``        the coordinator says some workers have nothing to run (rounds and bounds skip them)
``bye``         a replica leaves (``clean`` or with its ``error``)
``stats``       counters (pushes applied, dropped, ...), for tests and operators
``received``    the requester has the whole reply to its request ``id`` (one that said ``turn: True``):
                the next reply may take its turn (:mod:`~stratagem.ps_service.turns`); not answered
==============  ==========================================================================================
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stratagem.core.cluster import TaskId
from stratagem.core.errors import ConfigurationError, PeerLostError, StratagemError
from stratagem.ps_service.placement import Piece
from stratagem.core.wire import DTYPES, dtype_name

#: Tag of requests (to a ps task) and of replies (to the requester).
REQUEST_TAG = "ps"
REPLY_TAG = "ps.reply"

#: Consistency modes (``mode=`` of the strategies).
MODES = ("async", "sync", "bounded")

#: Outcomes of a push, as the reply's ``status`` says.
APPLIED, DROPPED, STOPPED = "applied", "dropped", "stopped"

#: Value bytes per part of a reply (see the module doc). Parts of a few MB keep the per-message cost
#: small next to the bytes and still give the requester something to copy while the rest arrives.
REPLY_PART_BYTES = 8 << 20


def split_parts(sizes, part_bytes: int | None = None) -> list[list[int]]:
    """Group the indices of buffers of ``sizes`` bytes, in order, into parts of at least
    ``part_bytes`` (default :data:`REPLY_PART_BYTES`; the last part may be smaller, but not less than
    half of it unless it is the only one).

    >>> split_parts([4, 4, 4, 4, 1], part_bytes=8)
    [[0, 1], [2, 3, 4]]
    >>> split_parts([3, 3], part_bytes=8)
    [[0, 1]]
    """
    part_bytes = REPLY_PART_BYTES if part_bytes is None else part_bytes
    parts: list[list[int]] = [[]]
    filled = 0
    for index, size in enumerate(sizes):
        if filled >= part_bytes:
            parts.append([])
            filled = 0
        parts[-1].append(index)
        filled += int(size)
    if len(parts) > 1 and sum(int(sizes[i]) for i in parts[-1]) < part_bytes // 2:
        parts[-2].extend(parts.pop())  # no small tail part: it would cost a message for little
    return parts


class RequestRefused(Exception):
    """A request the server refuses; its message goes back to the requester (as a ``RemoteError``)
    and the server keeps serving. ``culprit``: the task whose failure failed the job, when that is why."""

    def __init__(self, message: str, culprit: str | None = None):
        super().__init__(message)
        self.culprit = culprit


class ShardLostError(PeerLostError):
    """A ps task (a shard of the variables) died or became unreachable; ``task`` names it.

    A :class:`~stratagem.core.errors.PeerLostError`, so code catching that catches this too.

    >>> str(ShardLostError(TaskId("ps", 1), ["w/part_1", "b"], "connection lost"))
    'lost peer /job:ps/task:1: parameter-server shard /job:ps/task:1 (holding w/part_1, b) is gone: connection lost; restart the job: the chief restores the latest checkpoint'
    """

    def __init__(self, task, pieces=(), detail: str = ""):
        pieces = list(pieces)
        shown = ", ".join(pieces[:6]) + (f" and {len(pieces) - 6} more" if len(pieces) > 6 else "")
        holding = f" (holding {shown})" if pieces else ""
        text = f"parameter-server shard {task}{holding} is gone"
        if detail:
            text += f": {detail}"
        text += "; restart the job: the chief restores the latest checkpoint"
        super().__init__(task, text)
        self.pieces = pieces

    def __reduce__(self):
        return (PeerLostError, (self.task, str(self).split(": ", 1)[-1]))


class RemoteError(StratagemError):
    """A ps task refused a request; the message is the server's, prefixed with the task. When the
    server refused because the job failed, ``culprit`` names the task that failed (the launcher
    follows it: :mod:`stratagem.core.failures`)."""

    def __init__(self, message: str, culprit: str | None = None):
        super().__init__(message)
        if culprit is not None:
            self.culprit = culprit

    def __reduce__(self):
        return (type(self), (str(self), getattr(self, "culprit", None)))


def piece_spec(piece: Piece, shape, dtype) -> dict:
    """The plain-data description of one piece sent to (and kept by) its server."""
    return {"name": piece.name, "var": piece.variable, "shape": [int(n) for n in shape],
            "dtype": dtype_name(dtype), "part": piece.part, "parts": piece.parts,
            "lo": piece.lo, "hi": piece.hi}


def piece_shape(spec: dict) -> tuple[int, ...]:
    """The shape of the stored piece: the variable's, with rows ``[lo, hi)`` when partitioned."""
    shape = tuple(spec["shape"])
    if spec["parts"] == 1:
        return shape
    return (spec["hi"] - spec["lo"], *shape[1:])


def spec_dtype(spec: dict) -> np.dtype:
    dtype = DTYPES.get(spec.get("dtype"))
    if dtype is None:
        raise ConfigurationError(f"piece {spec.get('name')!r}: dtype {spec.get('dtype')!r} is not a wire dtype")
    return dtype


def same_spec(a: dict, b: dict) -> bool:
    keys = ("name", "var", "shape", "dtype", "part", "parts", "lo", "hi")
    return all(list(a[k]) == list(b[k]) if isinstance(a[k], (list, tuple)) else a[k] == b[k] for k in keys)


def describe_spec(spec: dict) -> str:
    where = f", rows {spec['lo']}:{spec['hi']} of {spec['parts']} part(s)" if spec["parts"] > 1 else ""
    return f"shape {tuple(spec['shape'])}, {spec['dtype']}{where}"


def task_key(task: TaskId) -> str:
    """How a task is written in the protocol's metadata (``worker:1``)."""
    return task.short


def check_mode(mode: Any, replicas_to_aggregate: Any, total_replicas: Any, staleness: Any,
               num_replicas: int) -> dict:
    """Validate the consistency options against the number of replicas that push; return them resolved.

    >>> check_mode("sync", None, None, None, 3)
    {'mode': 'sync', 'replicas_to_aggregate': 3, 'total_replicas': 3, 'staleness': None}
    >>> check_mode("sync", 4, None, None, 3)
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: replicas_to_aggregate=4 is more than the 3 replicas that push gradients; use at most 3 (fewer gives backup workers)
    """
    if mode not in MODES:
        raise ConfigurationError(f"unknown mode {mode!r}; use one of: {', '.join(map(repr, MODES))}")

    def count(name, value, low):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ConfigurationError(f"{name} must be an integer >= {low}, got {value!r}")
        return int(value)

    aggregate = count("replicas_to_aggregate", replicas_to_aggregate, 1)
    total = count("total_replicas", total_replicas, 1)
    bound = count("staleness", staleness, 0)
    if mode != "sync" and (aggregate is not None or total is not None):
        raise ConfigurationError(
            f"replicas_to_aggregate and total_replicas apply to mode='sync' only (mode is {mode!r})"
        )
    if mode != "bounded" and bound is not None:
        raise ConfigurationError(f"staleness applies to mode='bounded' only (mode is {mode!r})")
    if mode == "bounded" and bound is None:
        raise ConfigurationError("mode='bounded' needs staleness=S: how many steps a worker may run ahead "
                                 "of the slowest (0 is lockstep)")
    if mode == "sync":
        if total is not None and total != num_replicas:
            raise ConfigurationError(
                f"total_replicas={total} but {num_replicas} replica(s) push gradients in this cluster; "
                f"leave total_replicas out or set it to {num_replicas}"
            )
        total = num_replicas
        if aggregate is None:
            aggregate = total
        if aggregate > total:
            raise ConfigurationError(
                f"replicas_to_aggregate={aggregate} is more than the {total} replicas that push gradients; "
                f"use at most {total} (fewer gives backup workers)"
            )
    return {"mode": mode, "replicas_to_aggregate": aggregate, "total_replicas": total, "staleness": bound}
