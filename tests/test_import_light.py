"""``import stratagem`` and ``stratagem --help`` stay light: no transport library, no plugin, no entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

#: Modules that importing the package (or building the CLI parser) must not pull in.
HEAVY = ["grpc", "mpi4py", "cupy", "torch", "jax", "zmq", "ray", "kubernetes", "stratagem.transports.zmq.transport",
         "stratagem.plugins.manager", "stratagem.strategies.base"]

PROBE = """
import json, sys
import pluggy
calls = []
original = pluggy.PluginManager.load_setuptools_entrypoints
def spy(self, *args, **kwargs):
    calls.append(args)
    return original(self, *args, **kwargs)
pluggy.PluginManager.load_setuptools_entrypoints = spy
before = set(sys.modules)
{action}
new = set(sys.modules) - before
heavy = {heavy!r}
loaded = sorted(m for m in new if any(m == h or m.startswith(h + ".") for h in heavy))
print(json.dumps({{"loaded": loaded, "entry_point_loads": len(calls),
                  "metadata_imported": "importlib.metadata" in new}}))
"""


def _probe(action: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "STRATAGEM_DISABLE_PLUGIN_AUTOLOAD"}
    code = PROBE.format(action=textwrap.dedent(action), heavy=HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_stratagem_is_light():
    result = _probe("import stratagem")
    assert result["loaded"] == []
    assert result["entry_point_loads"] == 0
    assert result["metadata_imported"] is False  # no entry point was even read


def test_plugin_author_imports_are_light():
    result = _probe("from stratagem.plugins import PluginSpec, hookimpl")
    assert result["loaded"] == [] and result["entry_point_loads"] == 0


def test_the_ray_engine_is_light_until_used():
    """``stratagem.ray`` is the engine module; Ray itself is imported only when a job runs."""
    result = _probe("import stratagem; stratagem.ray.run")
    assert result["loaded"] == [] and result["entry_point_loads"] == 0


def test_building_the_cli_is_light():
    result = _probe("from stratagem.cli import build_parser; build_parser()")
    assert result["loaded"] == [] and result["entry_point_loads"] == 0


@pytest.mark.parametrize("command", [[sys.executable, "-m", "stratagem"], ["stratagem"]], ids=["module", "script"])
def test_help_works(command):
    if command == ["stratagem"]:
        script = shutil.which("stratagem") or os.path.join(os.path.dirname(sys.executable), "stratagem")
        if not os.path.exists(script):
            pytest.skip("the stratagem console script is not installed next to this interpreter")
        command = [script]
    proc = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "info" in proc.stdout and "usage: stratagem" in proc.stdout
