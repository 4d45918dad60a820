"""Variables: copies, names, strategy registration, in-place assignment, dtypes, stores, array modules."""

from __future__ import annotations

import asyncio
import doctest
import re
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

from stratagem.training import variables as variables_module
from stratagem.core.errors import ConfigurationError
from stratagem.training.variables import (
    LocalStore,
    Variable,
    VariableStore,
    array_module,
    current_strategy,
    strategy_scope,
)
from stratagem.testing.fake_cupy import FakeDeviceArray


class FakeStrategy:
    """The two hooks a strategy offers variables; records what it was given (not a mock of Variable)."""

    def __init__(self, refuse: str | None = None):
        self.variables: list[Variable] = []
        self.refuse = refuse

    def on_variable(self, var):
        if var.name == self.refuse:
            raise ConfigurationError(f"refusing {var.name}")
        self.variables.append(var)

    def scope(self):
        return strategy_scope(self)


# -- creation ------------------------------------------------------------------------------------------

def test_initial_value_is_copied_and_keeps_its_dtype():
    source = np.arange(6, dtype=np.float32).reshape(2, 3)
    w = Variable(source, name="copy")
    source[:] = -1
    assert w.value is not source
    np.testing.assert_array_equal(w.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert (w.shape, w.dtype, w.ndim, w.size, len(w)) == ((2, 3), np.dtype(np.float32), 2, 6, 2)
    assert w.value.flags.c_contiguous


def test_initial_value_from_lists_numbers_views_and_dtype():
    assert Variable([[1, 2], [3, 4]], dtype=np.float16).dtype == np.float16
    assert Variable(3.5).shape == () and Variable(3.5).dtype == np.float64
    strided = np.arange(10.0)[::2]
    v = Variable(strided)
    assert v.value.flags.c_contiguous and v.value.base is None
    other = Variable(v, name="from_variable")
    v.assign_add(np.ones(5))
    np.testing.assert_array_equal(other.numpy(), strided)


@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([object(), None], dtype=object),
                                  np.zeros(2, dtype=[("x", "f4")])])
def test_non_numeric_dtypes_are_refused(bad):
    with pytest.raises(ConfigurationError, match="numeric"):
        Variable(bad, name="bad")


@pytest.mark.parametrize("name", ["", 3, b"w"])
def test_bad_names_are_refused(name):
    with pytest.raises(ConfigurationError, match="non-empty string"):
        Variable(np.zeros(1), name=name)


def test_unknown_dtype_is_refused():
    with pytest.raises(ConfigurationError, match="unknown dtype"):
        Variable(np.zeros(1), name="x", dtype="not-a-dtype")


def test_torch_tensor_initial_value_is_copied():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    t = torch.ones(3, requires_grad=True)
    w = Variable(t, name="from_torch")
    assert isinstance(w.value, np.ndarray) and w.dtype == np.float32
    with torch.no_grad():
        t.add_(1)
    np.testing.assert_array_equal(w.numpy(), np.ones(3, np.float32))


# -- names -------------------------------------------------------------------------------------------

def test_default_names_outside_any_scope_are_unique_per_process():
    names = [Variable(np.zeros(1)).name for _ in range(5)]
    assert len(set(names)) == 5
    assert all(re.fullmatch(r"Variable(_\d+)?", n) for n in names)
    # explicit duplicate names are allowed for plain local variables (nothing is registered)
    assert Variable(np.zeros(1), name="dup").name == Variable(np.zeros(1), name="dup").name == "dup"


def test_default_names_are_unique_per_strategy_and_skip_taken_names():
    first, second = FakeStrategy(), FakeStrategy()
    with first.scope():
        a = Variable(np.zeros(1))
        b = Variable(np.zeros(1), name="Variable_1")
        c = Variable(np.zeros(1))
        d = Variable(np.zeros(1))
    with second.scope():
        e = Variable(np.zeros(1))
    assert [v.name for v in (a, b, c, d)] == ["Variable", "Variable_1", "Variable_2", "Variable_3"]
    assert e.name == "Variable"  # each strategy numbers its own


def test_duplicate_name_in_one_strategy_is_refused_naming_it():
    strategy = FakeStrategy()
    with strategy.scope():
        Variable(np.zeros(1), name="w")
        with pytest.raises(ConfigurationError, match="'w' already exists"):
            Variable(np.zeros(1), name="w")
    assert [v.name for v in strategy.variables] == ["w"]
    with FakeStrategy().scope():
        Variable(np.zeros(1), name="w")  # another strategy: fine


