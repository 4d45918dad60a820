"""Checkpoints of variables that live on parameter servers: one ordinary checkpoint, whatever the shards.

:func:`snapshot` reads every shard's pieces and optimizer slots and reassembles each variable (and
each slot) from its pieces, so the checkpoint (:mod:`stratagem.training.checkpoint`) does not depend on
the number of ps tasks or on the placement: it restores under another layout, or under ``mirrored``.
:func:`load_onto_shards` does the reverse: it cuts a checkpoint's arrays into the pieces of the
current placement and sends each shard its own.

    >>> spec = {"var": "w", "shape": [4, 2], "parts": 2, "lo": 2, "hi": 4}
    >>> into = {}
    >>> place_piece(into, "w", spec, np.ones((2, 2)))
    >>> place_piece(into, "w", {**spec, "lo": 0, "hi": 2}, np.zeros((2, 2)))
    >>> into["w"].tolist()
    [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from stratagem.training import checkpoint
from stratagem.strategies.checkpoints import check_restorable


def place_piece(into: dict, key: str, spec: dict, value) -> None:
    """Put a piece's ``value`` at its rows of ``into[key]`` (the whole array for an unpartitioned one)."""
    if spec["parts"] == 1:
        into[key] = np.array(value, copy=True)
        return
    full = into.get(key)
    if full is None:
        full = into[key] = np.empty(tuple(spec["shape"]), value.dtype)
    full[spec["lo"]:spec["hi"]] = value


def snapshot(client) -> tuple[dict, dict | None, int]:
    """``(variables, optimizer state or None, global step)`` of every shard, variables reassembled."""
    values: dict[str, np.ndarray] = {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    iterations, config, step = 0, None, 0
    for index, reply in sorted(client.snapshot().items()):
        meta = reply.meta
        arrays = iter(reply.buffers)
        pieces = meta["vars"]
        for spec in pieces:
            place_piece(values, spec["var"], spec, next(arrays))
        by_name = {spec["name"]: spec for spec in pieces}
        for name, slot_names in meta["slots"].items():
            for slot in slot_names:
                place_piece(slots.setdefault(by_name[name]["var"], {}), slot, by_name[name], next(arrays))
        if index == 0:
            iterations, step = int(meta["iterations"]), int(meta["step"])
        config = config or meta.get("optimizer")
    state = {"iterations": iterations, "slots": slots} if config is not None or slots else None
    return values, state, step


def _cut(piece, array):
    return array if piece.parts == 1 else array[piece.lo:piece.hi]


def load_onto_shards(client, pieces: Mapping[str, list], variables: Mapping, path, *,
                     restore: int | None = None) -> int:
    """Load checkpoint ``path`` onto the shards: each variable (and its slots) cut into ``pieces``;
    every shard gets the step and the optimizer's iterations, and ``restore`` (which of the chief's
    ``restore()`` calls this is, for the other tasks waiting on it). Returns the step."""
    loaded = checkpoint.load(path)
    check_restorable(variables, loaded.variables, path)
    state = loaded.optimizer_state or {"iterations": 0, "slots": {}}
    shards: dict[int, tuple[dict, list]] = {
        i: ({"names": [], "slots": {}, "iterations": int(state["iterations"]), "step": int(loaded.step),
             **({"restore": restore} if restore is not None else {})}, [])
        for i in range(client.num_shards)}
    slot_arrays: dict[int, list] = {i: [] for i in shards}
    for name, var_pieces in pieces.items():
        value = np.asarray(loaded.variables[name])
        var_slots = state["slots"].get(name) or {}
        for piece in var_pieces:
            meta, arrays = shards[piece.ps]
            meta["names"].append(piece.name)
            arrays.append(_cut(piece, value))
            if var_slots:
                meta["slots"][piece.name] = sorted(var_slots)
                slot_arrays[piece.ps].extend(_cut(piece, np.asarray(var_slots[s])) for s in sorted(var_slots))
    client.load({i: (meta, arrays + slot_arrays[i]) for i, (meta, arrays) in shards.items()})
    return int(loaded.step)
