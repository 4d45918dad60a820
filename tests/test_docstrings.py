"""Every runnable example in the library's docstrings runs and gives what it shows.

Modules whose optional dependency is missing here (grpc, mpi4py, cupy) are skipped with the reason.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import stratagem

#: Scripts inside the package, run as files by the processes they start; importing one runs it.
SCRIPTS = {"stratagem.bench.train_task", "stratagem.advise.steps_task", "stratagem.testing.plain_training",
           "stratagem.testing.conformance_training", "stratagem.testing.fault_script"}

MODULES = ["stratagem"] + sorted(
    info.name for info in pkgutil.walk_packages(stratagem.__path__, prefix="stratagem.")
    if not info.name.endswith("__main__") and info.name not in SCRIPTS
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"{name} needs what is not installed here: {exc}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring example(s) failed"