def test_a_refused_registration_frees_the_name():
    strategy = FakeStrategy(refuse="w")
    with strategy.scope():
        with pytest.raises(ConfigurationError, match="refusing w"):
            Variable(np.zeros(1), name="w")
        strategy.refuse = None
        assert Variable(np.zeros(1), name="w").name == "w"


# -- strategy scope ----------------------------------------------------------------------------------

def test_variables_created_in_scope_are_registered_with_that_strategy():
    strategy = FakeStrategy()
    assert current_strategy() is None
    outside = Variable(np.zeros(1), name="outside")
    with strategy.scope() as entered:
        assert entered is strategy and current_strategy() is strategy
        inside = Variable(np.zeros(2), name="inside")
    assert current_strategy() is None
    assert strategy.variables == [inside]
    assert inside.strategy is strategy and outside.strategy is None
    assert "in FakeStrategy" in repr(inside) and "'outside'" in repr(outside)


def test_scopes_nest_and_are_restored_on_errors():
    outer, inner = FakeStrategy(), FakeStrategy()
    with outer.scope():
        with pytest.raises(RuntimeError):
            with inner.scope():
                assert current_strategy() is inner
                raise RuntimeError("boom")
        assert current_strategy() is outer
    assert current_strategy() is None


def test_scope_is_per_thread_and_per_task():
    strategy = FakeStrategy()
    seen = []
    with strategy.scope():
        thread = threading.Thread(target=lambda: seen.append(current_strategy()))
        thread.start()
        thread.join()
    assert seen == [None]  # a new thread starts outside any scope

    async def main():
        other = FakeStrategy()

        async def in_scope():
            with other.scope():
                await asyncio.sleep(0.01)
                return current_strategy()

        async def outside():
            await asyncio.sleep(0.005)
            return current_strategy()

        return await asyncio.gather(in_scope(), outside()), other

    (inside, beside), other = asyncio.run(main())
    assert inside is other and beside is None


# -- assignment ----------------------------------------------------------------------------------------

def test_assignments_are_in_place():
    w = Variable(np.zeros(3, np.float32), name="inplace")
    buffer = w.value
    assert w.assign([1, 2, 3]) is w
    assert w.assign_add(np.ones(3, np.float64)) is w       # float64 into float32: same_kind
    assert w.assign_sub(np.full(3, 0.5, np.float32)) is w
    assert w.value is buffer
    np.testing.assert_array_equal(buffer, np.array([1.5, 2.5, 3.5], np.float32))
    w.assign(Variable(np.ones(3), name="source"))
    np.testing.assert_array_equal(buffer, np.ones(3, np.float32))


def test_torch_view_of_the_value_stays_valid():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    w = Variable(np.zeros((2, 2), np.float32), name="torch_view")
    view = torch.from_numpy(w.value)
    w.assign(np.eye(2, dtype=np.float32))
    w.assign_add(np.ones((2, 2), np.float32))
    assert torch.equal(view, torch.tensor([[2.0, 1.0], [1.0, 2.0]]))
    w.assign_sub(torch.ones(2, 2, requires_grad=True))  # a torch value is converted without importing torch
    assert torch.equal(view, torch.eye(2))


def test_shape_mismatch_names_the_variable_and_both_shapes():
    w = Variable(np.zeros((2, 3)), name="kernel")
    for method in (w.assign, w.assign_add, w.assign_sub):
        with pytest.raises(ConfigurationError, match=r"'kernel'.*shape \(3, 2\).*\(2, 3\)"):
            method(np.zeros((3, 2)))
    with pytest.raises(ConfigurationError, match=r"shape \(\)"):
        w.assign(0.0)  # no silent broadcasting
    np.testing.assert_array_equal(w.numpy(), np.zeros((2, 3)))


def test_unsafe_casts_are_refused():
    counter = Variable(np.zeros(2, np.int32), name="counter", trainable=False)
    with pytest.raises(ConfigurationError, match="float64 value does not fit its dtype int32"):
        counter.assign(np.array([0.5, 1.5]))
    counter.assign_add(np.ones(2, np.int64))
    np.testing.assert_array_equal(counter.numpy(), [1, 1])
    assert counter.trainable is False


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_variables(dtype):
    w = Variable(np.ones(4, dtype), name=f"half_{np.dtype(dtype).name}")
    buffer = w.value
    w.assign_add(np.full(4, 0.5, np.float32))
    w.assign_sub(np.full(4, 0.25, dtype))
    assert w.value is buffer and w.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(w.numpy().astype(np.float32), np.full(4, 1.25, np.float32))


# -- reading -------------------------------------------------------------------------------------------

