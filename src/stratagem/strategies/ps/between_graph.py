"""The ``between_graph`` strategy: TF1's between-graph replication over parameter servers (README: "Parameter servers").

Every task runs the same script. ``ps`` tasks serve the variables from inside
``stratagem.strategy("between_graph", ...)`` and exit when training ends; every ``chief``/``worker``
task runs its own training loop against them:

- variables created in ``scope()`` live on the ps tasks, placed by ``placement=`` (round-robin or
  greedy by bytes), by ``stratagem.replica_device_setter(...)`` or by an explicit
  ``stratagem.device("/job:ps/task:1")``; those larger than ``partition_bytes`` are split across shards;
- the chief initialises them (or restores the latest checkpoint of ``checkpoint_dir=``); the other
  workers wait for it, then start;
- reading a variable pulls fresh values when an update happened since the last read;
  ``optimizer.apply_gradients`` pushes the gradients, and the optimizer runs on the ps tasks;
- ``mode="async"`` (default: every push applied as it arrives), ``"sync"`` (each update averages
  ``replicas_to_aggregate`` workers' gradients for the same step; with ``total_replicas`` more than
  that, the slowest are backup workers whose stale gradients are dropped and counted), or
  ``"bounded"`` with ``staleness=s`` (no worker runs more than ``s`` steps ahead of the slowest);
- the chief decides when to stop (``strategy.request_stop()``; every worker's ``should_stop()``
  turns true) and writes the checkpoints (``strategy.save(dir)``).

A dead ps task makes every worker's next request raise
:class:`~stratagem.ps_service.protocol.ShardLostError` naming it (a ``PeerLostError``); under ``async`` a
dead worker does not stop the others. Options: those of
:class:`~stratagem.strategies.ps.base.PSStrategyBase`.

One ps task and two workers as threads of one process (over processes: the same script under
``stratagem launch --ps 1 --worker 2`` with ``transport="zmq"``)::

    >>> import threading
    >>> import numpy as np
    >>> import stratagem
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.transports.local import LocalFabric
    >>> cluster, fabric = ClusterSpec({"worker": ["local:0", "local:1"], "ps": ["local:2"]}), LocalFabric()
    >>> def task(name, results):
    ...     with BetweenGraphStrategy("local", cluster=cluster, task=name, mode="sync", exit_after_serving=False,
    ...                               transport_options={"fabric": fabric, "timeout": 30}) as strategy:
    ...         if name.startswith("ps"):
    ...             return                                     # served until the workers left
    ...         with strategy.scope():
    ...             w = stratagem.Variable(np.zeros(2, np.float32), name="w")
    ...             opt = stratagem.optimizers.SGD(learning_rate=0.5)
    ...         for _ in range(2):
    ...             opt.apply_gradients([(np.ones(2, np.float32) * (1 + strategy.task.index), w)])
    ...         results[name] = (w.numpy(), strategy.global_step)
    >>> results = {}
    >>> threads = [threading.Thread(target=task, args=(t, results)) for t in ("ps:0", "worker:0", "worker:1")]
    >>> for t in threads: t.start()
    >>> for t in threads: t.join()
    >>> results["worker:0"], results["worker:1"]        # two steps of the mean gradient 1.5, lr 0.5
    ((array([-1.5, -1.5], dtype=float32), 2), (array([-1.5, -1.5], dtype=float32), 2))
"""

from __future__ import annotations

from stratagem.strategies.ps.base import PSStrategyBase


class BetweenGraphStrategy(PSStrategyBase):
    """Every worker trains against the ps tasks (TF1 between-graph replication); see the module doc."""

    name = "between_graph"
