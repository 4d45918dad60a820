"""A stand-in for cupy in tests without a GPU: numpy arrays whose type says "cupy".

``is_device_array`` and ``array_module`` recognise cupy arrays by their type's module, so the code paths
that keep device arrays on their module (variables, optimizers) can be exercised on any machine.
Install it for one test with ``monkeypatch.setitem(sys.modules, "cupy", FakeCupy())`` (the ``fake_cupy``
fixture of the test suite does).

    >>> fake = FakeCupy()
    >>> x = fake.ones(2)
    >>> type(x).__module__, fake.calls, x.get().tolist()
    ('cupy._core.core', ['ones'], [1.0, 1.0])
"""

from __future__ import annotations

import types

import numpy as np


class FakeDeviceArray(np.ndarray):
    """Looks like a cupy array to ``is_device_array`` (its type's module starts with "cupy")."""

    def get(self):
        return np.array(self, copy=True).view(np.ndarray)


FakeDeviceArray.__module__ = "cupy._core.core"


class FakeCupy(types.ModuleType):
    """A module named cupy whose functions are numpy's, returning FakeDeviceArray; records calls."""

    ndarray = FakeDeviceArray

    def __init__(self):
        super().__init__("cupy")
        self.calls: list[str] = []

    def __getattr__(self, name):
        target = getattr(np, name)
        if not callable(target) or isinstance(target, type):
            return target

        def call(*args, **kwargs):
            self.calls.append(name)
            result = target(*args, **kwargs)
            if isinstance(result, np.ndarray) and not isinstance(result, FakeDeviceArray):
                result = result.view(FakeDeviceArray)
            return result

        if isinstance(target, np.ufunc):
            return _Ufunc(call, target)
        return call


class _Ufunc:
    """A recorded ufunc that keeps the ufunc's methods (``add.at``, as cupy's ufuncs have them)."""

    def __init__(self, call, ufunc: np.ufunc):
        self._call, self._ufunc = call, ufunc

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._ufunc, name)
