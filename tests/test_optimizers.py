"""Optimizers: the Keras/TF update rules against independent references and torch.optim, in place,
deterministic, dtype-preserving; dispatch to a strategy; configs and state."""

from __future__ import annotations

import doctest

import ml_dtypes
import numpy as np
import pytest

import stratagem
from stratagem.training.optimizers import chunks as chunks_module
from stratagem.training.optimizers import rules as optimizers_module
from stratagem.core.errors import ConfigurationError, StratagemError
from stratagem.core.timeline import OFF
from stratagem.training.optimizers.rules import SGD, Adagrad, Adam, Optimizer, TorchSGD, compute_dtype, from_config
from stratagem.training.variables import Variable, strategy_scope
from stratagem.testing.fake_cupy import FakeDeviceArray

STEPS = 8


def gradients(shape, steps=STEPS, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(steps)]


def run(opt, initial, grads, name="w"):
    w = Variable(np.array(initial, copy=True), name=name)
    for g in grads:
        opt.apply_gradients([(g, w)])
    return w


# -- independent references: textbook formulas, float64, no shared code -------------------------------

def ref_sgd(w, grads, lr, momentum=0.0, nesterov=False):
    w, v = np.array(w, np.float64), np.zeros(np.shape(w))
    for g in grads:
        g = np.asarray(g, np.float64)
        if momentum == 0:
            w = w - lr * g
            continue
        v = momentum * v - lr * g
        w = w + (momentum * v - lr * g if nesterov else v)
    return w


def ref_adam(w, grads, lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    w, m, v = np.array(w, np.float64), np.zeros(np.shape(w)), np.zeros(np.shape(w))
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g ** 2
        lr_t = lr * np.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
        w = w - lr_t * m / (np.sqrt(v) + epsilon)
    return w


def ref_adagrad(w, grads, lr=0.001, initial_accumulator_value=0.1, epsilon=1e-7):
    w = np.array(w, np.float64)
    acc = np.full(np.shape(w), initial_accumulator_value)
    for g in grads:
        g = np.asarray(g, np.float64)
        acc = acc + g ** 2
        w = w - lr * g / (np.sqrt(acc) + epsilon)
    return w


CASES = [
    ("sgd", lambda: SGD(0.1), lambda w, gs: ref_sgd(w, gs, 0.1)),
    ("sgd_momentum", lambda: SGD(0.05, momentum=0.9), lambda w, gs: ref_sgd(w, gs, 0.05, 0.9)),
    ("sgd_nesterov", lambda: SGD(0.05, momentum=0.9, nesterov=True),
     lambda w, gs: ref_sgd(w, gs, 0.05, 0.9, nesterov=True)),
    ("adam", lambda: Adam(0.01), lambda w, gs: ref_adam(w, gs, 0.01)),
    ("adam_custom", lambda: Adam(0.2, beta_1=0.5, beta_2=0.9, epsilon=1e-3),
     lambda w, gs: ref_adam(w, gs, 0.2, 0.5, 0.9, 1e-3)),
    ("adagrad", lambda: Adagrad(0.1), lambda w, gs: ref_adagrad(w, gs, 0.1)),
    ("adagrad_custom", lambda: Adagrad(0.5, initial_accumulator_value=2.0, epsilon=1e-2),
     lambda w, gs: ref_adagrad(w, gs, 0.5, 2.0, 1e-2)),
]


@pytest.mark.parametrize("make, reference", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_float64_matches_the_reference(make, reference):
    initial = np.random.default_rng(1).standard_normal((3, 4))
    grads = gradients((3, 4))
    w = run(make(), initial, grads)
    np.testing.assert_allclose(w.numpy(), reference(initial, grads), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("make, reference", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_float32_matches_the_reference_to_float32_precision(make, reference):
    initial = np.random.default_rng(2).standard_normal(50).astype(np.float32)
    grads = gradients(50, dtype=np.float32)
    w = run(make(), initial, grads)
    assert w.dtype == np.float32
    np.testing.assert_allclose(w.numpy(), reference(initial, grads), rtol=2e-5, atol=2e-6)


def test_hand_computed_values():
    w = run(SGD(0.1, momentum=0.5), [0.0], [np.array([1.0])] * 2)
    np.testing.assert_allclose(w.numpy(), [-0.25])           # v: -0.1, -0.15; w: -0.1, -0.25
    w = run(SGD(0.1, momentum=0.5, nesterov=True), [0.0], [np.array([1.0])] * 2)
    np.testing.assert_allclose(w.numpy(), [-0.15 - 0.175])  # w += 0.5 v - 0.1: -0.15, then -0.175
    w = run(Adam(0.1, epsilon=0.0), [1.0], [np.array([4.0])])
    np.testing.assert_allclose(w.numpy(), [0.9])             # first step: lr * sign(g)
    w = run(Adagrad(1.0, initial_accumulator_value=0.0, epsilon=0.0), [0.0], [np.array([3.0]), np.array([4.0])])
    np.testing.assert_allclose(w.numpy(), [-1.0 - 4.0 / 5.0])


# -- against torch.optim ----------------------------------------------------------------------------

def torch_run(torch, make, initial, grads, before_step=None):
    p = torch.nn.Parameter(torch.from_numpy(np.array(initial, np.float32)))
    opt = make([p])
    for t, g in enumerate(grads, start=1):
        p.grad = torch.from_numpy(np.array(g, np.float32))
        if before_step is not None:
            before_step(opt, t)
        opt.step()
    return p.detach().numpy()


def keras_epsilon_in_torch(epsilon, beta_2=0.999):
    """torch adds eps to sqrt(v)/sqrt(1 - beta_2**t), Keras to sqrt(v): the same update when torch's eps
    at step t is epsilon / sqrt(1 - beta_2**t)."""
    def before_step(opt, t):
        opt.param_groups[0]["eps"] = epsilon / np.sqrt(1 - beta_2 ** t)
    return before_step


TORCH_CASES = [
    ("sgd", lambda: SGD(0.05), lambda torch: (lambda ps: torch.optim.SGD(ps, lr=0.05)), None),
    ("sgd_momentum", lambda: SGD(0.05, momentum=0.9),
     lambda torch: (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)), None),
    ("sgd_nesterov", lambda: SGD(0.05, momentum=0.9, nesterov=True),
     lambda torch: (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)), None),
    # epsilon 0: Keras's and torch's Adam are then the same formula
    ("adam_eps0", lambda: Adam(0.01, epsilon=0.0),
     lambda torch: (lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.999), eps=0.0)), None),
    # a large epsilon, so that where it is added matters: torch's eps mapped to Keras's placement
    ("adam_eps", lambda: Adam(0.01, epsilon=1e-3),
     lambda torch: (lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-3)), keras_epsilon_in_torch(1e-3)),
    ("adagrad", lambda: Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-3),
     lambda torch: (lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1, eps=1e-3)), None),
]


