"""Fixtures shared by the test modules."""

import sys

import pytest

from stratagem.testing.fake_cupy import FakeCupy


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in ``cupy`` module (numpy underneath) installed for one test; see stratagem.testing.fake_cupy."""
    module = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


@pytest.fixture
def closing():
    """``closing(thing)`` returns ``thing`` and closes it when the test ends, passed or failed, in the
    order they were made: for the servers and clusters the tests build."""
    made = []

    def keep(thing):
        made.append(thing)
        return thing
    yield keep
    for thing in made:
        thing.close()
