"""How a step function reaches another task: by name, or by value from authenticated peers only.

The strategies that run the user's functions on other tasks (``in_graph``, ``parameter_server``) ship
them through this module, so there is one set of rules, the stricter of what each had before:

**By name** (no code on the wire): the function travels as ``module:qualname`` plus a hash of its code,
and the receiving task looks it up in its own copy of the program. It may go by name only if it is a
Python function (``def``, not a lambda, a nested function, a ``functools.partial``, a bound method or a
builtin), defined at the top level of the user's own code (the ``__main__`` script, or a module loaded
from a file outside the standard library and site-packages: :mod:`stratagem.core.user_code`), and its
name finds that very function. The receiver applies the same rules to a name from the network, since
any peer that reaches the port can send one: it imports only modules of the user's code (deciding from
where they live, before importing anything), walks no ``__dunder__`` attribute, and accepts only a
Python function *defined in* the module named (``func.__module__`` is that module), so a name can
never reach ``os.system``, ``subprocess.run`` or a library function the user's module imported. A
function whose code hash differs on the receiver is refused (the tasks run different code). Where
``__main__`` is looked up is the strategy's choice (``parameter_server``: the worker's own script,
which serves inside ``stratagem.strategy(...)``; ``in_graph``: a fresh import of the script).

**By value** (lambdas, closures, anything else): serialized with cloudpickle, and only in an
authenticated cluster: the sender refuses without a cluster secret, and the receiver unpickles nothing
unless its own transport has one, so every peer it hears from has proved it holds the secret
(unpickling runs code: it must never take bytes from a peer that has not). Objects the strategy
knows (its variables, optimizer, iterators) travel as references its hooks resolve on the receiver.

Every refusal is a :class:`~stratagem.core.errors.ConfigurationError` naming the function and how to
fix it; a receiver that cannot find or refuses a name raises
:class:`~stratagem.core.errors.FunctionNotFound`, which a sender on an authenticated cluster may answer
by sending the function by value.

    >>> import functools, json
    >>> name_problem(json.dumps)
    'json.dumps is not in your own code (the script, or modules outside the standard library and site-packages)'
    >>> name_problem(lambda x: x)
    '<lambda> is a lambda'
    >>> name_problem(functools.partial(json.dumps, indent=2))
    'partial is a functools.partial, not a Python function defined with def'
    >>> find_function({"module": "subprocess", "qualname": "run"}, where="worker:1")
    Traceback (most recent call last):
    ...
    stratagem.core.errors.FunctionNotFound: worker:1 refuses subprocess.run: functions are found by name only in your own code ...
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import os
import pickle
import sys
import types
import weakref
from typing import Any, Callable

from stratagem.core import user_code
from stratagem.core.errors import ConfigurationError, FunctionNotFound
from stratagem.strategies.remote_calls.values import type_name

#: How a function may travel: by name when it can (else by value), only by name, only by value.
MODES = ("auto", "name", "value")

SECRET_HINT = "set the same STRATAGEM_SECRET on every task (`stratagem launch` sets one for you)"
_MAIN = "__main__"
_OWN_CODE = "the script, or modules outside the standard library and site-packages"


def describe(fn) -> str:
    """``fn``'s name for messages."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


# -- by name ---------------------------------------------------------------------------------------

