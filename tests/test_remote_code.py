"""stratagem.strategies.remote_calls.functions: how step functions travel between tasks (by name, or by value only in an
authenticated cluster), tested once here for both strategies that ship functions.

- by name, the sender: what may go (a top-level function of the user's module or script) and what may
  not (stdlib, site-packages, stratagem, builtins, lambdas, nested functions, partials, bound methods,
  a redefined name, a __main__ without a file when the receiver must import it);
- by name, the receiver (a name may come from a hostile peer): only functions *defined in* a module of
  the user's code, nothing imported before the module is known to be the user's, no dunder walks, and
  a function whose code differs is refused;
- the code hash: stable across processes (string hash seeds) and modules, different when code changes;
- by value: refused without a secret (before a byte is unpickled: a payload that would run a command
  does not), round trip with references when authenticated, damaged bytes caught;
- choose(): the one decision both strategies make, and its errors, which say how to fix it.
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from stratagem.strategies.remote_calls import functions as remote_code
from stratagem.core.errors import ConfigurationError, FunctionNotFound
from stratagem.strategies.remote_calls.functions import by_name, choose, code_hash, find_function, name_problem

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """``make(source)`` writes a module of the user's code (outside site-packages) and imports it;
    ``make(source, imported=False)`` only writes it. Unique names; removed from sys.modules after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(source: str, *, imported: bool = True, name: str | None = None):
        name = name or f"user_steps_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        if not imported:
            return name
        __import__(name)
        return sys.modules[name]

    yield make
    for name in names:
        sys.modules.pop(name, None)


STEPS = """
    import functools
    from os import system
    from subprocess import run

    def step(x):
        return x + 1

    class Model:
        def forward(self, x):
            return x * 2

        @staticmethod
        def static(x):
            return x - 1

    def outer():
        def inner():
            return 1
        return inner

    square = lambda x: x * x

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            return fn(*args)
        return wrapper

    @logged
    def decorated(x):
        return x
"""


# -- by name: the sender --------------------------------------------------------------------------------------

def test_top_level_functions_of_the_users_module_go_by_name(user_modules):
    steps = user_modules(STEPS)
    for fn in (steps.step, steps.Model.static, steps.Model.forward, steps.decorated):
        assert name_problem(fn) is None, fn
        ref = by_name(fn)
        assert ref["module"] == steps.__name__ and ref["code"] == code_hash(fn)
        assert find_function(ref, where="worker:1") is fn


@pytest.mark.parametrize("fn, problem", [
    (os.path.join, "is not in your own code"),                 # the standard library
    (np.linspace, "is not in your own code"),                  # an installed package
    (np.mean, "is not in your own code"),                      # (a C dispatcher in numpy 2)
    (remote_code.find_function, "is not in your own code"),    # stratagem itself
    (print, "builtins.print is not in your own code"),
    (subprocess.run, "subprocess.run is not in your own code"),
])
def test_library_functions_never_go_by_name(fn, problem):
    assert problem in name_problem(fn)


def test_what_is_not_a_top_level_function_does_not_go_by_name(user_modules):
    steps = user_modules(STEPS)
    assert name_problem(steps.square) == "<lambda> is a lambda"
    assert name_problem(steps.outer()) == "outer.<locals>.inner is defined inside another function"
    assert name_problem(functools.partial(steps.step, 1)) == (
        "partial is a functools.partial, not a Python function defined with def")
    assert name_problem(steps.Model().forward) == (
        "Model.forward is a bound method, not a Python function defined with def")
    assert "is not in your own code" in name_problem(steps.system)     # os.system, imported by the user's module
    original = steps.step
    steps.step = lambda x: x                                           # the name now finds something else
    assert name_problem(original) == f"{steps.__name__}.step does not name it (it was redefined after)"


