"""The ``mirrored`` strategy: a full copy of every variable on every replica, gradients all-reduced
every step (README: "Training with a strategy").

Every replica (the ``chief`` and ``worker`` tasks) runs the same program on its shard of each global
batch (SPMD). Variables created in ``scope()`` are local arrays; when the outermost ``scope()`` block
ends, the replicas check that they created the same variables (names, shapes, dtypes) and take the
chief's initial values, so they start identical. ``optimizer.apply_gradients`` is the sync point:

1. each replica scales its gradients by its share of the global batch (its rows over the batch's,
   recorded by ``distribute_dataset``; ``1/N`` without it), so the sum is the whole batch's mean;
2. the gradients are packed into flat buckets of at most ``bucket_bytes`` (one dtype per bucket,
   laid out by variable name, the buffers kept from step to step);
3. each bucket is all-reduced in place; with ``compression`` (a compressor plugin: ``"fp16"``,
   ``"bf16"``, ``"topk"``, ``"powersgd"``...) its floating-point gradients go through
   ``compressor.allreduce`` instead, which sums their compressed payloads (one collective per payload
   dtype and phase for the whole bucket), keeping each variable's error-feedback residual here;
4. every replica applies the same averaged gradients with ``optimizer.apply_dense``.

The all-reduce hands every replica the same bits (compressed ones too: every compressor's reduction
gives every replica the same sum), and the update is deterministic, so replicas stay bitwise identical
step after step.

Two replicas as threads of one process (the ``local`` transport); across processes, run the same
script under ``stratagem launch --worker 2`` with ``transport="zmq"``::

    >>> import threading
    >>> import numpy as np
    >>> import stratagem
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.transports.local import LocalFabric
    >>> cluster, fabric = ClusterSpec({"worker": ["local:0", "local:1"]}), LocalFabric()
    >>> def replica(index, results):
    ...     with MirroredStrategy("local", cluster=cluster, task=f"worker:{index}",
    ...                           transport_options={"fabric": fabric, "timeout": 30}) as strategy:
    ...         with strategy.scope():
    ...             w = stratagem.Variable(np.full(2, float(index)), name="w")  # the chief's value wins
    ...             opt = stratagem.optimizers.SGD(learning_rate=0.5)
    ...         opt.apply_gradients([(np.full(2, index + 1.0), w)])             # mean gradient: 1.5
    ...         results[index] = w.numpy()
    >>> results = [None, None]
    >>> threads = [threading.Thread(target=replica, args=(i, results)) for i in range(2)]
    >>> for t in threads: t.start()
    >>> for t in threads: t.join()
    >>> results
    [array([-0.75, -0.75]), array([-0.75, -0.75])]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.training.replica_sync import allgather_json, broadcast_arrays, dtype_key
from stratagem.compression.base import FLOAT_DTYPES
from stratagem.strategies.base import Strategy
from stratagem.strategies import compressing
from stratagem.training.variables import array_module, is_device_array
from stratagem.strategies.mirrored.elastic import ElasticTraining, check_elastic_transport, elastic_wrapper

#: Default largest bucket of fused gradients, in bytes (before any compression).
DEFAULT_BUCKET_BYTES = 25 << 20
#: Bucket layouts kept (one per distinct set of gradients); the oldest is dropped beyond this.
MAX_PLANS = 8
#: Differences between replicas listed in one error message.
MAX_LISTED = 10
#: What ``on_failure`` may be: ``raise`` (a lost replica fails the others) or ``shrink`` (elastic).
ON_FAILURE = ("raise", "shrink")


class MirroredStrategy(Strategy):
    """Synchronous data parallelism: mirrored variables, all-reduced gradients (see the module doc).

    Options:
        bucket_bytes: largest bucket of fused gradients, in bytes (default 25 MiB). Fewer, larger
            buckets mean fewer all-reduce calls; a gradient larger than this gets a bucket of its own.
        compression: ``None``, a compressor's name (``"fp16"``, ``"bf16"``: half the bytes; ``"topk"``;
            ``"powersgd"``; any registered one) with ``compression_options={...}``, or a compressor from
            ``stratagem.compressor(name, **options)``. Floating-point gradients are all-reduced
            compressed (:mod:`stratagem.compression.base`); replicas stay identical either way. Each
            replica keeps its own error-feedback residuals, which ``save()`` does not write.
        chunk_bytes, small_bytes, timeout: the replicas' :class:`~stratagem.collectives.communicator.Communicator`
            settings (default: the communicator's, and the transport's timeout).
        on_failure: ``"raise"`` (default): a lost replica makes the others raise ``PeerLostError``
            naming it. ``"shrink"``: elastic training (:mod:`stratagem.strategies.mirrored.elastic`):
            the training function runs in ``strategy.elastic(fn)``; when a replica is lost the
            survivors roll back to the last ``commit()``, go on without it and retry, and a restarted
            worker joins at the next commit. Needs a transport whose world can change (``zmq``,
            ``grpc``, ``shm``, ``local``), not ``mpi`` or ``nccl``; the chief must survive.
        commit_every: under shrink, commit before every ``commit_every``-th batch that
            ``distribute_dataset`` yields (default 1; ``None``: only your ``commit()`` calls).

    Plus every strategy's keywords (``cluster``, ``task``, ``transport_options``, ``plugins``).

    Elastic training, as a plain script run with ``stratagem launch --worker 3 --restart-workers 1 --
    python3 train.py`` (``my_gradients`` and ``batches``, a list of global batches, are yours)::

        strategy = stratagem.strategy("mirrored", on_failure="shrink")
        with strategy.scope():
            w = stratagem.Variable(np.zeros(10, np.float32), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=0.1)

        @strategy.elastic                      # run again from the last commit when the world changes
        def train():
            for x, y in strategy.distribute_dataset(batches):   # commits every batch, fast-forwards
                opt.apply_gradients([(my_gradients(w.value, x, y), w)])

        strategy.on_reset(lambda change: print("now", change.size, "replicas; lost", change.lost))
        train()
    """

    name = "mirrored"
    #: The resolved compressor (``None``: gradients travel as they are) and each variable's state.
    compressor = None
    compression_states = None
    options = {
        **compressing.OPTIONS,
        "bucket_bytes": DEFAULT_BUCKET_BYTES,
        "chunk_bytes": None,
        "small_bytes": None,
        "timeout": None,
        "on_failure": "raise",
        "commit_every": 1,
    }

    def __init__(self, transport=None, **kwargs):
        self._elastic = None
        if kwargs.get("on_failure") == "shrink":
            check_elastic_transport(transport, kwargs.get("plugins"))
        super().__init__(transport, **kwargs)
        self._plans: dict[tuple, _Plan] = {}   # gradient signature -> buckets (buffers reused)
        if self.config["on_failure"] == "shrink":
            self._elastic = ElasticTraining(self, self.config["commit_every"], sync_variables=self._sync_variables,
                                            forget_plans=self._plans.clear)
        if self.task not in self.cluster.replicas():
            refusal = self._not_a_replica("the mirrored replicas' all-reduce",
                                          "use the parameter_server strategy for clusters with 'ps' tasks, or "
                                          "start no strategy on them")
            self.shutdown()
            raise refusal
        compressing.check_transport(self)

    # -- options -----------------------------------------------------------------------------------
    def _check_config_impl(self) -> None:
        config = self.config
        _check_int("bucket_bytes", config["bucket_bytes"], 1)
        self.compressor, self.compression_states = compressing.resolve(self.name, self.config, self._plugins)
        for option, minimum in (("chunk_bytes", 1), ("small_bytes", 0)):
            if config[option] is not None:
                _check_int(option, config[option], minimum)
        timeout = config["timeout"]
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ConfigurationError(f"timeout must be a number of seconds > 0 (or None), got {timeout!r}")
        if config["on_failure"] not in ON_FAILURE:
            raise ConfigurationError(f"unknown on_failure {config['on_failure']!r} for strategy 'mirrored'; use "
                                     f"'raise' (a lost replica fails the others) or 'shrink' (go on without it)")
        if config["commit_every"] is not None:
            _check_int("commit_every", config["commit_every"], 1)

    def _communicator_options_impl(self) -> dict[str, Any]:
        return {key: self.config[key] for key in ("chunk_bytes", "small_bytes", "timeout")
                if self.config[key] is not None}

    # -- elastic training (on_failure="shrink"): the API, and the hooks that route to ElasticTraining --
    # ``self._elastic`` is None unless on_failure="shrink": then each of these is what it is for every strategy.

    def commit(self) -> None:
        """Under ``on_failure="shrink"``: the state to roll back to if the world changes. Every replica
        calls it at the same point; it checks that the world is intact (a collective) and copies the
        variables, the optimizers' state and the step in memory. The strategy also commits by itself
        (``commit_every``). In the body of a ``distribute_dataset`` loop, a commit made before the
        batch's update has a retry start with that batch, one made after it with the next. Without
        shrink it does nothing."""
        self._check_open()
        if self._elastic is not None:
            self._elastic.commit()

    def elastic(self, fn):
        """``fn`` (your training function), wrapped so that under ``on_failure="shrink"`` it is called
        again from the last commit whenever the world changes (see the class doc's example); every
        replica calls it once. Without shrink the wrapper just calls ``fn``."""
        return elastic_wrapper(self._elastic, fn)

    def on_reset(self, callback) -> None:
        """Call ``callback(change)`` after every reset under shrink, on every replica: ``change`` is a
        :class:`~stratagem.collectives.elastic.WorldChange` (``members``, ``lost``, ``joined``, ``size``,
        ``generation``, and ``commit``, the commit the replicas rolled back to)."""
        if not callable(callback):
            raise TypeError(f"on_reset() takes a callable, got {type(callback).__name__}")
        if self._elastic is not None:
            self._elastic.callbacks.append(callback)

    @property
    def last_reset(self):
        """The latest :class:`~stratagem.collectives.elastic.WorldChange` under shrink (None before any)."""
        return None if self._elastic is None else self._elastic.last_reset

    def _num_replicas_impl(self) -> int:
        """How many replicas compute each step (under shrink: in the current world)."""
        if self._elastic is not None and self._elastic.formed:
            return self._elastic.comm.size
        return super()._num_replicas_impl()

    def _replica_rank(self, what: str) -> int:
        rank = super()._replica_rank(what)
        if self._elastic is not None and self._elastic.formed:
            return self._elastic.comm.rank
        return rank

    def _chief_rank(self) -> int:
        if self._elastic is not None and self._elastic.formed:
            return self._elastic.comm.members.index(self.cluster.chief)
        return super()._chief_rank()

    def _make_communicator_impl(self):
        if self._elastic is not None:
            return self._elastic.form()          # an elastic communicator, joined
        return super()._make_communicator_impl()

    def _shard_batches_impl(self, batches, rank, size):
        if self._elastic is not None:
            return self._elastic.shards(batches)
        return super()._shard_batches_impl(batches, rank, size)

    def _on_optimizer_impl(self, optimizer) -> None:
        if self._elastic is not None:
            self._elastic.registered(optimizer)

    def _restore_impl(self, path) -> int:
        """See ``Strategy.restore``. Under shrink, a restarted worker that joined a running job
        already holds the committed state: before its elastic function it returns the step and reads
        nothing (the others are not restoring)."""
        if self._elastic is not None and self._elastic.joined_late and not self._elastic.started:
            return self._step
        return super()._restore_impl(path)

    # -- variables ---------------------------------------------------------------------------------
    def _on_scope_end_impl(self, created: list, *, first: bool) -> None:
        """Check the replicas created the same variables, then give them all the chief's values."""
        if self._elastic is not None:
            self._elastic.end_scope(created, first)
        elif (created or first) and self.num_replicas_in_sync > 1:
            self._sync_variables(created)

    def _sync_variables(self, created: list) -> None:
        comm = self._comm()
        ordered = sorted(created, key=lambda v: v.name)
        mine = [[v.name, list(v.shape), dtype_key(v.dtype)] for v in ordered]
        everyone = allgather_json(comm, mine)
        chief = self._chief_rank()
        problems = _differences(everyone, comm.members, chief, "created variable", "did not create variable")
        if problems:
            raise ConfigurationError(
                f"the mirrored replicas created different variables in scope(): {'; '.join(problems)}. "
                f"Every replica must create the same variables (names, shapes, dtypes) in the same "
                f"scope() blocks: do not make variable creation depend on the task or on is_chief"
            )
        specs = [(shape, dtype) for _, shape, dtype in mine]
        values = broadcast_arrays(comm, specs, [v.numpy() for v in ordered] if self.is_chief else None,
                                  root=chief)
        if not self.is_chief:
            for variable, value in zip(ordered, values):
                variable.assign(value)

    # -- the sync point ----------------------------------------------------------------------------
    def _on_apply_gradients_impl(self, optimizer, pairs: list):
        """All-reduce the gradients (weighted mean over the replicas), then apply them on every replica."""
        self.on_optimizer(optimizer)
        if self.num_replicas_in_sync > 1 and pairs:
            pairs = self._average(pairs)
        with self.recorder.span("optimizer", "optimizer", {"optimizer": optimizer.name}):
            result = optimizer.apply_dense(pairs)
        self._step += 1
        return result

    def _reduce_gradients_impl(self, pairs: list) -> list:
        """The gradients' weighted mean over the replicas (each weighted by its share of the global
        batch, as in ``apply_gradients``), without applying them: the same buckets and all-reduce, for
        an update rule that runs outside stratagem (a ``torch.optim`` optimizer). Returns the averaged
        gradients in order, as views into the buckets (valid until the next call).
        See ``Strategy.reduce_gradients``."""
        if self.num_replicas_in_sync > 1 and pairs:
            pairs = self._average(pairs)
        return [grad for grad, _ in pairs]

    def _average(self, pairs: list) -> list:
        """``pairs`` with every gradient replaced by its weighted mean over the replicas."""
        grads = [_as_array(grad, var) for grad, var in pairs]
        plan = self._plan_for(grads, [var for _, var in pairs])
        weight = self._gradient_weight()
        comm = self._comm()
        recorder = self.recorder
        for bucket in plan.buckets:
            started = recorder.now()
            bucket.pack(grads, weight)
            recorder.record("pack", "pack", started, bucket.describe)
            if self.compressor is not None and bucket.buffer.dtype in FLOAT_DTYPES:
                bucket.allreduce_compressed(comm, self.compressor, self.compression_states, plan.names)
            else:
                bucket.allreduce(comm)
        return [(plan.averaged(index), var) for index, (_, var) in enumerate(pairs)]

    def _plan_for(self, grads: list, variables: list) -> "_Plan":
        """The buckets for these gradients (cached by names, shapes and dtypes); on first use, check
        that every replica passes gradients for the same variables."""
        signature = tuple((var.name, tuple(g.shape), dtype_key(g.dtype), type(g).__module__)
                          for g, var in zip(grads, variables))
        plan = self._plans.get(signature)
        if plan is None:
            _check_unique(variables)
            self._check_same_gradients(signature)
            if len(self._plans) >= MAX_PLANS:
                del self._plans[next(iter(self._plans))]
            plan = self._plans[signature] = _Plan(grads, [v.name for v in variables], self.config["bucket_bytes"])
        return plan

    def _check_same_gradients(self, signature: tuple) -> None:
        mine = sorted([name, list(shape), dtype] for name, shape, dtype, _ in signature)
        comm = self._comm()
        problems = _differences(allgather_json(comm, mine), comm.members, self._chief_rank(),
                                "has a gradient for variable", "has no gradient for variable")
        if problems:
            raise ConfigurationError(
                f"the mirrored replicas passed different gradients to apply_gradients(): "
                f"{'; '.join(problems)}. Every replica must pass gradients for the same variables, "
                f"with the same shapes and dtypes (a None gradient on one replica only counts as missing)"
            )


class _Bucket:
    """Gradients of one dtype fused into one flat buffer, all-reduced in place; reused every step."""

    def __init__(self, xp, dtype: np.dtype, entries: list[tuple[int, int, int, tuple]]):
        #: ``(gradient index, offset, size, shape)`` of each gradient in the buffer.
        self.entries = entries
        length = sum(size for _, _, size, _ in entries)
        self.buffer = xp.empty(length, dtype)

    def pack(self, grads: list, weight: float) -> None:
        """Copy each gradient, times ``weight``, into its place in the buffer."""
        if weight == 0:  # an empty shard's mean gradient may be NaN: it contributes nothing
            self.buffer.fill(0)
            return
        xp = array_module(self.buffer)
        scale = self.buffer.dtype.type(weight)
        for index, offset, size, shape in self.entries:
            xp.multiply(grads[index], scale, out=self.buffer[offset:offset + size].reshape(shape))

    def describe(self) -> dict:
        """The bucket on the timeline (its ``pack`` event)."""
        return {"bytes": int(self.buffer.nbytes), "gradients": len(self.entries)}

    def allreduce(self, comm) -> None:
        """Sum the buffer over the replicas, in place."""
        if self.buffer.size:
            comm.allreduce(self.buffer, op="sum", out=self.buffer)

    def allreduce_compressed(self, comm, compressor, states, names: list[str]) -> None:
        """Sum the buffer over the replicas through ``compressor``, gradient by gradient (each with its
        variable's state), in place."""
        views = [self.buffer[offset:offset + size].reshape(shape) for _, offset, size, shape in self.entries]
        chosen = [states.get(names[index], shape, self.buffer.dtype) for index, _, _, shape in self.entries]
        for view, total in zip(views, compressor.allreduce(comm, views, chosen)):
            view[...] = total


class _Plan:
    """How one set of gradients is laid out in buckets: by dtype (and array module), then by name."""

    def __init__(self, grads: list, names: list[str], bucket_bytes: int):
        #: The variables' names, by gradient index.
        self.names = list(names)
        groups: dict[tuple[str, str], list[int]] = {}
        for index in sorted(range(len(grads)), key=lambda i: names[i]):
            grad = grads[index]
            groups.setdefault((type(grad).__module__, dtype_key(grad.dtype)), []).append(index)
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int, int, tuple]] = {}
        for key in sorted(groups):
            for members in _fill(groups[key], grads, bucket_bytes):
                self._add_bucket(members, grads)

    def _add_bucket(self, members: list[int], grads: list) -> None:
        entries, offset = [], 0
        for index in members:
            size, shape = int(grads[index].size), tuple(grads[index].shape)
            entries.append((index, offset, size, shape))
            offset += size
        first = grads[members[0]]
        bucket = _Bucket(array_module(first), first.dtype, entries)
        self.buckets.append(bucket)
        for index, offset, size, shape in entries:
            self._where[index] = (bucket, offset, size, shape)

    def averaged(self, index: int):
        """Gradient ``index``, all-reduced: a view into its bucket (valid until the next step)."""
        bucket, offset, size, shape = self._where[index]
        return bucket.buffer[offset:offset + size].reshape(shape)


