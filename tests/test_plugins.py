"""The plugin host: hooks, the registry, ``stratagem info``, the Strategy base, a real third-party plugin.

The third-party plugin (tests/plugin_pkg, dist ``stratagem-example-plugin``) is pip-installed for the
session into a private directory (``pip install --target``) that only this session's child
interpreters and a few in-process tests put on their path, and removed at its end. Installing into
the shared site-packages instead would change what every other process using this interpreter
loads, and concurrent sessions' installs and uninstalls would race (pip leaves ``~``-prefixed stashes
whose stale entry points then break everyone's registry).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ClusterSpec, ConfigurationError, IncompatibleError, PluginError, StratagemError, TaskId
from stratagem.strategies.base import Strategy, check_compatible
from stratagem.plugins import PluginSpec, hookimpl
from stratagem.plugins import builtin
from stratagem.plugins import report as info_report
from stratagem.core.options import TRANSPORT_ENV, constructor_options
from stratagem.plugins.manager import (
    DISABLE_AUTOLOAD_ENV, PluginManager, autoload_disabled, plugin_manager, reset_plugin_manager, transport_or_default,
)
from stratagem.transports.local import LocalFabric, LocalTransport

PLUGIN_DIR = Path(__file__).parent / "plugin_pkg"
PLUGIN_DIST = "stratagem-example-plugin"
PLUGIN_SOURCE = "stratagem-example-plugin 0.1.0"
#: Variables that would change what a child interpreter resolves or loads.
_ENV_TO_CLEAR = ("STRATAGEM_CONFIG", "TF_CONFIG", "STRATAGEM_SECRET", "STRATAGEM_NUM_PS", "STRATAGEM_TRANSPORT",
                 DISABLE_AUTOLOAD_ENV,
                 "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
ONE_WORKER = ClusterSpec({"worker": ["local:0"]})
#: What the built-in plugin registers, read from it (the set grows as strategies and transports land).
BUILTIN_TRANSPORTS = sorted(spec.name for spec in builtin.stratagem_add_transports())
BUILTIN_STRATEGIES = sorted(spec.name for spec in builtin.stratagem_add_strategies())
TWO_WORKERS = ClusterSpec({"worker": ["local:0", "local:1"]})


# -- helpers -------------------------------------------------------------------------------------------
_PLUGIN_PATH: list[str] = []  # the session's install directory, once the fixture has made it


def _child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_TO_CLEAR}
    if _PLUGIN_PATH:
        env["PYTHONPATH"] = os.pathsep.join([*_PLUGIN_PATH, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"],
        capture_output=True, text=True, timeout=180, env=_child_env(),
    )


def _python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=_child_env(**env))


def _info_json(tmp_path: Path, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "stratagem", "info", "--json"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=_child_env(**env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _row(data: dict, kind: str, name: str) -> dict | None:
    return next((r for r in data["plugins"] if r["kind"] == kind and r["name"] == name), None)


def _fake_dist(root: Path, dist: str, entry_points: str) -> Path:
    """A hand-made installed distribution (just its .dist-info) declaring ``entry_points``."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return root


@pytest.fixture(scope="session")
def example_plugin(tmp_path_factory):
    """pip-install tests/plugin_pkg (a real build and install) into a fresh private directory.

    Child interpreters get it on PYTHONPATH (see ``_child_env``); nothing outside the session sees it.
    Returns the directory.
    """
    target = tmp_path_factory.mktemp("site")
    proc = _pip("install", "--no-deps", "--no-build-isolation", "--target", str(target), str(PLUGIN_DIR))
    if proc.returncode != 0:
        pytest.fail(f"could not install the example plugin:\n{proc.stdout}\n{proc.stderr}")
    assert (target / "stratagem_example_plugin-0.1.0.dist-info" / "entry_points.txt").is_file()
    _PLUGIN_PATH.append(str(target))
    yield target
    _PLUGIN_PATH.remove(str(target))
    shutil.rmtree(target, ignore_errors=True)


@pytest.fixture
def manager():
    """A test-local registry: built-ins only, no entry points."""
    return PluginManager(autoload=False)


@pytest.fixture
def global_manager(manager):
    """Make ``manager`` the process's registry for one test (what stratagem.strategy() uses)."""
    previous = reset_plugin_manager(manager)
    yield manager
    reset_plugin_manager(previous)


