"""The ``in_graph`` client's local replicas: devices, and the store that shows each one its variables.

A local replica is a device of the client's own process: ``cpu`` (numpy; several are several threads)
or ``gpu:N`` (cupy on GPU N, imported only then). While a step runs on a device, reading a variable
(``var.value``) gives its value on that device: the client's own array where it already lives there,
else a copy made once per version of the value. Outside steps, reads give the client's array, and
tell the strategy that the value may change (the caller may write through it), so that remote
replicas get it again at the next step.

    >>> parse_devices(None), parse_devices(2), parse_devices(["cpu", "gpu:1"])
    (['cpu:0'], ['cpu:0', 'cpu:1'], ['cpu:0', 'gpu:1'])
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from typing import Any, Callable

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.training.variables import VariableStore, is_device_array, to_module

#: The replica step running in this thread (``None`` outside steps); set by the strategy.
CURRENT_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("stratagem_in_graph_step", default=None)


def parse_devices(devices) -> list[str]:
    """Normalise the ``devices`` option to names ``cpu:N`` / ``gpu:N`` (CPU replicas are numbered in order)."""
    if devices is None:
        return ["cpu:0"]
    if isinstance(devices, bool):
        raise ConfigurationError(f"devices must be a number of CPU replicas or a list of devices, not {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise ConfigurationError(f"devices must be >= 1 (the client computes the first shard), got {devices}")
        return [f"cpu:{i}" for i in range(devices)]
    if isinstance(devices, str) or not hasattr(devices, "__iter__"):
        raise ConfigurationError(
            f"devices must be a list such as ['cpu', 'cpu'] or ['gpu:0', 'gpu:1'], or a number of CPU "
            f"replicas; got {devices!r}"
        )
    names, cpus = [], 0
    for device in devices:
        text = str(device).strip().lower()
        kind, _, index = text.partition(":")
        kind = {"cuda": "gpu"}.get(kind, kind)
        if kind not in ("cpu", "gpu") or (index and not index.isdigit()) or (kind == "gpu" and not index):
            raise ConfigurationError(
                f"unknown device {device!r}; use 'cpu' (or 'cpu:N'), or 'gpu:N' / 'cuda:N' for GPU N (cupy)"
            )
        if kind == "cpu":
            names.append(f"cpu:{cpus}")
            cpus += 1
        else:
            names.append(f"gpu:{int(index)}")
    if not names:
        raise ConfigurationError("devices is empty: the client computes the first shard itself, so give it "
                                 "at least one device (default: one CPU replica)")
    duplicates = sorted({n for n in names if n.startswith("gpu") and names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(f"device(s) {', '.join(duplicates)} listed twice; one replica per GPU")
    return names


def _cupy():
    return importlib.import_module("cupy")


class Device:
    """One local replica's device: where its copies of the variables and its shards live."""

    def __init__(self, name: str):
        self.name = name
        self.gpu = int(name.split(":")[1]) if name.startswith("gpu") else None
        if self.gpu is not None:
            try:
                _cupy()
            except ImportError:
                raise ConfigurationError(f"device {name!r} needs cupy (pip install cupy-cuda12x)") from None

    def holds(self, array) -> bool:
        """True if ``array`` already lives on this device."""
        if self.gpu is None:
            return not is_device_array(array)
        return is_device_array(array) and array.device.id == self.gpu

    def place(self, array):
        """A copy of ``array`` on this device (numpy for ``cpu``)."""
        if self.gpu is None:
            return to_module(array, np)
        cupy = _cupy()
        with cupy.cuda.Device(self.gpu):
            return cupy.array(array, copy=True)

    def place_leaf(self, leaf):
        """A step argument's leaf as this device wants it: GPU replicas get arrays on their GPU."""
        if self.gpu is None or not hasattr(leaf, "shape") or isinstance(leaf, (str, bytes)):
            return leaf
        if is_device_array(leaf) and leaf.device.id == self.gpu:
            return leaf
        return self.place(leaf if is_device_array(leaf) else np.asarray(leaf))

    def context(self):
        """The context a step on this device runs in (the GPU made current)."""
        return contextlib.nullcontext() if self.gpu is None else _cupy().cuda.Device(self.gpu)

    def __repr__(self) -> str:
        return self.name


class ClientStore(VariableStore):
    """A client variable's value: its array, and per-device copies for steps on other devices.

    ``on_read_outside_steps(name)`` is called on every read outside a step (the reader may write in
    place), ``on_write(name)`` after every write; writes inside a step are refused.
    """

    live = True

    def __init__(self, name: str, array, on_change: Callable[[str], int]):
        self.name = name
        self.array = array
        self._on_change = on_change
        self.version = on_change(name)
        self._copies: dict[str, tuple[int, Any]] = {}

    def read(self):
        step = CURRENT_STEP.get()
        if step is None:
            self.version = self._on_change(self.name)
            return self.array
        device = step.device
        if device is None or device.holds(self.array):
            return self.array
        cached = self._copies.get(device.name)
        if cached is None or cached[0] != self.version:
            cached = self._copies[device.name] = (self.version, device.place(self.array))
        return cached[1]

    def write(self, array) -> None:
        if CURRENT_STEP.get() is not None:
            raise ConfigurationError(
                f"variable {self.name!r} was assigned inside a step; under in_graph a step only computes "
                f"gradients (the client applies them after every replica is done): update variables with "
                f"optimizer.apply_gradients, or assign them outside strategy.run()"
            )
        xp = np if not is_device_array(self.array) else _cupy()
        xp.copyto(self.array, to_module(array, xp), casting="same_kind")
        self.version = self._on_change(self.name)


def gather(array, target):
    """``array`` (a gradient, from any replica) as an array beside ``target``: same module and device.

    A copy is made where the device differs (through the host between GPUs); the result may be
    modified in place (a gradient recorded by a replica is already its own copy).
    """
    if is_device_array(target):
        if is_device_array(array) and array.device.id == target.device.id:
            return array
        cupy = _cupy()
        with cupy.cuda.Device(target.device.id):
            return cupy.asarray(array.get() if is_device_array(array) else np.asarray(array))
    if is_device_array(array):
        return array.get()
    array = np.asarray(array)
    return array if array.flags.writeable else array.copy()


def placed_like(target):
    """The context in which to compute with ``target`` (its GPU made current)."""
    if is_device_array(target):
        return _cupy().cuda.Device(target.device.id)
    return contextlib.nullcontext()