@pytest.mark.parametrize("make, make_torch, before_step", [c[1:] for c in TORCH_CASES],
                         ids=[c[0] for c in TORCH_CASES])
def test_matches_torch_optim(make, make_torch, before_step):
    torch = pytest.importorskip("torch", reason="torch is not installed: cannot compare with torch.optim")
    initial = np.random.default_rng(3).standard_normal((4, 5)).astype(np.float32)
    grads = gradients((4, 5), steps=10, seed=4, dtype=np.float32)
    ours = run(make(), initial, grads).numpy()
    theirs = torch_run(torch, make_torch(torch), initial, grads, before_step)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)  # float32 rounding only


def test_torch_adam_default_epsilon_differs_only_by_epsilon():
    torch = pytest.importorskip("torch", reason="torch is not installed: cannot compare with torch.optim")
    initial = np.random.default_rng(3).standard_normal(20).astype(np.float32)
    grads = gradients(20, steps=10, seed=4, dtype=np.float32)
    ours = run(Adam(0.01), initial, grads).numpy()
    theirs = torch_run(torch, lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-7), initial, grads)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_torch_tensor_gradients_are_converted():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    w = Variable(np.ones(3, np.float32), name="w")
    p = torch.ones(3, requires_grad=True)
    (p * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    SGD(0.1).apply_gradients([(p.grad, w), ])
    SGD(0.1).apply_gradients([(p * 0 + 1, w)])              # a tensor that requires grad: detached
    np.testing.assert_allclose(w.numpy(), [0.8, 0.7, 0.6])


# -- in place, deterministic, dtypes --------------------------------------------------------------

@pytest.mark.parametrize("make", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_updates_are_in_place_and_leave_the_gradient_alone(make):
    w = Variable(np.ones((2, 3), np.float32), name="w")
    buffer = w.value
    opt = make()
    for g in gradients((2, 3), steps=3, dtype=np.float32):
        before = g.copy()
        opt.apply_gradients([(g, w)])
        np.testing.assert_array_equal(g, before)
    assert w.value is buffer and not np.array_equal(buffer, np.ones((2, 3)))


def test_torch_view_sees_the_update():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    w = Variable(np.zeros(2, np.float32), name="w")
    view = torch.from_numpy(w.value)
    Adam(0.5).apply_gradients([(np.array([1.0, -1.0], np.float32), w)])
    assert torch.allclose(view, torch.tensor([-0.5, 0.5]))


@pytest.mark.parametrize("make", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_deterministic_bits(make):
    initial = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    grads = gradients(1000, steps=5, seed=6, dtype=np.float32)
    a = run(make(), initial, grads).numpy()
    b = run(make(), initial, grads).numpy()
    assert a.tobytes() == b.tobytes()


def test_gradient_that_is_the_variable_itself():
    w = Variable(np.array([1.0, 2.0]), name="w")
    reference = Variable(np.array([1.0, 2.0]), name="w_ref")
    opt, opt_ref = Adam(0.1), Adam(0.1)
    for _ in range(3):
        opt.apply_gradients([(w.value, w)])               # e.g. the gradient of 0.5 * |w|^2
        opt_ref.apply_gradients([(reference.numpy(), reference)])
    np.testing.assert_array_equal(w.numpy(), reference.numpy())


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("make", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_half_precision_is_computed_in_float32_and_cast_back(make, dtype):
    initial = np.random.default_rng(7).standard_normal(64).astype(dtype)
    grads = gradients(64, steps=4, seed=8, dtype=np.float32)
    half = Variable(initial, name="half")
    full = Variable(initial.astype(np.float32), name="full")   # the reference: float32, rounded each step
    buffer = half.value
    opt_half, opt_full = make(), make()
    for g in grads:
        opt_half.apply_gradients([(g.astype(dtype), half)])
        opt_full.apply_gradients([(g.astype(dtype).astype(np.float32), full)])
        full.assign(full.numpy().astype(dtype).astype(np.float32))
    assert half.dtype == np.dtype(dtype) and half.value is buffer
    np.testing.assert_array_equal(half.numpy().astype(np.float32), full.numpy())
    for slot in opt_half.slot_names():
        assert opt_half.get_slot(half, slot).dtype == np.float32


def test_adam_on_float16_with_small_gradients_does_not_blow_up():
    w = Variable(np.zeros(4, np.float16), name="w")
    g = np.full(4, 1e-4, np.float16)
    Adam(1e-3).apply_gradients([(g, w)])
    # float16 slots would hold (1 - beta_2) * g*g = 1e-11 -> 0 and step by lr_t * m / epsilon ~ 0.03
    expected = ref_adam(np.zeros(4), [g.astype(np.float64)], lr=1e-3)   # -0.00097
    np.testing.assert_allclose(w.numpy().astype(np.float64), expected, rtol=1e-3)


def test_compute_dtype():
    assert compute_dtype(np.float16) == compute_dtype(ml_dtypes.bfloat16) == np.float32
    assert compute_dtype(np.float32) == np.float32 and compute_dtype(np.float64) == np.float64


# -- slots and iterations ---------------------------------------------------------------------------

def test_slots_are_created_lazily_like_the_variable():
    a = Variable(np.zeros((2, 3), np.float32), name="a")
    b = Variable(np.zeros(5, np.float64), name="b")
    opt = Adam()
    assert opt.state_dict() == {"iterations": 0, "slots": {}}
    opt.apply_gradients([(np.zeros((2, 3), np.float32), a)])
    assert set(opt.state_dict()["slots"]) == {"a"}
    opt.apply_gradients([(None, a), (np.zeros(5), b)])
    state = opt.state_dict()
    assert state["iterations"] == 2
    assert {(k, s, v.shape, v.dtype) for k, slots in state["slots"].items() for s, v in slots.items()} == {
        ("a", "m", (2, 3), np.dtype(np.float32)), ("a", "v", (2, 3), np.dtype(np.float32)),
        ("b", "m", (5,), np.dtype(np.float64)), ("b", "v", (5,), np.dtype(np.float64))}
    assert all(not v.any() for slots in state["slots"].values() for v in slots.values())


def test_adagrad_accumulator_starts_at_its_initial_value():
    w = Variable(np.zeros(3), name="w")
    opt = Adagrad(0.1, initial_accumulator_value=0.7)
    opt.apply_gradients([(np.array([1.0, 2.0, 0.0]), w)])
    np.testing.assert_allclose(opt.get_slot(w, "accumulator"), [1.7, 4.7, 0.7])


def test_plain_sgd_keeps_no_slots():
    w = Variable(np.zeros(3), name="w")
    opt = SGD(0.1)
    opt.apply_gradients([(np.ones(3), w)])
    assert opt.slot_names() == () and opt.state_dict()["slots"] == {"w": {}}
    with pytest.raises(ConfigurationError, match="no slot 'momentum'"):
        opt.get_slot(w, "momentum")
    with pytest.raises(ConfigurationError, match="no state for variable 'other'"):
        Adam().get_slot("other", "m")


def test_adam_uses_the_global_step_like_keras():
    # a variable first updated at step 3 is bias-corrected with t=3, as Keras/TF do
    a, b = Variable(np.zeros(1), name="a"), Variable(np.zeros(1), name="b")
    opt = Adam(0.1, epsilon=0.0)
    opt.apply_gradients([(np.ones(1), a), (None, b)])
    opt.apply_gradients([(np.ones(1), a), (None, b)])
    opt.apply_gradients([(np.ones(1), a), (np.ones(1), b)])
    t = 3
    expected = -0.1 * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t) * 0.1 / np.sqrt(0.001)
    np.testing.assert_allclose(b.numpy(), [expected])
    assert opt.iterations == 3


# -- validation ------------------------------------------------------------------------------------

def test_apply_gradients_validates_its_input():
    w = Variable(np.zeros((2, 2)), name="kernel")
    opt = SGD(0.1)
    with pytest.raises(ConfigurationError, match=r"'kernel' has shape \(4,\), the variable \(2, 2\)"):
        opt.apply_gradients([(np.zeros(4), w)])
    with pytest.raises(ConfigurationError, match="all 1 were None"):
        opt.apply_gradients([(None, w)])
    with pytest.raises(ConfigurationError, match="the list was empty"):
        opt.apply_gradients([])
    with pytest.raises(ConfigurationError, match="must be a stratagem.Variable, not ndarray"):
        opt.apply_gradients([(np.zeros((2, 2)), np.zeros((2, 2)))])
    with pytest.raises(ConfigurationError, match="pairs; item 0 is a ndarray"):
        opt.apply_gradients([np.zeros(3)])
    with pytest.raises(ConfigurationError, match="list of"):
        opt.apply_gradients({w: np.zeros((2, 2))})
    with pytest.raises(ConfigurationError, match="'kernel' appears twice"):
        opt.apply_gradients([(np.zeros((2, 2)), w), (np.zeros((2, 2)), w)])
    with pytest.raises(ConfigurationError, match="not trainable"):
        opt.apply_gradients([(np.zeros(1), Variable(np.zeros(1), name="frozen", trainable=False))])
    with pytest.raises(ConfigurationError, match="floating-point"):
        opt.apply_gradients([(np.zeros(1), Variable(np.zeros(1, np.int32), name="count"))])
    with pytest.raises(ConfigurationError, match="real numbers"):
        opt.apply_gradients([(np.zeros((2, 2), np.complex64), w)])
    with pytest.raises(ConfigurationError, match="real numbers"):
        opt.apply_gradients([("abc", w)])
    with pytest.raises(ConfigurationError, match="'kernel' \\(list\\) is not an array"):
        opt.apply_gradients([([[1.0], [1.0, 2.0]], w)])
    assert opt.iterations == 0 and not w.numpy().any()  # nothing was applied


def test_a_bad_pair_in_apply_dense_changes_nothing():
    a, b = Variable(np.zeros(2), name="a"), Variable(np.zeros(3), name="b")
    opt = SGD(0.1)
    with pytest.raises(ConfigurationError, match="'b'"):
        opt.apply_dense([(np.ones(2), a), (np.ones(2), b)])
    assert opt.iterations == 0 and not a.numpy().any()


def test_two_variables_with_one_name_are_refused():
    opt = Adam()
    first, second = Variable(np.zeros(2), name="same"), Variable(np.zeros(2), name="same")
    opt.apply_gradients([(np.ones(2), first)])
    with pytest.raises(ConfigurationError, match="two different variables named 'same'"):
        opt.apply_gradients([(np.ones(2), second)])


@pytest.mark.parametrize("make, message", [
    (lambda: SGD(-0.1), "learning_rate"),
    (lambda: SGD(float("nan")), "learning_rate"),
    (lambda: SGD(True), "learning_rate must be a number"),
    (lambda: SGD(0.1, momentum=1.5), "momentum"),
    (lambda: SGD(0.1, nesterov="yes"), "nesterov"),
    (lambda: Adam(beta_1=1.0), "beta_1"),
    (lambda: Adam(beta_2=-0.1), "beta_2"),
    (lambda: Adam(epsilon=-1), "epsilon"),
    (lambda: Adagrad(initial_accumulator_value=-1), "initial_accumulator_value"),
])
def test_hyperparameters_are_validated(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_learning_rate_can_change_between_steps():
    w = Variable(np.zeros(1), name="w")
    opt = SGD(0.1)
    opt.apply_gradients([(np.ones(1), w)])
    opt.learning_rate = 0.01
    opt.apply_gradients([(np.ones(1), w)])
    np.testing.assert_allclose(w.numpy(), [-0.11])
    with pytest.raises(ConfigurationError):
        opt.learning_rate = -1


# -- configs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("opt", [SGD(0.3, momentum=0.8, nesterov=True), Adam(0.02, 0.8, 0.99, 1e-6),
                                 Adagrad(0.4, 0.2, 1e-5)], ids=["SGD", "Adam", "Adagrad"])
def test_config_round_trip(opt):
    config = opt.get_config()
    assert config["name"] == type(opt).__name__
    assert all(isinstance(v, (str, float, bool)) for v in config.values())  # plain values only
    rebuilt = from_config(config)
    assert type(rebuilt) is type(opt) and rebuilt.get_config() == config
    assert from_config({**config, "name": config["name"].lower()}).get_config() == config


def test_from_config_errors():
    with pytest.raises(ConfigurationError, match="unknown optimizer 'RMSprop'; known: Adagrad, Adam, SGD"):
        from_config({"name": "RMSprop"})
    with pytest.raises(ConfigurationError, match="bad config for optimizer Adam.*momentum"):
        from_config({"name": "Adam", "momentum": 0.9})
    with pytest.raises(ConfigurationError, match="with a 'name'"):
        from_config({"learning_rate": 0.1})


def test_public_module():
    assert stratagem.optimizers.SGD is SGD and stratagem.optimizers.Adam is Adam
    assert stratagem.optimizers.Adagrad is Adagrad and stratagem.optimizers.Optimizer is Optimizer
    assert stratagem.optimizers.from_config is from_config
    assert stratagem.Variable is Variable
    assert repr(SGD(0.1)) == "SGD(learning_rate=0.1, momentum=0.0, nesterov=False)"


# -- strategies ---------------------------------------------------------------------------------------

class FakeStrategy:
    """The strategy hooks an optimizer calls; applies locally and records the pairs it was given."""

    recorder = OFF   # no timeline (a real strategy's is its transport's)

    def __init__(self):
        self.variables, self.optimizers, self.calls = [], [], []

    def on_variable(self, var):
        self.variables.append(var)

    def on_optimizer(self, optimizer):
        self.optimizers.append(optimizer)

    def on_apply_gradients(self, optimizer, pairs):
        self.calls.append((optimizer, pairs))
        optimizer.apply_dense(pairs)

    def scope(self):
        return strategy_scope(self)


def test_an_optimizer_made_in_scope_hands_gradients_to_its_strategy():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    strategy = FakeStrategy()
    with strategy.scope():
        a = Variable(np.zeros(2, np.float32), name="a")
        b = Variable(np.zeros(3, np.float32), name="b")
        opt = SGD(0.5)
    assert opt.strategy is strategy and strategy.optimizers == [opt]   # known before its first step
    assert opt.apply_gradients([(torch.ones(2), a), (None, b)]) == 1
    [(called, pairs)] = strategy.calls
    assert called is opt and [v for _, v in pairs] == [a]
    assert type(pairs[0][0]) is np.ndarray  # normalised before the strategy sees it
    np.testing.assert_array_equal(a.numpy(), [-0.5, -0.5])


def test_an_optimizer_outside_any_scope_updates_at_once():
    opt = SGD(0.5)
    assert opt.strategy is None
    w = Variable(np.zeros(1), name="w")
    assert opt.apply_gradients(zip([np.ones(1)], [w])) == 1 and w.numpy()[0] == -0.5


def test_optimizer_and_variables_must_share_a_strategy():
    strategy, other = FakeStrategy(), FakeStrategy()
    with strategy.scope():
        inside = Variable(np.zeros(1), name="inside")
        opt_inside = SGD(0.1)
    with other.scope():
        opt_other = SGD(0.1)
    outside, opt_outside = Variable(np.zeros(1), name="outside"), SGD(0.1)
    with pytest.raises(ConfigurationError, match="created outside strategy.scope\\(\\): create the optimizer inside"):
        opt_outside.apply_gradients([(np.ones(1), inside)])
    with pytest.raises(ConfigurationError, match="'outside' was created outside strategy.scope"):
        opt_inside.apply_gradients([(np.ones(1), outside)])
    with pytest.raises(ConfigurationError, match="different strategies"):
        opt_other.apply_gradients([(np.ones(1), inside)])
    assert strategy.calls == [] and other.calls == []


def test_update_array_for_a_parameter_server_shard():
    opt = from_config(Adam(0.1).get_config())
    shard = np.ones(3, np.float32)
    with pytest.raises(StratagemError, match="iterations >= 1"):
        opt.update_array("shard", shard, np.ones(3, np.float32))
    opt.iterations += 1
    opt.update_array("shard", shard, np.ones(3, np.float32))
    np.testing.assert_allclose(shard, np.float32(0.9), rtol=1e-5)
    with pytest.raises(ConfigurationError, match="shape"):
        opt.update_array("shard", shard, np.ones(2, np.float32))


# -- chunked updates and updates out of place -------------------------------------------------------

def chunks_from(monkeypatch, nbytes, chunk=64):
    """Every built-in rule updates variables of at least ``nbytes`` in chunks of ``chunk`` elements."""
    monkeypatch.setattr(chunks_module, "CHUNK", chunk)
    for cls in (SGD, Adam, Adagrad):
        monkeypatch.setattr(cls, "chunk_from_bytes", nbytes)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 elements, so that small arrays take the chunked path (large ones do for real)."""
    chunks_from(monkeypatch, 0)


def updated(make, initial, grads, *, out=False):
    """Run ``update_array`` over ``grads``; returns the final value and the slots (in place, or with
    ``out=`` into alternating buffers, checking each time that the input is left alone)."""
    opt, value = make(), np.array(initial, copy=True)
    for g in grads:
        opt.iterations += 1
        if out:
            before, target = value.copy(), np.full_like(value, 7)
            opt.update_array("w", value, g, out=target)
            assert value.tobytes() == before.tobytes()
            value = target
        else:
            opt.update_array("w", value, g)
    return value, {k: v.copy() for k, v in opt._slots.get("w", {}).items()}


@pytest.mark.parametrize("grad_dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("make", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_chunked_and_out_of_place_updates_give_the_same_bits(make, dtype, grad_dtype, monkeypatch):
    """The whole-array update is the reference: chunked (an odd length, so the last chunk is short)
    and out of place must give the very same bits, for the value and the slots."""
    initial = np.random.default_rng(9).standard_normal(1000 + 3).astype(dtype)
    grads = [(g * 3).astype(grad_dtype) for g in gradients(1003, steps=4, seed=10)]
    chunks_from(monkeypatch, 1 << 62)                                    # whole arrays
    whole, whole_slots = updated(make, initial, grads)
    chunks_from(monkeypatch, 0)
    for out in (False, True):
        value, slots = updated(make, initial, grads, out=out)
        assert value.tobytes() == whole.tobytes()
        assert {k: v.tobytes() for k, v in slots.items()} == {k: v.tobytes() for k, v in whole_slots.items()}


@pytest.mark.parametrize("chunk_bytes", [0, 1 << 62], ids=["chunked", "whole"])
@pytest.mark.parametrize("make", [c[1] for c in CASES] + [lambda: TorchSGD(0.1, momentum=0.9)],
                         ids=[c[0] for c in CASES] + ["torch_sgd"])
def test_an_update_written_over_its_gradient_gives_the_same_bits(make, chunk_bytes, monkeypatch):
    """``update_array(..., out=grad)`` (a parameter server writing over a received gradient): the
    same bits as in place, the value left alone; the built-in rules do it without a copy of the
    gradient, a rule given as ``_update`` (TorchSGD) copies it first."""
    initial = np.random.default_rng(3).standard_normal(1003).astype(np.float32)
    grads = [g.astype(np.float32) for g in gradients(1003, steps=4, seed=11)]
    chunks_from(monkeypatch, 1 << 62)
    expected, expected_slots = updated(make, initial, grads)
    chunks_from(monkeypatch, chunk_bytes)
    opt, value = make(), initial.copy()
    assert opt.writes_over_gradient == (type(opt) in (SGD, Adam, Adagrad))
    for g in grads:
        opt.iterations += 1
        before, buffer = value.copy(), g.copy()
        opt.update_array("w", value, buffer, out=buffer)
        assert value.tobytes() == before.tobytes()
        value = buffer
    assert value.tobytes() == expected.tobytes()
    assert {k: v.tobytes() for k, v in opt._slots["w"].items()} == {k: v.tobytes() for k, v in expected_slots.items()}


@pytest.mark.parametrize("make, reference", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_chunked_updates_match_the_reference(make, reference, small_chunks):
    initial = np.random.default_rng(1).standard_normal((40, 7))
    grads = gradients((40, 7))
    w = run(make(), initial, grads)
    np.testing.assert_allclose(w.numpy(), reference(initial, grads), rtol=1e-12, atol=1e-14)


def test_chunked_update_with_the_variable_as_its_gradient(small_chunks):
    w = Variable(np.linspace(-1, 1, 300), name="w")
    reference = Variable(np.linspace(-1, 1, 300), name="w_ref")
    opt, opt_ref = Adam(0.1), Adam(0.1)
    for _ in range(3):
        opt.apply_gradients([(w.value, w)])
        opt_ref.apply_gradients([(reference.numpy(), reference)])
    np.testing.assert_array_equal(w.numpy(), reference.numpy())


def test_a_subclass_overriding_update_is_not_chunked_unless_it_says_so(small_chunks):
    """Clipping by the gradient's norm is not elementwise: run in chunks it would clip each chunk."""
    class Clipped(SGD):
        def _update(self, xp, w, g, slots, t):
            super()._update(xp, w, g / max(1.0, float(np.linalg.norm(g))), slots, t)

    w = Variable(np.zeros(1000), name="w")
    Clipped(1.0).apply_gradients([(np.ones(1000), w)])
    np.testing.assert_allclose(w.numpy(), -1.0 / np.sqrt(1000))


def test_update_array_out_must_be_a_separate_array_like_the_value():
    opt = SGD(0.1)
    opt.iterations += 1
    value = np.ones(4, np.float32)
    for bad in (np.ones(3, np.float32), np.ones(4, np.float64), value, value[::-1]):
        with pytest.raises(ConfigurationError, match="out="):
            opt.update_array("w", value, np.ones(4, np.float32), out=bad)
    np.testing.assert_array_equal(value, 1.0)


def test_a_variable_with_a_remote_store_is_written_back():
    from stratagem.training.variables import VariableStore

    class CopyStore(VariableStore):
        def __init__(self, array):
            self.array = np.array(array, copy=True)

        def read(self):
            return self.array.copy()

        def write(self, array):
            self.array = np.array(array, copy=True)

    class Sharding(FakeStrategy):
        def on_variable(self, var):
            super().on_variable(var)
            var.store = CopyStore(var.value)

    strategy = Sharding()
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")
        opt = SGD(0.25)
    opt.apply_gradients([(np.ones(2), w)])
    np.testing.assert_array_equal(w.numpy(), [-0.25, -0.25])


# -- state ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_state_round_trip_gives_the_same_next_update(make):
    grads = gradients((3,), steps=6, seed=9)
    uninterrupted = Variable(np.ones(3), name="w")
    opt = make()
    for g in grads[:4]:
        opt.apply_gradients([(g, uninterrupted)])
    state = opt.state_dict()
    resumed = Variable(uninterrupted.numpy(), name="w_resumed")
    opt2 = make()
    opt2.load_state_dict({"iterations": state["iterations"], "slots": {"w_resumed": state["slots"]["w"]}})
    assert opt2.iterations == 4
    for g in grads[4:]:
        opt.apply_gradients([(g, uninterrupted)])
        opt2.apply_gradients([(g, resumed)])
    assert uninterrupted.numpy().tobytes() == resumed.numpy().tobytes()


def test_state_dict_and_load_state_dict_copy():
    w = Variable(np.zeros(2), name="w")
    opt = SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.ones(2), w)])
    state = opt.state_dict()
    state["slots"]["w"]["momentum"][:] = 100
    assert opt.get_slot(w, "momentum")[0] == pytest.approx(-0.1)
    source = {"iterations": 1, "slots": {"w": {"momentum": np.full(2, 5.0)}}}
    opt.load_state_dict(source)
    source["slots"]["w"]["momentum"][:] = 0
    assert opt.get_slot(w, "momentum")[0] == 5.0


