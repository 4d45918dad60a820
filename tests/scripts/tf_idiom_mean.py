"""TF's loss idiom under a strategy that averages (the default): the plain script a TF user writes.

compute_average_loss divides by the global batch, which under gradient_reduction="mean" would train at
1/N: it raises ConfigurationError instead, printed as one line per task (tests/test_tf_distribute.py).
"""
import numpy as np
import stratagem

strategy = stratagem.strategy("mirrored")          # gradient_reduction="mean": the wrong combination
with strategy.scope():
    w = stratagem.Variable(np.zeros(3, np.float32), name="w")
    optimizer = stratagem.optimizers.SGD(learning_rate=0.1)


def train_step(x):
    loss = stratagem.nn.compute_average_loss(np.sum(x, axis=1) ** 2, global_batch_size=8)
    optimizer.apply_gradients([(np.ones(3, np.float32), w)])
    return loss


for x in strategy.experimental_distribute_dataset([np.ones((8, 3), np.float32)]):
    strategy.reduce(stratagem.ReduceOp.SUM, strategy.run(train_step, args=(x,)), axis=None)