MAIN_SCRIPT = """
import functools
from stratagem.strategies.remote_calls import functions as rc

def step(x):
    return x + 1

def outer():
    def inner():
        return 1
    return inner

for fn in (step, outer(), lambda: 0, functools.partial(step)):
    print(rc.name_problem(fn), "|", rc.name_problem(fn, main_needs_file=True))
print(rc.by_name(step)["module"], rc.find_function(rc.by_name(step), where="me") is step)
"""


def run_python(*args, env=None):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_functions_of_the_main_script_go_by_name(tmp_path):
    """A real script's __main__: its top-level functions go by name; with ``python -c`` there is no file
    to import again, which matters only to a receiver that imports the script (in_graph)."""
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT)
    lines = run_python(str(script))
    assert lines == ["None | None",
                     "outer.<locals>.inner is defined inside another function | "
                     "outer.<locals>.inner is defined inside another function",
                     "<lambda> is a lambda | <lambda> is a lambda",
                     "partial is a functools.partial, not a Python function defined with def | "
                     "partial is a functools.partial, not a Python function defined with def",
                     "__main__ True"]
    first = run_python("-c", MAIN_SCRIPT)[0]
    assert first == ("None | step is defined in a __main__ that has no file (python -c, a notebook) to import "
                     "again")


# -- by name: the receiver --------------------------------------------------------------------------------------

@pytest.mark.parametrize("module, qualname", [
    ("os", "system"), ("subprocess", "run"), ("builtins", "exec"), ("shutil", "rmtree"),
    ("numpy", "save"), ("stratagem.launch.launcher", "launch"), ("stratagem.strategies.remote_calls.functions", "loads_function"),
    ("antigravity", "geohash"), ("__main__", "exec"),          # (importing antigravity opens a browser)
])
def test_a_peer_cannot_name_what_is_not_a_function_of_the_users_code(module, qualname):
    imported_before = module in sys.modules
    with pytest.raises(FunctionNotFound, match="refuses|has no function"):
        find_function({"module": module, "qualname": qualname}, where="worker:1")
    if not imported_before:
        assert module not in sys.modules       # refused before anything was imported


def test_a_name_finds_only_a_function_defined_in_the_module_named(user_modules):
    steps = user_modules(STEPS)
    other = user_modules(f"from {steps.__name__} import step\n")   # re-exported from another user module
    with pytest.raises(FunctionNotFound, match=r"refuses .*\.step: it is not a Python function defined there"):
        find_function({"module": other.__name__, "qualname": "step"}, where="worker:1")
    for qualname in ("system", "run", "functools.reduce"):                # library functions it imported
        with pytest.raises(FunctionNotFound, match="refuses"):
            find_function({"module": steps.__name__, "qualname": qualname}, where="worker:1")
    for qualname in ("step.__globals__", "__builtins__.exec", "Model.__init__", "step.__code__"):  # no dunders
        with pytest.raises(FunctionNotFound, match="not the name of a top-level function"):
            find_function({"module": steps.__name__, "qualname": qualname}, where="worker:1")


def test_a_users_module_is_imported_to_find_a_name(user_modules):
    name = user_modules("def step(x):\n    return 2 * x\n", imported=False)
    fn = find_function({"module": name, "qualname": "step"}, where="worker:1")
    assert fn(4) == 8 and sys.modules[name].step is fn


@pytest.mark.parametrize("ref, message", [
    ({}, "without a module and a name"),
    ({"module": 5, "qualname": "f"}, "without a module and a name"),
    ({"module": "x", "qualname": ["f"]}, "without a module and a name"),
    ({"module": "definitely_not_a_module_xyz", "qualname": "f"}, "cannot be found here"),
    ({"module": "os", "qualname": "f-g"}, "not the name of a top-level function"),
])
def test_malformed_references_are_refused(ref, message):
    with pytest.raises(FunctionNotFound, match=message):
        find_function(ref, where="worker:1")