def name_problem(fn, *, main_needs_file: bool = False) -> str | None:
    """Why ``fn`` cannot travel by name, or ``None`` if it can (see the module doc for the rules).

    ``main_needs_file``: a function of a ``__main__`` without a file (``python -c``, a notebook) cannot
    go by name, for receivers that import the script again to find it.
    """
    module_name, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if isinstance(fn, types.FunctionType):
        if "<lambda>" in qualname:
            return f"{qualname} is a lambda"
        if "<locals>" in qualname:
            return f"{qualname} is defined inside another function"
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    if isinstance(qualname, str) and not isinstance(fn, types.MethodType) and not user_code.is_user_module(module):
        return f"{module_name}.{qualname} is not in your own code ({_OWN_CODE})"
    if not isinstance(fn, types.FunctionType):
        kind = "a bound method" if isinstance(fn, types.MethodType) else f"a {type_name(fn)}"
        return f"{describe(fn)} is {kind}, not a Python function defined with def"
    if module_name == _MAIN and main_needs_file and not getattr(module, "__file__", None):
        return f"{qualname} is defined in a __main__ that has no file (python -c, a notebook) to import again"
    if _walk(module, qualname) is not fn:
        return f"{module_name}.{qualname} does not name it (it was redefined after)"
    return None


def by_name(fn) -> dict:
    """The wire description of ``fn`` by name (check :func:`name_problem` first).

    >>> by_name(describe)["module"], by_name(describe)["qualname"]
    ('stratagem.strategies.remote_calls.functions', 'describe')
    """
    return {"kind": "name", "module": fn.__module__, "qualname": fn.__qualname__, "code": code_hash(fn)}