def test_numpy_returns_an_independent_copy_and_array_interop_works():
    w = Variable(np.arange(4.0).reshape(2, 2), name="interop")
    host = w.numpy()
    host[:] = 7
    assert w.numpy()[0, 0] == 0
    assert np.asarray(w) is w.value
    assert np.asarray(w, dtype=np.float32).dtype == np.float32
    assert np.array(w, copy=True) is not w.value
    with pytest.raises(ValueError, match="needs a copy"):
        np.array(w, dtype=np.float32, copy=False)
    x = np.ones((1, 2))
    np.testing.assert_array_equal(x @ w, [[2.0, 4.0]])
    np.testing.assert_array_equal(w @ np.ones(2), [1.0, 5.0])
    np.testing.assert_array_equal(w * 2 + 1 - w, w.numpy() + 1)
    np.testing.assert_array_equal(2 * w / 2, w.numpy())
    np.testing.assert_array_equal(-w, -w.numpy())
    np.testing.assert_array_equal(w ** 2, w.numpy() ** 2)
    assert w[1, 1] == 3.0
    assert (w == w) is True and {w: 1}[w] == 1  # identity equality: a Variable can be a dict key


def test_scalar_variable_has_no_len():
    with pytest.raises(TypeError, match="scalar"):
        len(Variable(1.0, name="scalar"))


# -- stores ------------------------------------------------------------------------------------------

class RemoteStore(VariableStore):
    """A store that hands out copies, as a remote (parameter-server) store would."""

    def __init__(self, array):
        self.array, self.writes = np.array(array, copy=True), []

    def read(self):
        return self.array.copy()

    def write(self, array):
        self.writes.append(np.array(array, copy=True))
        self.array = np.array(array, dtype=self.array.dtype, copy=True)


class ShardingStrategy(FakeStrategy):
    def on_variable(self, var):
        super().on_variable(var)
        var.store = RemoteStore(var.value)


def test_a_strategy_can_replace_the_store():
    strategy = ShardingStrategy()
    with strategy.scope():
        w = Variable(np.zeros(2, np.float32), name="remote")
    store = w.store
    assert isinstance(store, RemoteStore) and not store.live
    w.assign([1.0, 2.0])
    w.assign_add(np.ones(2))
    w.assign_sub(np.full(2, 0.5, np.float32))
    np.testing.assert_array_equal(w.numpy(), [1.5, 2.5])
    assert len(store.writes) == 3 and all(a.dtype == np.float32 for a in store.writes)
    with pytest.raises(ConfigurationError, match="VariableStore"):
        w.store = object()


def test_local_store_writes_in_place():
    store = LocalStore(np.zeros(2))
    buffer = store.read()
    store.write(np.ones(2))
    assert store.read() is buffer and buffer.tolist() == [1.0, 1.0]
    with pytest.raises(NotImplementedError):
        VariableStore().read()
    with pytest.raises(NotImplementedError):
        VariableStore().write(np.zeros(1))


# -- array modules -----------------------------------------------------------------------------------

def test_device_values_stay_on_their_module(fake_cupy):
    device = fake_cupy.arange(3.0)
    w = Variable(device, name="on_device")
    assert isinstance(w.value, FakeDeviceArray) and w.value is not device
    assert array_module(w.value) is fake_cupy
    w.assign(np.array([5.0, 6.0, 7.0]))              # a host value is moved to the device
    w.assign_add(fake_cupy.ones(3))
    assert isinstance(w.value, FakeDeviceArray)
    host = w.numpy()
    assert type(host) is np.ndarray and host.tolist() == [6.0, 7.0, 8.0]
    with pytest.raises(TypeError, match=r"var\.numpy\(\)"):
        np.asarray(w)                                 # like cupy: no implicit device -> host copy
    assert "asarray" in fake_cupy.calls


def test_device_value_assigned_to_a_host_variable_is_copied_to_the_host(fake_cupy):
    w = Variable(np.zeros(2), name="host")
    w.assign(fake_cupy.ones(2))
    assert type(w.value) is np.ndarray and w.numpy().tolist() == [1.0, 1.0]


def test_numpy_path_never_imports_cupy():
    code = (
        "import sys, numpy as np, tempfile\n"
        "from stratagem.training.variables import Variable\n"
        "from stratagem.training.optimizers.rules import Adam\n"
        "from stratagem.training import checkpoint\n"
        "w = Variable(np.ones(3, np.float32), name='w')\n"
        "opt = Adam(0.1); opt.apply_gradients([(np.ones(3, np.float32), w)])\n"
        "d = tempfile.mkdtemp(); checkpoint.save(d, {'w': w.value}, opt.state_dict(), 1); checkpoint.load(d)\n"
        "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_docstring_examples():
    result = doctest.testmod(variables_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