def test_loaded_slots_take_the_variable_compute_dtype():
    w = Variable(np.zeros(2, np.float16), name="w")
    opt = Adam()
    opt.load_state_dict({"iterations": 2, "slots": {"w": {"m": np.ones(2, ml_dtypes.bfloat16),
                                                          "v": np.ones(2, np.float64)}}})
    opt.apply_gradients([(np.ones(2, np.float16), w)])
    assert opt.get_slot(w, "m").dtype == opt.get_slot(w, "v").dtype == np.float32


@pytest.mark.parametrize("state, message", [
    ({"slots": {}}, "state_dict"),
    ([], "state_dict"),
    ({"iterations": -1, "slots": {}}, "iterations must be an integer >= 0"),
    ({"iterations": 1.5, "slots": {}}, "iterations must be an integer >= 0"),
    ({"iterations": 1, "slots": []}, "slots must be a dict"),
    ({"iterations": 1, "slots": {"w": {"m": np.zeros(2)}}}, r"has slots \['m'\], this optimizer keeps \['m', 'v'\]"),
    ({"iterations": 1, "slots": {"w": {"m": np.zeros(2), "v": np.zeros(2, np.int64)}}}, "not a floating-point"),
])
def test_load_state_dict_validates(state, message):
    opt = Adam()
    with pytest.raises(ConfigurationError, match=message):
        opt.load_state_dict(state)
    assert opt.iterations == 0