def find_function(ref: dict, *, where: str, module_for: Callable[[str], Any] | None = None,
                  main_names: tuple[str, ...] = (_MAIN,), missing_hint: str = "") -> types.FunctionType:
    """The function ``ref`` (from :func:`by_name`, maybe from a hostile peer) names in this process.

    ``module_for(name)`` returns the module to look in (default :func:`user_module`; ``in_graph`` maps
    ``__main__`` to its fresh copy of the script); whatever it returns must be the user's code
    (``main_names`` count as the script). ``missing_hint`` is added when the module lacks the name.
    Raises :class:`FunctionNotFound` naming the function and why.
    """
    module_name, qualname = (ref.get("module"), ref.get("qualname")) if isinstance(ref, dict) else (None, None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or not module_name or not qualname:
        raise FunctionNotFound(f"{where} got a function reference without a module and a name")
    full = f"{module_name}.{qualname}"
    if any(part.startswith("__") and part.endswith("__") or not part.isidentifier() for part in qualname.split(".")):
        raise FunctionNotFound(f"{where} refuses {full}: not the name of a top-level function")
    try:
        module = (module_for or user_module)(module_name)
        if not user_code.is_user_module(module, main_names):
            raise ConfigurationError(user_code.NOT_USER.format(name=module_name))
    except FunctionNotFound:
        raise
    except ConfigurationError as exc:
        raise FunctionNotFound(f"{where} refuses {full}: {exc}") from None
    except ImportError as exc:
        raise FunctionNotFound(f"{where} cannot import module {module_name!r} for {qualname}: {exc}") from None
    found = _walk(module, qualname)
    if found is None:
        raise FunctionNotFound(f"{where} has no function {full}{missing_hint}")
    if not isinstance(found, types.FunctionType) or found.__module__ != module.__name__:
        # A builtin (os.system), or a function the user's module imported from elsewhere.
        origin = getattr(found, "__module__", None) or type(found).__name__
        raise FunctionNotFound(f"{where} refuses {full}: it is not a Python function defined there; "
                               + user_code.NOT_USER.format(name=origin))
    expected = ref.get("code")
    if expected and code_hash(found) != expected:
        raise FunctionNotFound(f"{where} has another version of {full} than the sender (its code differs): "
                               f"run the same program, with the same Python, on every task")
    return found


def user_module(name: str):
    """The module ``name`` if it is the user's code, imported if needed (refused before importing)."""
    module = sys.modules.get(name)
    if module is None:
        if name == _MAIN:
            raise ConfigurationError("this task has no __main__ module")
        user_code.check_importable_user_module(name)
        module = importlib.import_module(name)
    return module


def _walk(module, qualname: str):
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


# -- the code hash -----------------------------------------------------------------------------------

def code_hash(fn) -> str:
    """A short hash of ``fn``'s bytecode, names and constants (nested functions' too): the same on every
    task that runs the same code with the same Python, different when the function was edited.

    >>> def f(x): return x + 1
    >>> def g(x): return x + 2
    >>> code_hash(f) == code_hash(f), code_hash(f) == code_hash(g)
    (True, False)
    """
    code = getattr(fn, "__code__", None)
    return "" if code is None else _code_digest(code)[:16]


def _code_digest(code) -> str:
    hasher = hashlib.sha256()
    for part in (code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode(),
                 *(_const_bytes(c) for c in code.co_consts)):
        hasher.update(len(part).to_bytes(8, "little") + part)
    return hasher.hexdigest()


def _const_bytes(const) -> bytes:
    # repr would show a nested code object's address, and a frozenset's order follows the string hash
    # seed, which differs between processes: both are made stable here.
    if isinstance(const, types.CodeType):
        return b"code:" + _code_digest(const).encode()
    if isinstance(const, tuple):
        return b"(" + b",".join(_const_bytes(c) for c in const) + b")"
    if isinstance(const, frozenset):
        return b"{" + b",".join(sorted(_const_bytes(c) for c in const)) + b"}"
    return f"{type(const).__name__}:{const!r}".encode()


def main_script() -> tuple[str | None, str | None]:
    """``(absolute path, sha256)`` of the ``__main__`` script, or ``(None, None)`` when there is none."""
    path = getattr(sys.modules.get(_MAIN), "__file__", None)
    if not path:
        return None, None
    path = os.path.abspath(path)
    try:
        with open(path, "rb") as f:
            return path, hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return path, None


# -- choosing ------------------------------------------------------------------------------------------

def choose(fn, *, mode: str, authenticated: bool, what: str, peers: str, option: str, hint: str = "",
           main_needs_file: bool = False, main_by_value: bool = False) -> str:
    """``"name"`` or ``"value"``: how ``fn`` travels, or a ``ConfigurationError`` saying how to fix it.

    ``mode`` is one of :data:`MODES`; ``what`` names the function for messages ("the step function
    'f'"), ``peers`` the receivers ("the workers"), ``option`` the strategy's option that chose the
    mode (for messages), ``hint`` where else to define it. ``main_by_value``: in ``auto`` mode on an
    authenticated cluster, functions of the ``__main__`` script go by value (``in_graph``: finding them
    by name would run the script's top level again on the receiver).

    >>> choose(lambda: 0, mode="auto", authenticated=True, what="f", peers="the workers", option="")
    'value'
    >>> choose(lambda: 0, mode="auto", authenticated=False, what="the step function '<lambda>'",
    ...        peers="the workers", option="")
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: the step function '<lambda>' cannot be sent by name (<lambda> is a lambda), ...
    """
    _check_mode(mode)
    problem = name_problem(fn, main_needs_file=main_needs_file)
    if mode == "name" and problem:
        raise ConfigurationError(
            f"{what} cannot be found by name on {peers} ({problem}; {option}): define it at the top level "
            f"of your script{hint} (or of a module of your own code), not inside a function, and pass the "
            f"function itself rather than a lambda, partial or bound method"
        )
    by_value = mode == "value" or (mode == "auto" and (problem is not None or (
        main_by_value and authenticated and getattr(fn, "__module__", None) == _MAIN)))
    if not by_value:
        return "name"
    if not authenticated:
        why = (f"cannot be sent by name ({problem}), so it can travel only serialized (cloudpickle)" if problem
               else f"is to be sent only serialized (cloudpickle: {option})")
        raise ConfigurationError(
            f"{what} {why}, and this cluster is not authenticated: stratagem unpickles only between tasks "
            f"that share a cluster secret, because unpickling runs code. {SECRET_HINT[0].upper()}"
            f"{SECRET_HINT[1:]}, or define it at the top level of your script{hint} so that {peers} find it "
            f"by name"
        )
    return "value"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigurationError(f"unknown way to send functions {mode!r}; one of {', '.join(MODES)}")


class Policy:
    """:func:`choose` with one strategy's settings, its answer remembered per function object (the
    checks read the file system, and a step function is sent every step).

    >>> policy = Policy("auto", authenticated=True, peers="the workers", option="functions='auto'")
    >>> policy.how(lambda: 0, "the step")
    'value'
    """

    def __init__(self, mode: str, *, authenticated: bool, peers: str, option: str, hint: str = "",
                 main_needs_file: bool = False, main_by_value: bool = False):
        _check_mode(mode)
        self.authenticated = authenticated
        self._settings = dict(mode=mode, authenticated=authenticated, peers=peers, option=option, hint=hint,
                              main_needs_file=main_needs_file, main_by_value=main_by_value)
        self._known: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()

    def how(self, fn, what: str) -> str:
        """``"name"`` or ``"value"`` for ``fn`` (``what`` names it in errors), as :func:`choose` says."""
        try:
            known = self._known.get(fn)
        except TypeError:                     # not weak-referenceable: decided every time
            known = None
        if known is None:
            known = choose(fn, what=what, **self._settings)
            with contextlib.suppress(TypeError):
                self._known[fn] = known
        return known


# -- by value ------------------------------------------------------------------------------------------

def _cloudpickle(what: str):
    try:
        import cloudpickle
    except ImportError:
        raise ConfigurationError(f"sending {what} serialized needs cloudpickle: pip install cloudpickle") from None
    return cloudpickle


def dumps_function(fn, *, what: str, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    """``fn`` serialized with cloudpickle (only after :func:`choose` said ``"value"``); objects for
    which ``persistent_id(obj)`` is not ``None`` travel as that reference."""
    cloudpickle = _cloudpickle(what)

    class Pickler(cloudpickle.CloudPickler):
        def persistent_id(self, obj):
            return None if persistent_id is None else persistent_id(obj)

    buffer = io.BytesIO()
    try:
        Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    except Exception as exc:
        raise ConfigurationError(f"cannot serialize {what}: {type(exc).__name__}: {exc}; define it at the top "
                                 f"level of your script so that it travels by name") from exc
    return buffer.getvalue()


def digest(data) -> str:
    """The sha256 of a serialized function (a cache key, and a check that it arrived whole)."""
    return hashlib.sha256(data).hexdigest()


def loads_function(data, *, authenticated: bool, where: str, persistent_load: Callable[[Any], Any] | None = None,
                   expected_digest: str | None = None) -> Callable:
    """The function :func:`dumps_function` serialized, unpickled only if ``authenticated`` (this task's
    transport has a cluster secret, so the sender proved it holds it); raises ``ConfigurationError``
    otherwise, before reading a byte of ``data``.

    >>> loads_function(b"cos\\nsystem\\n(S'echo pwned'\\ntR.", authenticated=False, where="worker:1")
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: worker:1 refuses a pickled function: its cluster is not authenticated ...
    """
    if not authenticated:
        raise ConfigurationError(
            f"{where} refuses a pickled function: its cluster is not authenticated (no STRATAGEM_SECRET), and "
            f"it unpickles nothing received from the network without one, because unpickling runs code: "
            f"{SECRET_HINT}"
        )
    _cloudpickle("a function")          # what cloudpickle wrote may need it to load
    raw = memoryview(data).cast("B").tobytes()
    if expected_digest is not None and digest(raw) != expected_digest:
        raise ConfigurationError(f"a serialized function arrived damaged at {where} (its sha256 differs)")

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            if persistent_load is None:
                raise pickle.UnpicklingError(f"unknown reference {pid!r}")
            return persistent_load(pid)

    fn = Unpickler(io.BytesIO(raw)).load()
    if not callable(fn):
        raise ConfigurationError(f"the serialized function that arrived at {where} is a {type_name(fn)}, "
                                 f"not a function")
    return fn
