"""The optimizers: ``stratagem.optimizers.SGD``, ``Adam``, ``Adagrad`` (Keras/TF update rules), and
``TorchSGD``, ``TorchAdam``, ``TorchAdagrad`` (``torch.optim``'s rules, without torch).

Create them inside ``strategy.scope()`` so that ``apply_gradients`` synchronises the replicas; see
:mod:`stratagem.training.optimizers.rules` for the update rules and :mod:`stratagem.training.optimizers.base` for
precision.

>>> import numpy as np, stratagem
>>> w = stratagem.Variable(np.ones(2, np.float32), name="optimizers_demo")
>>> opt = stratagem.optimizers.SGD(learning_rate=0.1)
>>> opt.apply_gradients([(np.ones(2, np.float32), w)]); w.numpy()
1
array([0.9, 0.9], dtype=float32)
>>> stratagem.optimizers.from_config(opt.get_config())
SGD(learning_rate=0.1, momentum=0.0, nesterov=False)
"""

from stratagem.training.optimizers.rules import SGD, Adagrad, Adam, Optimizer, TorchAdagrad, TorchAdam, TorchSGD, from_config

__all__ = ["SGD", "Adam", "Adagrad", "TorchSGD", "TorchAdam", "TorchAdagrad", "Optimizer", "from_config"]