def test_state_of_another_shape_is_refused_at_the_next_update():
    w = Variable(np.zeros(3), name="w")
    opt = Adam()
    opt.load_state_dict({"iterations": 1, "slots": {"w": {"m": np.zeros(2), "v": np.zeros(2)}}})
    with pytest.raises(ConfigurationError, match=r"slot 'm' has shape \(2,\), the variable \(3,\)"):
        opt.apply_gradients([(np.ones(3), w)])


# -- array modules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, reference", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_device_variables_are_updated_with_their_array_module(fake_cupy, make, reference):
    fake = fake_cupy
    initial = np.random.default_rng(10).standard_normal(6)
    grads = gradients(6, steps=3, seed=11)
    w = Variable(fake.asarray(initial), name="w")
    opt = make()
    for i, g in enumerate(grads):
        opt.apply_gradients([((fake.asarray(g) if i % 2 else g), w)])   # host gradients are moved
    assert isinstance(w.value, FakeDeviceArray)
    assert all(isinstance(s, FakeDeviceArray) for s in opt.state_dict()["slots"]["w"].values())
    np.testing.assert_allclose(w.numpy(), reference(initial, grads), rtol=1e-12)
    assert {"zeros", "full"} & set(fake.calls) or not opt.slot_names()      # slots made by "cupy"
    assert "asarray" in fake.calls                                          # the host gradient moved


def test_device_gradient_for_a_host_variable_is_copied_to_the_host(fake_cupy):
    fake = fake_cupy
    w = Variable(np.zeros(2), name="w")
    SGD(1.0).apply_gradients([(fake.ones(2), w)])
    assert type(w.value) is np.ndarray and w.numpy().tolist() == [-1.0, -1.0]


def test_docstring_examples():
    result = doctest.testmod(optimizers_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
    import stratagem.optimizers as public

    assert doctest.testmod(public).failed == 0
