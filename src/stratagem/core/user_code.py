"""What counts as *the user's own code*: where a function may be looked up by name for a peer.

Strategies that run step functions on other tasks (``in_graph``, ``parameter_server``) receive a
function's ``module:qualname`` from the network. Looking that up anywhere would let any peer that can
reach the port ask for ``subprocess.run`` or ``os.system``, so names are resolved only in the user's
code: the main script, and modules loaded from files outside Python's standard library and
site-packages (never stratagem's own). Anything else must travel serialized, which needs a cluster
secret.

    >>> import os, json
    >>> is_user_module(os), is_user_module(json)
    (False, False)
    >>> check_importable_user_module("subprocess")
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: functions are found by name only in your own code (the script, or modules outside the standard library and site-packages); 'subprocess' is not: wrap the call in a function of your script
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
import types

from stratagem.core.errors import ConfigurationError

NOT_USER = ("functions are found by name only in your own code (the script, or modules outside the "
            "standard library and site-packages); {name!r} is not: wrap the call in a function of your script")


def installation_roots() -> list[str]:
    """Directories of Python's standard library and installed packages."""
    paths = sysconfig.get_paths()
    roots = {paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        roots.add(site.getusersitepackages())
        roots.update(site.getsitepackages())
    except AttributeError:  # some virtualenvs' site module lacks them
        pass
    roots.update(p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages"))
    return sorted({os.path.realpath(r) for r in roots if r})


def is_user_module(module, main_names: tuple[str, ...] = ("__main__",)) -> bool:
    """True for the main script (``main_names``) and modules loaded from files outside Python's
    stdlib and site-packages (never the standard library's nor stratagem's own)."""
    if module is None:
        return False
    if module.__name__ in main_names:
        return True
    top = module.__name__.partition(".")[0]
    if top == "stratagem" or top in sys.stdlib_module_names:   # (stratagem too when installed editable)
        return False
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    return not any(path == root or path.startswith(root + os.sep) for root in installation_roots())


def check_importable_user_module(name: str) -> None:
    """Raise ``ConfigurationError`` unless the not-yet-imported module ``name`` is the user's code.

    Where the top-level package lives decides, before anything is imported (``find_spec`` of a dotted
    name would import its parents, and importing runs code).
    """
    top = name.partition(".")[0]
    if top == "stratagem" or top in sys.stdlib_module_names:
        raise ConfigurationError(NOT_USER.format(name=name))
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    where = spec and (spec.origin if spec.has_location else None
                      or next(iter(spec.submodule_search_locations or []), None))
    if not where:
        raise ConfigurationError(f"module {name!r} cannot be found here")
    if not is_user_module(types.SimpleNamespace(__name__=top, __file__=where)):
        raise ConfigurationError(NOT_USER.format(name=name))
