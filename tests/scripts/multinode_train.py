"""The plain mirrored training script a user runs under ``stratagem launch`` (tests/test_multinode.py):
no shutdown, no ``__main__`` guard. Every replica prints a digest of its final weights' bytes, so that
launches can be compared bitwise.

    multinode_train.py [STEPS]
"""

import hashlib
import sys

import mirrored_model as model
import stratagem

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
strategy = stratagem.strategy("mirrored")
with strategy.scope():
    params, opt = model.create("sgd", seed=1 if strategy.is_chief else 7)
for x, y in strategy.distribute_dataset(model.global_batches(0, steps, 24)):
    loss, grads = model.loss_and_grads({n: v.value for n, v in params.items()}, x, y)
    opt.apply_gradients([(grads[n], params[n]) for n in model.PARAM_NAMES])
digest = hashlib.sha256(b"".join(params[n].numpy().tobytes() for n in model.PARAM_NAMES)).hexdigest()
print(f"weights {digest} after {steps} steps")
