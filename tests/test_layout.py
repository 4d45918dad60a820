"""The package layout: the import contracts hold (import-linter, imports inside functions included) and
the README's map names every package and module of the tree."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "stratagem"


def test_the_import_contracts_hold():
    """Layers, strategies kept off the transports, no cycle at any level: see pyproject.toml."""
    command = shutil.which("lint-imports")
    if command is None:
        pytest.fail("lint-imports not found: pip install -e '.[test]' installs import-linter")
    done = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _readme_map() -> dict[str, str]:
    """``{"strategies/ps/": "base (what both share) · ...", "": "...", ...}`` from the README's Layout block."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines()[1:]:
        match = re.match(r"^  (\S+/)\s+(.*)$", line)
        top = re.match(r"^  ((?:[\w.]+\.py,? ?)+)\s+(.*)$", line)
        if match and not line.startswith("   "):
            current = match.group(1)
            entries[current] = match.group(2)
        elif top and not line.startswith("   "):
            current = ""
            entries[""] = entries.get("", "") + " " + top.group(1) + " " + top.group(2)
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_the_readme_map_names_every_package_and_module():
    entries = _readme_map()
    missing = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        package = init.parent.relative_to(PACKAGE).as_posix()
        key = "" if package == "." else package + "/"
        if key not in entries:
            missing.append(f"package {key or 'stratagem'} has no line")
            continue
        for module in sorted(init.parent.glob("*.py")):
            name = module.stem
            if name == "__init__":
                continue
            if not re.search(rf"(?<![\w/]){re.escape(name)}(?:\.py)?(?!\w)", entries[key]):
                missing.append(f"{key}{name}.py is not named on the {key or 'top-level'} line")
    stale = [key for key in entries if key and not (PACKAGE / key / "__init__.py").exists()]
    assert not missing and not stale, (
        "README.md's Layout does not match src/stratagem: " + "; ".join(missing + [f"{k} does not exist" for k in stale])
    )


def test_core_imports_nothing_above_it_even_lazily():
    """A direct check of the rule the layers contract states, for the layer everything stands on: no module
    of stratagem.core names another stratagem package, at the top or inside a function."""
    offenders = []
    for path in sorted((PACKAGE / "core").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = re.search(r"^\s*(?:from|import)\s+stratagem\.(\w+)", line)
            if found and found.group(1) not in ("core", "_version"):
                offenders.append(f"core/{path.name}:{number}: {line.strip()}")
    assert not offenders, offenders


def _sources():
    package = ROOT / "src" / "stratagem"
    for path in sorted(package.rglob("*.py")):
        yield path.relative_to(package), ast.parse(path.read_text(), str(path))


def test_only_the_collective_session_numbers_calls():
    """A collective's number (``seq``) is written by ``collectives/session.py`` alone: a native
    collective declines before it runs instead of taking a number back."""
    writes = [f"{rel}:{node.lineno}" for rel, tree in _sources() for node in ast.walk(tree)
              if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Attribute) and target.attr == "seq"]
    assert writes and all(w.startswith("collectives/session.py:") for w in writes), writes


def test_no_module_imports_a_private_name_of_another_package():
    reach_ins = []
    for rel, tree in _sources():
        package = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stratagem."):
                other = node.module.split(".")[1]
                reach_ins += [f"{rel}:{node.lineno}: {node.module}.{alias.name}" for alias in node.names
                              if alias.name.startswith("_") and not alias.name.startswith("__") and other != package]
    assert not reach_ins, reach_ins


#: Private names of objects that are not ours, reached on purpose (what the check reports: the
#: expression as written, ``getattr(x, "_y")`` counting as ``x._y``), and why each is fine.
NOT_OURS = {
    # The os module's documented way to end a process without exit callbacks (mpi ranks after a failure).
    "os._exit",
    # torch's base class of every BatchNorm: SyncBatchNorm subclasses it, and converts any of them.
    "torch.nn.modules.batchnorm._BatchNorm",
    # Python's hook that runs before the interpreter joins executor threads (core/lifecycle.py's doc).
    "threading._register_atexit",
    # importlib.metadata's path of a distribution whose METADATA is missing (a message only; '?' if absent).
    "dist._path",
    # The import system's flag of a module still being imported (as importlib itself reads it).
    "getattr(module, '__spec__', None)._initializing",
}
#: A namedtuple's public API is spelt with one underscore (so as not to clash with its fields).
NAMEDTUPLE_API = {"_asdict", "_fields", "_replace", "_make", "_field_defaults"}


def _private_reach_ins(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, expression)`` of every use of another object's private name in ``tree``: an attribute
    with one leading underscore whose owner is not ``self``, ``cls`` or ``super()``, read, written or
    named as a string to ``getattr``/``hasattr``/``setattr``/``delattr``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            owner, name = node.args[0], node.args[1].value
        else:
            continue
        if not name.startswith("_") or name.startswith("__") or name in NAMEDTUPLE_API:
            continue
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        expression = f"{ast.unparse(owner)}.{name}"
        if expression not in NOT_OURS:
            found.append((node.lineno, expression))
    return found


def test_no_object_touches_another_objects_private_names():
    """Objects reach each other through their public names only (``self._x``, ``cls._x`` and
    ``super()._x`` are their own): a helper gets a narrow collaborator (the callbacks it needs, or an
    object with public methods) rather than its owner's private state (DESIGN.md, section 1)."""
    reach_ins = [f"{rel}:{line}: {expression}" for rel, tree in _sources()
                 for line, expression in sorted(_private_reach_ins(tree))]
    assert not reach_ins, f"{len(reach_ins)} reach-ins into other objects' private names:\n" + "\n".join(reach_ins)


def test_the_check_sees_every_form_of_reach_in():
    """The check above finds what it should and leaves alone what it should (a check that finds
    nothing would pass as well)."""
    tree = ast.parse("os._exit(1)\nother._x\nself._y\nsuper()._z\ngetattr(o, '_w', None)\nrow._asdict()\n"
                     "setattr(o, '_v', 1)\nobj.__dict__\ngetattr(o, 'public')\ncls._u\n")
    assert _private_reach_ins(tree) == [(2, "other._x"), (5, "o._w"), (7, "o._v")]
