"""Every cross-reference in the library's docstrings (``:func:``, ``:mod:``, ``:class:``, ``:meth:``,
``:attr:``, ``:exc:``, ``:data:``, ``:obj:``) names something that exists.

A reference resolves as Sphinx would look it up: a dotted name from the top (``stratagem.x.y``), a
relative module (``.base``: the module's package, then the packages above), or a name seen from the
module (its globals, a class of the module and that class's attributes, the builtins, a module of the
same package). An instance attribute (``:attr:`lock```) resolves where a class of the module assigns
``self.lock`` or declares it as a field.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import pkgutil
import re
import sys

import pytest

import stratagem
from test_docstrings import SCRIPTS     # scripts inside the package: importing one runs it

ROLE = re.compile(r":(func|mod|class|meth|attr|exc|data|obj):`~?([^`<>]+?)`")


def _importable(name: str) -> bool:
    return name not in SCRIPTS and not name.endswith("__main__")


def _walk(obj, parts):
    for part in parts:
        obj = getattr(obj, part)
    return obj


def _absolute(target: str) -> bool:
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if not _importable(name):
            return True
        if i == 1 and name not in sys.modules:
            return False   # a bare name is one seen from the module, never a module to import (a script could run)
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        try:
            _walk(module, parts[i:])
            return True
        except AttributeError:
            return False
    return False


def _packages_around(module) -> list[str]:
    name = module.__name__
    found = [name] if hasattr(module, "__path__") else []
    while "." in name:
        name = name.rsplit(".", 1)[0]
        found.append(name)
    return found


def _declares(cls, attr: str) -> bool:
    """``cls`` (or a base of ours) assigns ``self.attr`` or declares ``attr`` as a field."""
    for klass in cls.__mro__:
        if attr in getattr(klass, "__annotations__", {}) or attr in getattr(klass, "__slots__", ()):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\s*(:[^=]+)?=", source):
            return True
    return False


def _seen_from(module, target: str) -> bool:
    head, *rest = target.split(".")
    candidates = []
    if hasattr(module, head):
        candidates.append(getattr(module, head))
    if hasattr(builtins, head):
        candidates.append(getattr(builtins, head))
    classes = [v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == module.__name__]
    candidates += [getattr(c, head) for c in classes if hasattr(c, head)]
    package = sys.modules.get(module.__name__.rsplit(".", 1)[0])
    for info in pkgutil.iter_modules(getattr(package, "__path__", []), prefix=package.__name__ + "."):
        if _importable(info.name):
            sibling = importlib.import_module(info.name)
            if head in vars(sibling):
                candidates.append(vars(sibling)[head])
    for obj in candidates:
        try:
            _walk(obj, rest)
            return True
        except AttributeError:
            pass
    # An instance attribute: ``Class.attr`` or, inside the class, ``attr``.
    owners = [getattr(module, head)] if rest and inspect.isclass(getattr(module, head, None)) else classes
    attr = rest[-1] if rest else head
    return len(rest) <= 1 and any(_declares(cls, attr) for cls in owners)


def resolves(module, target: str) -> bool:
    target = target.strip().removesuffix("()")
    if target.startswith("."):
        return any(_absolute(package + target) for package in _packages_around(module))
    return _absolute(target) or _seen_from(module, target)


MODULES = ["stratagem"] + sorted(
    info.name for info in pkgutil.walk_packages(stratagem.__path__, prefix="stratagem.")
    if _importable(info.name)
)


@pytest.mark.parametrize("name", MODULES)
def test_every_docstring_reference_resolves(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"{name} needs what is not installed here: {exc}")
    broken = [
        f"line {number}: :{role}:`{target}`"
        for number, line in enumerate(inspect.getsource(module).splitlines(), 1)
        for role, target in ROLE.findall(line)
        if not resolves(module, target)
    ]
    assert not broken, f"{name}: references to names that do not exist: " + "; ".join(broken)


def test_a_reference_to_a_missing_name_is_caught():
    module = importlib.import_module("stratagem.collectives.communicator")
    assert resolves(module, "stratagem.collectives.algorithms")
    assert resolves(module, "Communicator.allreduce")
    assert not resolves(module, "stratagem.core.collectives")
    assert not resolves(module, "Communicator.no_such_method")