def _fill(indices: list[int], grads: list, bucket_bytes: int) -> list[list[int]]:
    """Split ``indices`` (in order) into runs of at most ``bucket_bytes`` (a larger gradient alone)."""
    runs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index in indices:
        nbytes = int(grads[index].nbytes)
        if current and used + nbytes > bucket_bytes:
            runs.append(current)
            current, used = [], 0
        current.append(index)
        used += nbytes
    if current:
        runs.append(current)
    return runs


def _as_array(grad, variable):
    """The gradient as a numpy or cupy array of a floating dtype: integer and bool gradients (which
    the optimizers accept) are cast to the variable's dtype, so that they can be averaged."""
    array = grad if is_device_array(grad) else np.asarray(grad)
    if np.dtype(array.dtype).kind in "biu":
        return array.astype(variable.dtype)
    return array


def _check_unique(variables: list) -> None:
    seen, repeated = set(), []
    for variable in variables:
        if variable.name in seen and variable.name not in repeated:
            repeated.append(variable.name)
        seen.add(variable.name)
    if repeated:
        raise ConfigurationError(
            f"apply_gradients() got several gradients for variable(s) {', '.join(map(repr, repeated))}; "
            f"pass one gradient per variable (sum them first)"
        )


def _differences(described: list, members: list, chief: int, extra: str, missing: str) -> list[str]:
    """What each replica's ``[[name, shape, dtype], ...]`` has that the chief's lacks, and the reverse."""
    reference = {name: (tuple(shape), dtype) for name, shape, dtype in described[chief]}
    problems = []
    for rank, entries in enumerate(described):
        if rank == chief:
            continue
        theirs = {name: (tuple(shape), dtype) for name, shape, dtype in entries}
        where, chief_task = members[rank], f"the chief {members[chief]}"
        for name in sorted(theirs.keys() - reference.keys()):
            problems.append(f"{where} {extra} {name!r} {_spec(theirs[name])} but {chief_task} did not")
        for name in sorted(reference.keys() - theirs.keys()):
            problems.append(f"{where} {missing} {name!r} {_spec(reference[name])} but {chief_task} did")
        for name in sorted(theirs.keys() & reference.keys()):
            if theirs[name] != reference[name]:
                problems.append(f"variable {name!r} is {_spec(theirs[name])} on {where} but "
                                f"{_spec(reference[name])} on {chief_task}")
    if len(problems) > MAX_LISTED:
        problems[MAX_LISTED:] = [f"and {len(problems) - MAX_LISTED} more difference(s)"]
    return problems


def _spec(shape_dtype: tuple) -> str:
    shape, dtype = shape_dtype
    return f"(shape {shape}, {dtype})"


def _check_int(option: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigurationError(f"{option} must be an integer >= {minimum}, got {value!r}")
