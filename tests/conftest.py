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