class FakeTransport(LocalTransport):
    """A transport class for test-local registrations."""

    name = "fake"

    def __init__(self, cluster, task, *, fabric=None, colour: str = "blue", **common):
        super().__init__(cluster, task, fabric=fabric or LocalFabric(), **common)
        self.colour = colour


class Picky(Strategy):
    """Refuses in-process transports; has one option."""

    name = "picky"
    options = {"alpha": 1.0}

    @classmethod
    def supports(cls, transport_class):
        if transport_class.in_process:
            return "it needs one process per task; use transport='zmq'"
        return None


class Adds:
    """A runtime plugin providing what it is given."""

    def __init__(self, transports=(), strategies=()):
        self.transports, self.strategies = transports, strategies

    @hookimpl
    def stratagem_add_transports(self):
        return self.transports

    @hookimpl
    def stratagem_add_strategies(self):
        return self.strategies


# -- the third-party plugin, installed for real --------------------------------------------------------
def test_info_lists_third_party_plugin_with_its_source(example_plugin, tmp_path):
    data = _info_json(tmp_path)
    assert data["autoload"] is True
    loopback, solo = _row(data, "transport", "loopback"), _row(data, "strategy", "solo")
    assert loopback is not None and solo is not None, data["plugins"]
    assert loopback["source"] == solo["source"] == PLUGIN_SOURCE
    assert loopback["usable"] and solo["usable"]
    assert loopback["target"] == "stratagem_example_plugin.loopback:LoopbackTransport"
    assert _row(data, "transport", "local")["source"] == "builtin"
    assert _row(data, "transport", "zmq")["source"] == "builtin"
    assert PLUGIN_SOURCE in data["sources"].values()

    table = subprocess.run([sys.executable, "-m", "stratagem", "info"], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env=_child_env(COLUMNS="200"))
    assert table.returncode == 0, table.stderr
    assert "loopback" in table.stdout and "solo" in table.stdout and PLUGIN_SOURCE in table.stdout


