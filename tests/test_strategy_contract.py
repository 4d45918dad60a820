"""Every built-in strategy passes the strategy conformance suite (stratagem.testing.strategy_contract) over
every transport between processes: the plain script ends cleanly, however it ends, on every task.

The variants cover what differs between the strategies: who trains (under in_graph and parameter_server
only the chief runs the loop; the workers serve it), ps tasks, and sync vs async modes.
"""

from __future__ import annotations

import importlib.util

import pytest

from stratagem.testing.strategy_contract import run_strategy_contract

pytestmark = pytest.mark.timeout(150)

needs_grpc = pytest.mark.skipif(importlib.util.find_spec("grpc") is None,
                                reason="grpcio is not installed (pip install 'stratagem[grpc]')")

#: (strategy, class attributes): every strategy, and the modes whose failure handling differs.
#: ``one_process``: the variant promises the update of one process on the whole batch (under
#: ``parameter_server`` each step runs on one worker, on the whole batch the coordinator hands it).
VARIANTS = [
    ("mirrored", {"culprits": ("worker:1", "worker:0"), "one_process": True}),
    ("in_graph", {"one_process": True}),
    ("between_graph", {"ps": 1, "culprits": ("worker:2",)}),
    ("between_graph", {"ps": 1, "mode": "sync", "culprits": ("worker:1", "worker:0"), "one_process": True}),
    ("parameter_server", {"ps": 1, "one_process": True}),
    ("parameter_server", {"ps": 1, "mode": "sync", "one_process": True}),
]

# The training checks (one process's result, a checkpoint's round trip) depend on the strategy, not on
# the transport: they run over zmq only.
for _transport, _marks in (("zmq", []), ("grpc", [needs_grpc]), ("shm", [])):
    for _strategy, _attributes in VARIANTS:
        _cls = run_strategy_contract(_strategy, _transport, training_checks=_transport == "zmq", **_attributes)
        for _mark in _marks:
            _cls = _mark(_cls)
        globals()[_cls.__name__] = _cls
