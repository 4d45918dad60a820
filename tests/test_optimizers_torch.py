"""stratagem's TorchSGD / TorchAdam / TorchAdagrad (numpy, no torch inside) against ``torch.optim`` itself.

The same gradients (random, of varied scale, some tiny so that Adam's epsilon placement matters) are
fed for 30 steps to a torch optimizer on a torch parameter and to the stratagem rule on a numpy
variable; the weights must agree within 1e-6 at every step. These are the rules the ps tasks run
when ``stratagem.torch.DistributedOptimizer`` wraps a torch optimizer under ``between_graph``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from stratagem.training.optimizers.base import from_config  # noqa: E402
from stratagem.training.optimizers.torch_rules import TorchAdagrad, TorchAdam, TorchSGD  # noqa: E402
from stratagem.training.variables import Variable  # noqa: E402

STEPS = 30

CASES = [
    (torch.optim.SGD, dict(lr=0.1), TorchSGD, dict(learning_rate=0.1)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9), TorchSGD, dict(learning_rate=0.05, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
     TorchSGD, dict(learning_rate=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3, maximize=True),
     TorchSGD, dict(learning_rate=0.05, momentum=0.8, dampening=0.3, maximize=True)),
    (torch.optim.Adam, dict(lr=0.01), TorchAdam, dict(learning_rate=0.01)),
    (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True),
     TorchAdam, dict(learning_rate=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6, weight_decay=0.1, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05),
     TorchAdam, dict(learning_rate=0.01, weight_decay=0.05, decoupled_weight_decay=True)),
    (torch.optim.Adagrad, dict(lr=0.1), TorchAdagrad, dict(learning_rate=0.1)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.5, eps=1e-8),
     TorchAdagrad, dict(learning_rate=0.1, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.5,
                        epsilon=1e-8)),
]


@pytest.mark.parametrize("torch_cls, torch_kwargs, rule_cls, rule_kwargs", CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)])
def test_rule_matches_torch_optim(torch_cls, torch_kwargs, rule_cls, rule_kwargs):
    rng = np.random.default_rng(0)
    initial = rng.normal(size=(6, 5)).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(initial.copy()))
    reference = torch_cls([param], **torch_kwargs)
    var = Variable(initial, name="w")
    rule = rule_cls(**rule_kwargs)
    # Gradients from 1e-6 to 1: Adam's epsilon (1e-8, outside the bias correction) matters at the low end.
    scales = np.logspace(-6, 0, initial.size).reshape(initial.shape).astype(np.float32)
    for step in range(STEPS):
        grad = (rng.normal(size=initial.shape).astype(np.float32) * scales)
        param.grad = torch.from_numpy(grad.copy())
        reference.step()
        rule.apply_gradients([(grad, var)])
        np.testing.assert_allclose(var.numpy(), param.detach().numpy(), rtol=0, atol=1e-6,
                                   err_msg=f"step {step + 1}")
    assert np.abs(var.numpy() - initial).max() > 1e-2   # the weights moved: the match means something
    # The slots hold what torch's state holds, under the same names.
    for slot in rule.slot_names():
        np.testing.assert_allclose(rule.get_slot(var, slot), reference.state[param][slot].numpy(), rtol=1e-5,
                                   atol=1e-7)
    assert from_config(rule.get_config()).get_config() == rule.get_config()


def test_keras_adam_is_not_torch_adam_for_small_gradients():
    """Why TorchAdam exists: TF/Keras Adam puts epsilon inside the bias correction and differs."""
    from stratagem.training.optimizers.rules import Adam

    grad = np.full(3, 1e-6, np.float32)
    a, b = Variable(np.zeros(3, np.float32), name="a"), Variable(np.zeros(3, np.float32), name="b")
    Adam(learning_rate=0.1, epsilon=1e-8).apply_gradients([(grad, a)])
    TorchAdam(learning_rate=0.1, epsilon=1e-8).apply_gradients([(grad, b)])
    assert abs(float(a.numpy()[0]) - float(b.numpy()[0])) > 1e-3


def test_bad_settings_are_refused_with_the_reason():
    from stratagem.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="Nesterov"):
        TorchSGD(0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ConfigurationError, match="amsgrad must be True or False"):
        TorchAdam(amsgrad="yes")