def test_third_party_strategy_runs_a_step_over_third_party_transport(example_plugin, tmp_path):
    proc = _python("""
        import json, numpy as np, stratagem
        from stratagem.core.transport import Message
        out = {}
        with stratagem.strategy("solo", transport="loopback", verbose=True) as strategy:
            out["strategy"] = type(strategy).__module__ + "." + type(strategy).__name__
            out["transport"] = type(strategy.transport).__name__
            with strategy.scope():
                w = np.ones(3)
            loss = strategy.run(lambda x: float(np.sum(w * x)), args=(np.arange(3.0),))
            out["loss"] = strategy.reduce("mean", loss)
            out["steps"], out["chief"], out["replicas"] = strategy.steps, strategy.is_chief, strategy.num_replicas_in_sync
            strategy.transport.send(strategy.task, "echo", Message({"n": 7}, [np.arange(2)]))
            got = strategy.transport.recv(strategy.task, "echo", timeout=5)
            out["echo"] = [got.meta["n"], got.buffers[0].tolist()]
        try:
            stratagem.strategy("solo", transport="zmq")
        except stratagem.IncompatibleError as exc:
            out["incompatible"] = str(exc)
        print(json.dumps(out))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "solo: step 1 on /job:worker/task:0" in proc.stdout
    assert out["strategy"] == "stratagem_example_plugin.solo.SoloStrategy"
    assert out["transport"] == "LoopbackTransport"
    assert out["loss"] == 3.0 and out["steps"] == 1 and out["chief"] is True and out["replicas"] == 1
    assert out["echo"] == [7, [0, 1]]
    assert "strategy 'solo' cannot run over transport 'zmq'" in out["incompatible"]


def test_third_party_compressor_is_listed_and_compresses_a_mirrored_all_reduce(example_plugin, tmp_path):
    sign = _row(_info_json(tmp_path), "compressor", "sign")
    assert sign is not None and sign["source"] == PLUGIN_SOURCE and sign["usable"], sign
    proc = _python("""
        import json, threading, numpy as np, stratagem
        from stratagem.core.cluster import ClusterSpec
        from stratagem.transports.local import LocalFabric
        cluster, fabric, out = ClusterSpec({"worker": ["local:0", "local:1"]}), LocalFabric(), {}
        def replica(i):
            s = stratagem.strategy("mirrored", transport="local", cluster=cluster, task=f"worker:{i}",
                                   transport_options={"fabric": fabric, "timeout": 30}, compression="sign")
            with s.scope():
                w = stratagem.Variable(np.zeros(4, np.float32), name="w")
                opt = stratagem.optimizers.SGD(learning_rate=1.0)
            opt.apply_gradients([(np.array([1.0, -3.0, 2.0, 2.0], np.float32) * (i + 1), w)])
            out[i] = [type(s.compressor).__module__, w.value.tolist()]
            s.shutdown()
        threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
        [t.start() for t in threads]; [t.join(60) for t in threads]
        print(json.dumps(out))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # each replica sends the signs of its share of the mean gradient and their mean magnitude (1, then 2):
    # the sum is 3 x the signs
    assert out["0"] == out["1"] == ["stratagem_example_plugin.sign", [-3.0, 3.0, -3.0, -3.0]]


def test_autoload_disabled_hides_third_party_plugin(example_plugin, tmp_path):
    data = _info_json(tmp_path, **{DISABLE_AUTOLOAD_ENV: "1"})
    assert data["autoload"] is False
    assert _row(data, "transport", "loopback") is None and _row(data, "strategy", "solo") is None
    assert _row(data, "transport", "local") is not None
    proc = _python("""
        import stratagem
        try:
            stratagem.strategy("solo", transport="loopback")
        except stratagem.PluginError as exc:
            print(exc)
    """, tmp_path, **{DISABLE_AUTOLOAD_ENV: "1"})
    assert proc.returncode == 0, proc.stderr
    assert f"unknown strategy 'solo'; known: {', '.join(BUILTIN_STRATEGIES) or 'none'}" in proc.stdout


def test_listing_imports_no_plugin_module(example_plugin, tmp_path):
    proc = _python("""
        import sys
        from stratagem.plugins.report import report
        data = report()
        assert any(r["name"] == "loopback" for r in data["plugins"]), data
        loaded = [m for m in ("stratagem.transports.zmq.transport", "zmq", "stratagem.transports.local",
                              "stratagem_example_plugin.loopback", "stratagem_example_plugin.solo",
                              "stratagem.strategies.base") if m in sys.modules]
        print(loaded)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# -- the registry ----------------------------------------------------------------------------------------
def test_builtins_only_without_autoload(manager):
    assert manager.autoload is False
    assert manager.names("transport") == BUILTIN_TRANSPORTS
    assert manager.names("strategy") == BUILTIN_STRATEGIES
    assert {"local", "zmq"} <= set(BUILTIN_TRANSPORTS)
    assert manager.source("transport", "local") == "builtin"
    assert manager.sources() == {"stratagem.builtin": "builtin"}
    assert manager.transport_class("local") is LocalTransport


@pytest.mark.parametrize("value, disabled", [("1", True), ("yes", True), ("", False), ("0", False), ("false", False)])
def test_autoload_env_variable(monkeypatch, value, disabled):
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, value)
    assert autoload_disabled() is disabled
    if disabled:
        assert PluginManager().autoload is False
    assert PluginManager(autoload=True).autoload is True  # the argument wins


def test_unknown_names_list_known_ones(manager):
    with pytest.raises(PluginError) as info:
        manager.transport_class("zmqq")
    known = ", ".join(BUILTIN_TRANSPORTS)
    assert str(info.value) == f"unknown transport 'zmqq'; known: {known} (did you mean 'zmq'?)"
    with pytest.raises(PluginError, match=rf"unknown strategy 'local'; known: {', '.join(BUILTIN_STRATEGIES) or 'none'} "
                                          r"\('local' is a transport, not a strategy\)"):
        manager.strategy_class("local")
    with pytest.raises(PluginError, match=f"unknown transport 'nope'; known: {known}$"):
        manager.create_transport("nope", ONE_WORKER, "worker:0")
    with pytest.raises(ConfigurationError, match="unknown plugin kind"):
        manager.names("optimizer")


def test_unusable_plugin_reason_and_install_hint(manager):
    manager.register(Adds(transports=[
        PluginSpec("pigeon", "stratagem_pigeon.transport:PigeonTransport", "transport",
                   requires=("definitely_missing_module",), install_hint="pip install 'stratagem[pigeon]'"),
        PluginSpec("ghost", "definitely_missing_package.ghost:Ghost", "transport", description="no hint"),
    ]), "extra", source="tests")
    expected = ("transport 'pigeon' is not usable here: No module named 'definitely_missing_module'. "
                "Install it with: pip install 'stratagem[pigeon]'")
    with pytest.raises(PluginError) as info:
        manager.transport_class("pigeon")
    assert str(info.value) == expected
    with pytest.raises(PluginError, match="not usable here"):
        manager.create_transport("pigeon", ONE_WORKER, "worker:0")
    with pytest.raises(PluginError, match=r"No module named 'definitely_missing_package'\. \(provided by tests\)"):
        manager.transport_class("ghost")
    rows = {row.name: row for row in manager.describe()}
    assert rows["pigeon"].usable is False and rows["pigeon"].source == "tests"
    assert rows["pigeon"].reason == "No module named 'definitely_missing_module'"
    assert rows["pigeon"].install_hint == "pip install 'stratagem[pigeon]'"
    assert rows["local"].usable is True and rows["local"].reason is None and rows["local"].install_hint is None
    assert manager.usable("transport", "pigeon") == rows["pigeon"].reason
    assert manager.usable("transport", "local") is None


def test_check_usable_runs_at_creation_and_with_check():
    class NoDevice(FakeTransport):
        @classmethod
        def check_usable(cls):
            raise PluginError("no GPU visible. Install it with: pip install 'stratagem[gpu]'")

    pm = PluginManager(autoload=False)
    pm.register(Adds(transports=[PluginSpec("gpu", NoDevice, "transport")]), "gpu", source="tests")
    assert pm.transport_class("gpu") is NoDevice
    assert {r.name: r.usable for r in pm.describe()}["gpu"] is True  # cheap listing: modules only
    deep = {r.name: r for r in pm.describe(check=True)}
    assert deep["gpu"].usable is False and "no GPU visible" in deep["gpu"].reason
    assert deep["local"].usable is True
    with pytest.raises(PluginError, match="no GPU visible"):
        pm.create_transport("gpu", ONE_WORKER, "worker:0")


def test_duplicate_plugin_name_names_both_sources(manager):
    manager.register(Adds(transports=[PluginSpec("local", FakeTransport, "transport")]), "dup", source="dup-dist 2.0")
    with pytest.raises(PluginError) as info:
        manager.names("transport")
    message = str(info.value)
    assert "transport 'local' is provided twice" in message
    assert "by builtin (stratagem.transports.local:LocalTransport)" in message
    assert "by dup-dist 2.0 (test_plugins:FakeTransport)" in message
    assert DISABLE_AUTOLOAD_ENV in message
    manager.unregister("dup")
    assert manager.names("transport") == BUILTIN_TRANSPORTS


def test_duplicate_strategy_between_two_plugins(manager):
    manager.register(Adds(strategies=[PluginSpec("picky", Picky, "strategy")]), "one", source="one 1.0")
    manager.register(Adds(strategies=[PluginSpec("picky", Picky, "strategy")]), "two", source="two 1.0")
    with pytest.raises(PluginError, match=r"strategy 'picky' is provided twice: by one 1\.0 .* and by two 1\.0"):
        manager.strategy_class("picky")


def test_bad_hook_results_are_reported_with_their_source(manager):
    manager.register(Adds(transports=PluginSpec("x", FakeTransport, "transport")), "bad", source="bad-dist 1")
    with pytest.raises(PluginError, match=r"stratagem_add_transports\(\) of bad-dist 1 must return a list of PluginSpec"):
        manager.names("transport")
    manager.unregister("bad")
    manager.register(Adds(transports=[PluginSpec("p", Picky, "strategy")]), "wrongkind", source="wk 1")
    with pytest.raises(PluginError, match=r"returned the strategy 'p'; return it from stratagem_add_strategies\(\)"):
        manager.names("strategy")
    manager.unregister("wrongkind")
    manager.register(Adds(transports=[PluginSpec("notatransport", Picky, "transport")]), "nt", source="nt 1")
    with pytest.raises(PluginError, match="not a subclass of stratagem.core.transport.Transport"):
        manager.transport_class("notatransport")


def test_misspelt_hook_is_reported(manager):
    class Typo:
        @hookimpl
        def stratagem_add_transport(self):  # missing 's'
            return []

    manager.register(Typo(), "typo", source="typo-dist 1")
    with pytest.raises(PluginError, match="typo-dist 1: .*stratagem_add_transport.*misspelt"):
        manager.names("transport")


def test_third_party_plugin_in_process(example_plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(example_plugin))
    pm = PluginManager(autoload=True)
    assert pm.names("transport") == sorted([*BUILTIN_TRANSPORTS, "loopback"])
    assert pm.names("strategy") == sorted([*BUILTIN_STRATEGIES, "solo"])
    assert pm.source("strategy", "solo") == PLUGIN_SOURCE and pm.load_errors == {}
    assert pm.sources()["example"] == PLUGIN_SOURCE
    with pm.create_strategy("solo", transport="loopback") as strategy:
        assert strategy.run(lambda: 1) == 1 and strategy.steps == 1
    with pytest.raises(ConfigurationError, match="it accepts: cluster, gradient_reduction, plugins, task, transport_options, verbose"):
        pm.create_strategy("solo", transport="loopback", verbos=True)
    assert PluginManager(autoload=False).names("strategy") == BUILTIN_STRATEGIES


def test_broken_entry_point_is_reported_not_fatal(tmp_path, monkeypatch):
    _fake_dist(tmp_path, "broken-plugin", "[stratagem]\nbroken = definitely_missing_plugin_module\n")
    _fake_dist(tmp_path, "clash-plugin", "[stratagem]\nbroken = another_missing_module\n")
    _fake_dist(tmp_path, "taken-plugin", "[stratagem]\nstratagem.builtin = another_missing_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning) as record:
        pm = PluginManager(autoload=True)
    messages = " | ".join(str(w.message) for w in record)
    # which of the two is found first depends on the file system; one fails, the other clashes
    assert "failed to load: ModuleNotFoundError: No module named" in messages
    assert "the entry point 'broken' is also declared by" in messages and DISABLE_AUTOLOAD_ENV in messages
    assert pm.names("transport") == BUILTIN_TRANSPORTS  # the built-ins still work
    rows = {(r.name, r.source, r.usable) for r in pm.describe() if r.kind == "plugin"}
    assert rows == {("broken", "broken-plugin 1.0", False), ("broken", "clash-plugin 1.0", False),
                    ("stratagem.builtin", "taken-plugin 1.0", False)}
    assert "the plugin name 'stratagem.builtin' is already taken by builtin" in messages
    with pytest.raises(PluginError, match=r"unknown strategy 'solo'.*note: plugin 'broken' of .* failed to load"):
        pm.strategy_class("solo")


def test_plugin_spec_validation():
    with pytest.raises(PluginError, match="invalid plugin name"):
        PluginSpec("bad name", "a.b:C", "transport")
    with pytest.raises(PluginError, match="kind must be one of transport, strategy"):
        PluginSpec("x", "a.b:C", "optimizer")
    with pytest.raises(PluginError, match="is not 'package.module:Class'"):
        PluginSpec("x", "a.b.C", "transport")
    with pytest.raises(PluginError, match="target must be a class"):
        PluginSpec("x", 42, "transport")
    spec = PluginSpec("x", "stratagem.transports.local:NoSuchClass", "transport", requires="numpy")
    assert spec.requires == ("numpy",) and spec.missing() is None and spec.is_lazy
    with pytest.raises(PluginError, match="has no 'NoSuchClass'"):
        spec.load()
    assert PluginSpec("y", LocalTransport, "transport").target_path == "stratagem.transports.local:LocalTransport"


def test_plugin_manager_is_a_cached_singleton():
    previous = reset_plugin_manager()
    try:
        first = plugin_manager()
        assert plugin_manager() is first and stratagem.plugin_manager() is first
        assert reset_plugin_manager() is first
        assert plugin_manager() is not first
    finally:
        reset_plugin_manager(previous)


# -- creating transports ----------------------------------------------------------------------------------
def test_constructor_options_follow_kwargs_to_the_base():
    assert sorted(constructor_options(LocalTransport)) == ["fabric", "limits", "peer_timeout", "recorder", "secret",
                                                        "timeout"]
    assert sorted(constructor_options(FakeTransport)) == ["colour", "fabric", "limits", "peer_timeout", "recorder",
                                                          "secret", "timeout"]
    assert constructor_options(FakeTransport)["colour"] == "blue"


def test_unknown_transport_options_are_rejected_with_the_known_list(manager):
    with pytest.raises(ConfigurationError) as info:
        manager.create_transport("local", ONE_WORKER, "worker:0", fabrik=LocalFabric(), speed=3)
    assert str(info.value) == ("transport 'local' does not accept option(s) 'fabrik', 'speed' "
                               "(did you mean 'fabric'?); it accepts: fabric, limits, peer_timeout, recorder, secret, "
                               "timeout")


def test_create_transport_defaults_from_environment(manager, monkeypatch):
    for var in _ENV_TO_CLEAR:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                "task": {"type": "worker", "index": 1}}))
    monkeypatch.setenv("STRATAGEM_SECRET", "s3cret")
    t = manager.create_transport("local", fabric=LocalFabric())
    assert t.task == TaskId("worker", 1) and t.cluster.num_tasks("worker") == 2 and t.secret == b"s3cret"
    t = manager.create_transport("local", TWO_WORKERS, "worker:0", fabric=LocalFabric())
    assert t.cluster == TWO_WORKERS and t.secret == b"s3cret"  # the secret still comes from the environment
    t = manager.create_transport("local", TWO_WORKERS, "worker:0", fabric=LocalFabric(), secret=b"mine")
    assert t.secret == b"mine"
    t = stratagem.transport("local", TWO_WORKERS, "worker:1", fabric=LocalFabric())
    assert isinstance(t, LocalTransport) and t.task == TaskId("worker", 1)


# -- strategies ---------------------------------------------------------------------------------------------
def test_incompatible_strategy_and_transport_is_one_clear_error(manager):
    manager.register(Adds(strategies=[PluginSpec("picky", Picky, "strategy")]), "picky", source="tests")
    fabric = LocalFabric()
    with pytest.raises(IncompatibleError) as info:
        manager.create_strategy("picky", transport="local", cluster=ONE_WORKER, task="worker:0",
                                transport_options={"fabric": fabric})
    assert str(info.value) == ("strategy 'picky' cannot run over transport 'local': "
                               "it needs one process per task; use transport='zmq'")
    LocalTransport(ONE_WORKER, "worker:0", fabric=fabric).start()  # nothing was left running on the fabric
    with pytest.raises(IncompatibleError, match="strategy 'picky' cannot run over transport 'local'"):
        Picky(LocalTransport(ONE_WORKER, "worker:0", fabric=LocalFabric()))
    with pytest.raises(IncompatibleError):
        check_compatible(Picky, LocalTransport)


def test_unknown_strategy_options_are_rejected_with_the_known_list(manager):
    with pytest.raises(ConfigurationError) as info:
        Picky("zmq", plugins=manager, alpah=2)
    assert str(info.value) == ("strategy 'picky' does not accept option(s) 'alpah' (did you mean 'alpha'?); "
                               "it accepts: alpha, cluster, gradient_reduction, plugins, task, transport_options")


def test_strategy_base_single_replica(manager):
    fabric = LocalFabric()
    strategy = Strategy("local", cluster=ONE_WORKER, task="worker:0", transport_options={"fabric": fabric},
                        plugins=manager)
    with strategy:
        assert strategy.cluster == ONE_WORKER and strategy.task == TaskId("worker", 0)
        assert strategy.is_chief and strategy.num_replicas_in_sync == 1
        assert isinstance(strategy.transport, LocalTransport) and strategy.transport_name == "local"
        with strategy.scope() as scoped:
            assert scoped is strategy
        assert strategy.run(lambda a, b=0: a + b, args=(2,), kwargs={"b": 3}) == 5
        x = np.arange(3.0)
        reduced = strategy.reduce("SUM", x)
        assert reduced.tolist() == [0.0, 1.0, 2.0] and reduced is not x
        assert strategy.reduce("mean", 2.5) == 2.5
        with pytest.raises(ConfigurationError, match="unknown reduce op 'avg'; use one of: sum, mean, min, max, prod"):
            strategy.reduce("avg", 1.0)
        with pytest.raises(TypeError, match="args must be a tuple"):
            strategy.run(lambda a: a, args=1)
        assert "over 'local'" in repr(strategy)
    assert strategy.closed and fabric.gone(TaskId("worker", 0))  # the owned transport was closed
    with pytest.raises(StratagemError, match="was shut down"):
        strategy.run(lambda: None)
    strategy.shutdown()  # idempotent


def test_strategy_over_a_given_transport_does_not_close_it():
    cluster = ClusterSpec({"chief": ["local:0"], "worker": ["local:1"], "ps": ["local:2"]})
    fabric = LocalFabric()
    transport = LocalTransport(cluster, "worker:0", fabric=fabric)
    with Strategy(transport) as strategy:
        assert not strategy.is_chief and strategy.num_replicas_in_sync == 2
        assert strategy.transport is transport and strategy.transport_name == "local"
    assert not fabric.gone(transport.task)
    transport.close()
    with pytest.raises(ConfigurationError, match="differs from the transport's"):
        Strategy(LocalTransport(cluster, "worker:0", fabric=LocalFabric()), task="chief:0")
    with pytest.raises(ConfigurationError, match="transport_options apply only"):
        Strategy(LocalTransport(cluster, "worker:0", fabric=LocalFabric()), transport_options={"timeout": 1})
    with pytest.raises(ConfigurationError, match="transport must be a transport name"):
        Strategy(42)
    ps = LocalTransport(cluster, "ps:0", fabric=LocalFabric())
    with Strategy(ps) as strategy, pytest.raises(ConfigurationError, match="not a replica"):
        strategy.reduce("sum", 1.0)


def test_stratagem_strategy_uses_the_registry(global_manager):
    global_manager.register(Adds(strategies=[PluginSpec("base", Strategy, "strategy")]), "base", source="tests")
    with stratagem.strategy("base", transport="local", cluster=ONE_WORKER, task="worker:0",
                            transport_options=LocalTransport.world_options()) as strategy:
        assert type(strategy) is Strategy and strategy.run(lambda: 7) == 7
    with pytest.raises(PluginError, match="unknown strategy 'mirored'"):
        stratagem.strategy("mirored", transport="local")


def test_the_default_transport_comes_from_the_environment_and_an_explicit_one_wins(global_manager, monkeypatch):
    world = dict(cluster=ONE_WORKER, task="worker:0", transport_options=LocalTransport.world_options())
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert transport_or_default(None) == "zmq" and transport_or_default("grpc") == "grpc"
    monkeypatch.setenv(TRANSPORT_ENV, "local")                 # what `stratagem launch --transport local` does
    assert transport_or_default(None) == "local" and transport_or_default("grpc") == "grpc"
    with stratagem.strategy("mirrored", **world) as strategy:    # names no transport: gets the environment's
        assert strategy.transport_name == "local" and isinstance(strategy.transport, LocalTransport)
    with Strategy(**world) as strategy:                          # a strategy class used directly, too
        assert strategy.transport_name == "local"
    global_manager.register(Adds(strategies=[PluginSpec("picky", Picky, "strategy")]), "picky", source="tests")
    with pytest.raises(IncompatibleError, match="strategy 'picky' cannot run over transport 'local'"):
        stratagem.strategy("picky", **world)                     # checked against the environment's choice
    monkeypatch.setenv(TRANSPORT_ENV, "zqm")
    with pytest.raises(ConfigurationError) as info:
        stratagem.strategy("mirrored", **world)
    assert str(info.value).startswith("STRATAGEM_TRANSPORT='zqm' in the environment")
    assert "did you mean 'zmq'?" in str(info.value) and "pass transport= explicitly" in str(info.value)


def test_reduce_across_replicas_in_threads(manager):
    pytest.importorskip("stratagem.collectives.communicator")
    fabric = LocalFabric()
    strategies = [Strategy("local", cluster=TWO_WORKERS, task=f"worker:{i}", plugins=manager,
                           transport_options={"fabric": fabric, "timeout": 30}) for i in range(2)]
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def replica(i: int) -> None:
        try:
            s = strategies[i]
            results[i] = (s.reduce("sum", np.full(5, i + 1.0, np.float32)).tolist(), s.reduce("mean", float(i)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in strategies:
        s.shutdown()
    assert not errors, errors
    assert results[0] == results[1] == ([3.0] * 5, 0.5)


# -- stratagem info ----------------------------------------------------------------------------------------
def test_info_run_json_and_table(global_manager, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a narrow table would fold the install hint across lines
    global_manager.register(Adds(transports=[
        PluginSpec("pigeon", "stratagem_pigeon.transport:PigeonTransport", "transport",
                   requires=("definitely_missing_module",), install_hint="pip install 'stratagem[pigeon]'")]),
        "extra", source="tests")
    assert info_report.run(argparse.Namespace(json=True, check=False)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["stratagem"] == stratagem.__version__ and data["autoload"] is False
    pigeon = _row(data, "transport", "pigeon")
    assert pigeon == {"kind": "transport", "name": "pigeon", "source": "tests", "usable": False,
                      "reason": "No module named 'definitely_missing_module'",
                      "install_hint": "pip install 'stratagem[pigeon]'", "description": "",
                      "target": "stratagem_pigeon.transport:PigeonTransport"}
    assert info_report.run(argparse.Namespace(json=False, check=True)) == 0
    out = capsys.readouterr().out
    assert "pigeon" in out and "definitely_missing_module" in out and "pip install 'stratagem[pigeon]'" in out


def test_info_off_a_terminal_prints_every_reason_whole_at_80_columns(tmp_path):
    target = "definitely_missing_module_with_a_rather_long_name.plugin"
    _fake_dist(tmp_path, "some-distribution-with-a-long-name", f"[stratagem]\nbroken-entry-point = {target}\n")
    proc = subprocess.run([sys.executable, "-m", "stratagem", "info"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=_child_env(COLUMNS="80", PYTHONPATH=os.pathsep.join(
                              [str(tmp_path), os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("plugin "))
    assert row.split()[:4] == ["plugin", "broken-entry-point", "some-distribution-with-a-long-name", "1.0"]
    assert row.endswith(f"failed to load: ModuleNotFoundError: No module named "
                        f"'{target.partition('.')[0]}'"), row          # the whole reason, on its line
    assert "…" not in proc.stdout
    zmq = next(line for line in proc.stdout.splitlines() if line.startswith("transport ") and " zmq " in line)
    assert zmq.split()[:4] == ["transport", "zmq", "builtin", "yes"]


@pytest.mark.parametrize("args", [["info", "--json"], ["info"]])
def test_info_cut_short_by_its_reader_ends_quietly(args):
    """``stratagem info --json | head``: the reader is gone before the output is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)                 # as `head` does once it has its lines: every write now fails
    try:
        proc = subprocess.run([sys.executable, "-m", "stratagem", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60, env=_child_env())
    finally:
        os.close(write_end)
    assert proc.stderr == ""           # no BrokenPipeError traceback, no "Exception ignored"
    assert proc.returncode == 141      # 128 + SIGPIPE, as a shell reports `cat` killed by it


def test_errors_users_catch_are_exported_and_every_public_name_resolves():
    from stratagem.training.checkpoint import CheckpointError
    from stratagem.strategies.ps.coordinator import ClosureError
    from stratagem.ps_service.protocol import ShardLostError
    from stratagem.strategies.in_graph.client import ReplicaError

    for name in stratagem.__all__:
        assert getattr(stratagem, name) is not None, name
    assert {"ShardLostError", "ReplicaError", "ClosureError", "CheckpointError"} <= set(stratagem.__all__)
    assert stratagem.ShardLostError is ShardLostError and issubclass(ShardLostError, stratagem.PeerLostError)
    assert stratagem.ReplicaError is ReplicaError and stratagem.ClosureError is ClosureError
    assert stratagem.CheckpointError is CheckpointError
    assert all(issubclass(getattr(stratagem, n), stratagem.StratagemError)
               for n in ("ShardLostError", "ReplicaError", "ClosureError", "CheckpointError"))
    assert "ShardLostError" in dir(stratagem)


def test_info_reports_a_broken_registry_and_exits_1(global_manager, capsys):
    global_manager.register(Adds(transports=[PluginSpec("zmq", FakeTransport, "transport")]), "dup", source="dup 1")
    assert info_report.run(argparse.Namespace(json=True, check=False)) == 1
    assert "transport 'zmq' is provided twice" in capsys.readouterr().err
