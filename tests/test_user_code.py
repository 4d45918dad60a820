"""Functions named by a peer are looked up only in the user's own code (never stdlib, packages, stratagem)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stratagem.core import user_code
from stratagem.core.errors import ConfigurationError
from stratagem.strategies.ps.functions import FunctionNotFound, resolve_by_name


@pytest.mark.parametrize("module, name", [
    ("os", "system"), ("subprocess", "run"), ("builtins", "exec"), ("shutil", "rmtree"),
    ("numpy", "save"), ("stratagem.launch.launcher", "launch"), ("antigravity", "geohash"),
])
def test_a_peer_cannot_name_library_functions(module, name):
    imported_before = module in sys.modules
    with pytest.raises(FunctionNotFound, match="own code|refuses"):
        resolve_by_name({"kind": "name", "module": module, "qualname": name}, "worker:1")
    if not imported_before:
        assert module not in sys.modules  # refused before importing anything


def test_a_user_module_function_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_steps.py").write_text("def step(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_by_name({"kind": "name", "module": "my_steps", "qualname": "step"}, "worker:1")
    assert fn(1) == 2


def test_a_library_function_reexported_by_user_code_is_refused(tmp_path, monkeypatch):
    (tmp_path / "sneaky.py").write_text("from os import system\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FunctionNotFound, match="'posix'|'os'|own code"):
        resolve_by_name({"kind": "name", "module": "sneaky", "qualname": "system"}, "worker:1")


def test_user_code_rules():
    assert user_code.is_user_module(sys.modules[__name__]) is (not str(Path(__file__)).startswith(tuple(user_code.installation_roots())))
    with pytest.raises(ConfigurationError, match="own code"):
        user_code.check_importable_user_module("json.decoder")
    with pytest.raises(ConfigurationError, match="cannot be found"):
        user_code.check_importable_user_module("definitely_not_a_module_xyz")