def test_a_missing_function_is_named_with_the_hint(user_modules):
    steps = user_modules(STEPS)
    with pytest.raises(FunctionNotFound, match=rf"worker:1 has no function {steps.__name__}.nope: define it"):
        find_function({"module": steps.__name__, "qualname": "nope"}, where="worker:1", missing_hint=": define it")


def test_another_version_of_the_code_is_refused(user_modules):
    steps = user_modules(STEPS)
    ref = by_name(steps.step)
    with pytest.raises(FunctionNotFound, match="has another version of .*step than the sender"):
        find_function({**ref, "code": "0" * 16}, where="worker:1")


# -- the code hash ------------------------------------------------------------------------------------------------

HASHED = """
def step(x, table={"a": 1}):
    if x in {"alpha", "beta", "gamma", "delta"}:        # a frozenset constant: order follows the hash seed
        return (lambda y: y * 0.5)(x)
    return x + 1
"""


def test_the_code_hash_is_the_same_across_processes_and_modules(user_modules):
    here = code_hash(user_modules(HASHED).step)
    assert code_hash(user_modules(HASHED).step) == here                    # the same code in another module
    source = user_modules(HASHED, imported=False)
    program = (f"import importlib, sys; from stratagem.strategies.remote_calls.functions import code_hash; "
               f"print(code_hash(importlib.import_module({source!r}).step))")
    for seed in ("1", "2", "12345"):
        env = {"PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        assert run_python("-c", program, env=env) == [here]


@pytest.mark.parametrize("edit", [
    ("x + 1", "x + 2"),                                 # a constant
    ("y * 0.5", "y * 0.25"),                            # a constant of a nested function
    ("return x + 1", "return x - 1"),                   # an operation
    ('"delta"', '"epsilon"'),                           # a member of a frozenset constant
])
def test_the_code_hash_changes_with_the_code(user_modules, edit):
    before = code_hash(user_modules(HASHED).step)
    assert code_hash(user_modules(HASHED.replace(*edit)).step) != before
    assert code_hash(print) == ""                        # no Python code: nothing to compare


# -- by value -----------------------------------------------------------------------------------------------------

def test_nothing_is_unpickled_without_a_secret(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    with pytest.raises(ConfigurationError, match="worker:1 refuses a pickled function: its cluster is not "
                                                 "authenticated .*STRATAGEM_SECRET"):
        remote_code.loads_function(payload, authenticated=False, where="worker:1")
    assert not marker.exists()
    with pytest.raises(ConfigurationError, match="not authenticated"):      # also what our own sender wrote
        remote_code.loads_function(remote_code.dumps_function(lambda: 1, what="f"), authenticated=False,
                                   where="worker:1")


class Shared:
    """Stands for an object every task has its own copy of (a variable): travels as a reference."""

    def __init__(self, name):
        self.name = name


def test_by_value_round_trip_with_references_when_authenticated():
    theirs, mine = Shared("w"), Shared("w")
    offset = np.arange(3.0)
    fn = lambda x: (theirs.name, x + offset)              # noqa: E731 - a closure over a shared object
    data = remote_code.dumps_function(
        fn, what="the step", persistent_id=lambda obj: ("shared", obj.name) if isinstance(obj, Shared) else None)
    seen = []

    def persistent_load(pid):
        seen.append(pid)
        return mine

    back = remote_code.loads_function(data, authenticated=True, where="worker:1", persistent_load=persistent_load,
                                      expected_digest=remote_code.digest(data))
    name, value = back(1.0)
    assert name == "w" and seen == [("shared", "w")] and value.tolist() == [1.0, 2.0, 3.0]
    assert back.__closure__ is not None and any(c.cell_contents is mine for c in back.__closure__)


def test_damaged_or_foreign_bytes_are_refused_when_authenticated():
    data = remote_code.dumps_function(lambda: 1, what="f")
    with pytest.raises(ConfigurationError, match="arrived damaged at worker:1"):
        remote_code.loads_function(data[:-1] + b"!", authenticated=True, where="worker:1",
                                   expected_digest=remote_code.digest(data))
    with pytest.raises(ConfigurationError, match="is a list, not a function"):
        remote_code.loads_function(pickle.dumps([1]), authenticated=True, where="worker:1")
    with pytest.raises(pickle.UnpicklingError, match="unknown reference"):      # no hook: no references
        remote_code.loads_function(
            remote_code.dumps_function(lambda: 1, what="f",
                                       persistent_id=lambda obj: "x" if type(obj) is int and obj == 1 else None),
            authenticated=True, where="worker:1")


def test_what_cannot_be_serialized_is_named():
    import threading

    lock = threading.Lock()
    with pytest.raises(ConfigurationError, match="cannot serialize the step 'f': TypeError: .*lock.*define it at "
                                                 "the top level"):
        remote_code.dumps_function(lambda: lock, what="the step 'f'")


# -- the decision ---------------------------------------------------------------------------------------------------

def decide(fn, mode, authenticated, **kwargs):
    return choose(fn, mode=mode, authenticated=authenticated, what=f"the step {remote_code.describe(fn)!r}",
                  peers="the workers", option=f"functions={mode!r}", **kwargs)


def test_choose_by_name_when_possible_else_by_value_only_with_a_secret(user_modules):
    steps = user_modules(STEPS)
    assert decide(steps.step, "auto", False) == "name"
    assert decide(steps.step, "auto", True) == "name"
    assert decide(steps.step, "value", True) == "value"
    assert decide(steps.square, "auto", True) == "value"
    assert decide(np.mean, "auto", True) == "value"
    with pytest.raises(ConfigurationError) as info:
        decide(steps.square, "auto", False)
    message = str(info.value)
    assert message.startswith("the step '<lambda>' cannot be sent by name (<lambda> is a lambda)")
    assert "not authenticated" in message and "STRATAGEM_SECRET" in message and "top level of your script" in message
    with pytest.raises(ConfigurationError, match=r"the step 'step' is to be sent only serialized \(cloudpickle: "
                                                 r"functions='value'\), and this cluster is not authenticated"):
        decide(steps.step, "value", False)
    with pytest.raises(ConfigurationError, match=r"cannot be found by name on the workers \(<lambda> is a lambda; "
                                                 r"functions='name'\)"):
        decide(steps.square, "name", True)
    with pytest.raises(ConfigurationError, match="unknown way to send functions 'cloudpickle'"):
        decide(steps.step, "cloudpickle", True)


def test_main_by_value_sends_the_scripts_functions_by_value_only_when_authenticated(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from stratagem.strategies.remote_calls.functions import choose

        def step(x):
            return x

        for authenticated in (False, True):
            print(choose(step, mode="auto", authenticated=authenticated, what="f", peers="p", option="o",
                         main_by_value=True))
    """))
    assert run_python(str(script)) == ["name", "value"]


def test_a_policy_decides_once_per_function_and_takes_any_callable(user_modules):
    steps = user_modules(STEPS)
    policy = remote_code.Policy("auto", authenticated=True, peers="the workers", option="functions='auto'")
    original = steps.step
    assert policy.how(original, "the step") == "name"
    steps.step = lambda x: x                            # the name now finds another function...
    assert "does not name it" in name_problem(original)
    assert policy.how(original, "the step") == "name"   # ...but the decision for this object is kept
    assert policy.how(print, "print") == "value"        # a builtin cannot be weakly referenced: decided each time
    unauthenticated = remote_code.Policy("auto", authenticated=False, peers="the workers", option="o")
    with pytest.raises(ConfigurationError, match="not authenticated"):
        unauthenticated.how(print, "print")
    with pytest.raises(ConfigurationError, match="unknown way to send functions 'pickle'"):
        remote_code.Policy("pickle", authenticated=True, peers="p", option="o")
