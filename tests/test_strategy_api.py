"""The Strategy's public methods are final: they validate once and call ``_<name>_impl`` hooks, which
are all a built-in strategy overrides (issue #25 item 3; see ``Strategy``'s class doc).

The behaviour checks run every built-in strategy in one process over the ``local`` transport, its
serving tasks (ps, workers) in threads that end when the driver shuts down.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from stratagem.core.cluster import ClusterSpec
from stratagem.plugins.builtin import stratagem_add_strategies
from stratagem.plugins.manager import PluginManager
from stratagem.strategies.base import Strategy
from stratagem.transports.local import LocalFabric

pytestmark = pytest.mark.timeout(60)

BUILTINS = [spec.name for spec in stratagem_add_strategies()]
#: Each built-in's cluster, the tasks that serve (in threads) and the task that drives.
WORLDS = {
    "mirrored": ({"worker": ["local:0"]}, [], "worker:0"),
    "in_graph": ({"worker": ["local:0"]}, [], "worker:0"),
    "between_graph": ({"ps": ["local:0"], "worker": ["local:1"]}, ["ps:0"], "worker:0"),
    "parameter_server": ({"chief": ["local:0"], "worker": ["local:1"], "ps": ["local:2"]},
                         ["ps:0", "worker:0"], "chief:0"),
}


def _builtin_classes() -> dict[str, type]:
    manager = PluginManager(autoload=False)
    return {name: manager.strategy_class(name) for name in BUILTINS}


def _below_strategy(cls: type) -> list[type]:
    """``cls`` and its bases up to (not including) ``Strategy``."""
    mro = cls.__mro__
    return list(mro[:mro.index(Strategy)])


def test_every_builtin_strategy_has_a_world_here():
    assert sorted(WORLDS) == sorted(BUILTINS)


def test_no_builtin_strategy_overrides_a_public_method_of_strategy():
    public = {name for name in vars(Strategy) if not name.startswith("_")}
    offenders = sorted({f"{klass.__qualname__}.{attr}"
                        for cls in _builtin_classes().values() for klass in _below_strategy(cls)
                        for attr in vars(klass) if attr in public and attr not in Strategy.OVERRIDABLE})
    assert not offenders, (f"{offenders} override public methods of Strategy: override the _<name>_impl "
                           f"hook instead (Strategy.EXTENSION_HOOKS)")


def test_builtin_hooks_are_hooks_the_base_declares():
    assert all(callable(getattr(Strategy, hook, None)) for hook in Strategy.EXTENSION_HOOKS)
    invented = sorted({f"{klass.__qualname__}.{attr}"
                       for cls in _builtin_classes().values() for klass in _below_strategy(cls)
                       for attr in vars(klass)
                       if attr.startswith("_") and attr.endswith("_impl") and attr not in Strategy.EXTENSION_HOOKS})
    assert not invented, f"{invented} are no hooks of Strategy: the base never calls them"


def _start(name: str, fabric: LocalFabric, cluster: ClusterSpec, task: str):
    """Task ``task``'s strategy; a serving task's constructor returns when it stops serving."""
    options = {} if name == "mirrored" else {"exit_after_serving": False}
    return _builtin_classes()[name]("local", cluster=cluster, task=task, **options,
                                    transport_options={"fabric": fabric, "timeout": 20, "secret": b"api-test"})


@pytest.fixture(params=BUILTINS)
def driver(request):
    """The driving task's strategy of a built-in, its serving tasks in threads (reaped after)."""
    name = request.param
    spec, serving, task = WORLDS[name]
    cluster, fabric = ClusterSpec(spec), LocalFabric()
    errors: list = []

    def serve(served_task: str) -> None:
        try:
            _start(name, fabric, cluster, served_task)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(t,), daemon=True) for t in serving]
    for thread in threads:
        thread.start()
    strategy = None
    try:
        strategy = _start(name, fabric, cluster, task)
        if name == "parameter_server":
            # The serving worker joins in its own time: a step run through it means it has joined, so that
            # the shutdown at the end reaches it (a worker that comes after its coordinator closed is
            # told its peer is gone, which would fail the fixture, not the test).
            assert strategy.schedule(_step, args=(np.ones((2, 2)),)).fetch(timeout=20) == 4.0
        yield strategy
    finally:
        if strategy is not None:
            strategy.shutdown()
        for thread in threads:
            thread.join(30)
    assert not any(t.is_alive() for t in threads), f"{name}: a serving task did not end"
    assert not errors, errors


def _step(x):
    return float(np.sum(x))


def test_run_validates_its_arguments_alike_under_every_strategy(driver):
    """parameter_server's run() skipped the base's checks, in_graph's copied some of them."""
    with pytest.raises(TypeError, match="run\\(\\) needs a callable step function, got int"):
        driver.run(42)
    with pytest.raises(TypeError, match="args must be a tuple of positional arguments, e.g. args=\\(x,\\), got int"):
        driver.run(_step, args=5)
    with pytest.raises(TypeError, match="kwargs must be a dict of keyword arguments.*got list"):
        driver.run(_step, args=(np.ones((2, 2)),), kwargs=[("x", 1)])


def test_a_shut_down_strategy_refuses_every_public_method(driver):
    driver.shutdown()
    driver.shutdown()                                    # idempotent
    for call in (lambda: driver.run(_step, args=(np.ones((2, 2)),)), lambda: driver.reduce("sum", 1.0),
                 lambda: driver.distribute_dataset([np.ones((2, 2))]), lambda: driver.save("unused"),
                 lambda: driver.restore("unused")):
        with pytest.raises(Exception, match="was shut down; create a new strategy"):
            call()
