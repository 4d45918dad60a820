"""A plain user script run under Slurm-like variables (tests/test_slurm.py): ``srun python3 this.py OUT``.

Resolves its cluster from the environment, then under ``mirrored`` over the transport named on the
command line (default zmq) all-reduces its rank and trains one step on a 5-row batch (3 rows and 2),
then writes ``OUT/<SLURM_PROCID>.json``.
"""

import json
import os
import sys

import numpy as np

import stratagem

out, transport = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "zmq")
resolved = stratagem.ClusterResolver.from_env()
with stratagem.strategy("mirrored", transport=transport, timeout=30,
                        transport_options={"timeout": 30}) as strategy:
    rank = strategy.cluster.replicas().index(strategy.task)
    total = strategy.reduce("sum", np.full(3, rank + 1.0))
    with strategy.scope():
        w = stratagem.Variable(np.zeros(2), name="w")
        opt = stratagem.optimizers.SGD(learning_rate=1.0)
    for (x,) in strategy.distribute_dataset([(np.arange(5.0),)]):    # 3 rows and 2 rows
        opt.apply_gradients([(np.full(2, -x.mean()), w)])
        loss = strategy.reduce("mean", float(x.mean()))

record = {"task": resolved.task.short, "source": resolved.source, "cluster": resolved.cluster.as_dict(),
          "rank": rank, "total": total.tolist(), "w": w.numpy().tolist(), "loss": loss}
with open(os.path.join(out, f"{os.environ['SLURM_PROCID']}.json"), "w") as f:
    json.dump(record, f)
