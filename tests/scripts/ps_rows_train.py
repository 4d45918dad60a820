"""The embedding model of embedding_model.py trained by rows over zmq (tests/test_ps_rows.py).

    ps_rows_train.py OUT_DIR OPTIMIZER STEPS ROWS      (under ``stratagem launch --ps 2 --worker 1``)

``between_graph``, ``async``, the table partitioned over the ps tasks. The worker reads the table
only with ``gather`` and pushes ``IndexedSlices``; it writes ``OUT_DIR/worker_0.npz`` (the final
table, read with ``table.value`` after the steps, and ``w``) and ``OUT_DIR/worker_0.json`` (payload
bytes of the training steps, per step, sent and received; the shards' counters). ps tasks serve and
exit.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stratagem  # noqa: E402
import embedding_model as model  # noqa: E402

out, optimizer, steps, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
strategy = stratagem.strategy("between_graph", transport="zmq", mode="async", partition_bytes=16 << 10,
                              transport_options={"timeout": 60})
with strategy.scope():
    table, w, opt = model.create(optimizer)
before = strategy.transport.traffic.snapshot()
for ids, y in model.global_batches(0, steps, rows):
    model.train_step(table, w, opt, ids, y, sparse=True)
traffic = strategy.transport.traffic.snapshot() - before
stats = strategy.ps_stats()
np.savez(os.path.join(out, "worker_0.npz"), table=table.numpy(), w=w.numpy())
with open(os.path.join(out, "worker_0.json"), "w") as f:
    json.dump({"sent_per_step": traffic.sent_bytes() / steps, "received_per_step": traffic.received_bytes() / steps,
               "table_bytes": int(table.value.nbytes), "pieces": [p.ps for p in strategy.pieces("table")],
               "stats": {str(i): {k: s[k] for k in ("pulls", "row_pulls", "updates", "applied")}
                         for i, s in stats.items()}}, f)
strategy.shutdown()
