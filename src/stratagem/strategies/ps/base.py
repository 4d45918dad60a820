"""What the ``between_graph`` and ``parameter_server`` strategies share: remote variables on ps tasks.

:class:`PSStrategyBase` is a :class:`~stratagem.strategies.base.Strategy` whose variables live on the
cluster's ``ps`` tasks:

- On a ``ps`` task the constructor *serves* (:class:`~stratagem.ps.server.ParameterServer`)
  until the job ends, then exits the process cleanly (``SystemExit(0)``; ``exit_after_serving=False``
  returns instead, with the counters in ``strategy.served``). So every task can run the same script.
- A variable created in ``scope()`` is placed (:mod:`stratagem.ps.placement`) and gets a
  :class:`RemoteStore`: the task keeps a local copy (the *cache*, the array ``var.value`` returns,
  refreshed in place so ``torch.from_numpy(var.value)`` views stay valid; a received array becomes the
  copy instead when nobody holds the old one), pulled from the shards when it is read after an
  update, and ``assign`` writes go to the shards. A variable created from a cupy array keeps its copy
  on the GPU (the classic layout: GPU workers, CPU parameter servers): values arrive in host memory
  and are copied to the device, gradients are copied to the host to be pushed; the ps tasks hold
  numpy arrays.
- Tables read by rows (TensorFlow's embedding lookups on parameter servers): ``var.gather(ids)`` pulls
  just those rows from the shards that hold them (:mod:`stratagem.ps.rows`), and an
  :class:`~stratagem.training.sparse.IndexedSlices` gradient is pushed as rows
  (``sparse_gradients = True``). Staleness is kept per variable: a variable gathered since its last
  dense read is *sparse-read*, and neither the batched pull of the other variables nor the values a
  push brings back include it; reading its ``var.value`` pulls it (it is then dense-read again).
- When the outermost ``scope()`` block ends, the chief sends the initial values to the shards (or,
  with ``checkpoint_dir=``, restores the latest checkpoint there) and marks them ready; the other
  tasks wait for that, check that they declared the same pieces, and pull the values.
- ``optimizer.apply_gradients`` pushes the gradients (batched per shard, to all shards at once); the
  optimizer runs on the servers (row gradients: :mod:`stratagem.ps.rows` says when that is
  exactly the dense update and what happens otherwise). With ``pull_with_push`` (default) each
  acknowledgement brings the shard's new values back (sparse-read tables left out), so a step costs
  one round trip per shard.
- An ``evaluator`` task listed in the cluster (TF's side-car) is no replica: it pushes nothing
  (``apply_gradients`` and ``assign`` are refused), is not counted in sync rounds, and the shards do
  not wait for it to leave; it creates the same variables in ``scope()`` and every read of one pulls
  the current values from the shards.
- ``save`` / ``restore`` run on the chief alone (the others need not call them): the chief reads every
  shard's values and optimizer slots and writes one ordinary checkpoint (partitioned variables
  reassembled), so a checkpoint restores under any number of ps tasks, or under ``mirrored``.

Options (besides every strategy's): ``mode`` (``"async"``, ``"sync"``, ``"bounded"``),
``replicas_to_aggregate``, ``total_replicas``, ``staleness`` (see :mod:`stratagem.ps.server`),
``placement`` (``"round_robin"`` or ``"greedy"``), ``partition_bytes`` (variables larger than this are
split across shards; default 16 MiB; ``None`` never), ``partitioner`` (how many slices: default one per
ps task; a slice larger than the transport's ``whole_buffer_bytes`` is further cut into row slices on
the same shard, see :mod:`stratagem.ps.placement`), ``timeout`` (seconds a request to the shards may
take; default the transport's), ``checkpoint_dir`` (the chief restores the latest checkpoint found
there, if any, before anyone starts), ``pull_with_push``, ``exit_after_serving``, ``compression`` and ``compression_options``: workers push
compressed dense gradients (each piece compressed on its own, its error-feedback residual kept on the
worker) and the ps tasks decompress them before applying (:mod:`stratagem.ps.compressed`); every
task, the ps tasks included, must be started with the same compression. Row gradients
(``IndexedSlices``) are pushed as they are.
"""

from __future__ import annotations

import time

import numpy as np

from stratagem.training import checkpoint
from stratagem.strategies.ps.checkpoint import load_onto_shards, snapshot
from stratagem.core.errors import ConfigurationError, ProtocolError, TransportTimeout
from stratagem.ps.placement import Placer
from stratagem.ps.client import PSClient
from stratagem.ps.protocol import check_mode, describe_spec, piece_spec, same_spec, task_key
from stratagem.ps.rows import fetch_rows, split_gradient
from stratagem.ps.server import ParameterServer
from stratagem.training.sparse import IndexedSlices
from stratagem.compression.base import FLOAT_DTYPES
from stratagem.ps.compressed import compress_pieces
from stratagem.strategies.base import Strategy
from stratagem.strategies import compressing
from stratagem.strategies.ps.cache import adoptable, write_into
from stratagem.training.variables import VariableStore, array_module, to_module
from stratagem.core.wire import dtype_name
from stratagem.core import timeline as _timeline

#: Default size above which a variable is partitioned across the ps tasks.
DEFAULT_PARTITION_BYTES = 16 << 20
#: Seconds between polls while a task waits for the chief to initialise the variables.
READY_POLL = 0.1


class RemoteStore(VariableStore):
    """A variable whose value lives on the ps tasks; ``cache`` is this task's copy of it.

    ``read()`` refreshes the cache from the shards if an update happened since the last pull, then
    returns it (the same buffer every time, updated in place). ``gather(rows)`` returns a new array of
    those rows, pulled from the shards that hold them (not the whole table). ``write()`` sends the
    value to the shards. Writing into the returned array changes only this task's copy.
    """

    live = False

    def __init__(self, owner: "PSStrategyBase", name: str, cache):
        self._owner, self.name, self.cache = owner, name, cache

    def read(self):
        self._owner._read(self.name)
        return self.cache

    def gather(self, indices):
        return self._owner._gather(self.name, indices)

    def write(self, array) -> None:
        self._owner._assign(self.name, array)


class PSStrategyBase(Strategy):
    """Variables on the ps tasks (see the module doc). Subclasses say which tasks push gradients
    (:meth:`_pushers`) and what a non-ps task does."""

    name = "ps_base"
    #: ``IndexedSlices`` gradients reach ``on_apply_gradients`` as they are: pushed as rows.
    sparse_gradients = True
    #: The resolved compressor (``None``: gradients travel as they are) and each variable's state.
    compressor = None
    compression_states = None
    options = {
        **compressing.OPTIONS,
        "mode": "async",
        "replicas_to_aggregate": None,
        "total_replicas": None,
        "staleness": None,
        "placement": "round_robin",
        "partition_bytes": DEFAULT_PARTITION_BYTES,
        "partitioner": None,
        "timeout": None,
        "checkpoint_dir": None,
        "pull_with_push": True,
        "exit_after_serving": True,
    }

    def __init__(self, transport=None, **kwargs):
        super().__init__(transport, **kwargs)
        compressing.check_transport(self)
        try:
            self._setup()
        except BaseException:
            self.shutdown()
            raise
        if self.task.job == "ps":
            self._serve()

    def _check_config_impl(self) -> None:
        config = self.config
        check_mode(config["mode"], config["replicas_to_aggregate"], config["total_replicas"],
                   config["staleness"], 10**9 if config["total_replicas"] is None else config["total_replicas"])
        pb = config["partition_bytes"]
        if pb is not None and (isinstance(pb, bool) or not isinstance(pb, int) or pb < 1):
            raise ConfigurationError(f"partition_bytes must be an integer >= 1 (or None: never), got {pb!r}")
        timeout = config["timeout"]
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ConfigurationError(f"timeout must be a number of seconds > 0 (or None), got {timeout!r}")
        self.compressor, self.compression_states = compressing.resolve(self.name, self.config, self._plugins)
        if config["gradient_reduction"] == "sum" and config["mode"] == "sync":
            raise ConfigurationError(
                f"gradient_reduction='sum' cannot be had under {self.name!r} with mode='sync': the ps tasks "
                f"average each round's gradients, as TF's SyncReplicasOptimizer does, so a loss divided by the "
                f"global batch would train at 1/N. Use gradient_reduction='mean' (the default) with the per-replica "
                f"mean loss, or mode='async'/'bounded', where each push is applied as computed"
            )

    def _setup(self) -> None:
        cluster = self.cluster
        if "ps" not in cluster.jobs or not cluster.tasks("ps"):
            raise ConfigurationError(
                f"strategy {self.name!r} keeps the variables on 'ps' tasks, and this cluster has none: "
                f"launch with --ps M (stratagem launch --ps 2 --worker 3 -- ...) or add a 'ps' job"
            )
        pushers = self._pushers()
        self.consistency = check_mode(self.config["mode"], self.config["replicas_to_aggregate"],
                                      self.config["total_replicas"], self.config["staleness"], len(pushers))
        self._timeout = self.config["timeout"] or self.transport.timeout
        self._stop = False
        self._global_step = 0
        if self.task.job == "ps":
            return
        # Pieces within what the transport delivers whole: a larger buffer costs a copy at each end.
        self._placer = Placer(len(cluster.tasks("ps")), self.config["placement"], self.config["partition_bytes"],
                              self.config["partitioner"],
                              piece_bytes=getattr(self.transport, "whole_buffer_bytes", None))
        self._client = PSClient(self.transport, timeout=self._timeout)
        # Reach every shard now: a ps task that is down fails the job here, naming it, and a shard
        # that dies later is seen as lost (its connection drops) instead of silently unreachable.
        self._client.hello()
        self._pieces: dict[str, list] = {}           # variable name -> its pieces
        self._where: dict[str, tuple] = {}           # piece name -> (variable name, piece)
        self._initialized: set[str] = set()          # variables the shards hold and we pulled
        self._versions: dict[int, int] = {}          # shard index -> its step at our last pull/push
        # Staleness. ``_stale``: the shards may have changed since this task last read from every one
        # of them (a sync push then asks for the current step first). ``_current``: the variables
        # whose caches hold the values of the last exchange. ``_sparse_read``: the variables read by
        # rows since their last dense read, which pulls and push replies leave out.
        self._stale = False
        self._current: set[str] = set()
        self._sparse_read: set[str] = set()
        self._optimizer_sent = None
        self._exit_error: str | None = None
        #: Statuses of the last push, per shard (``"applied"``, ``"dropped"``, ``"stopped"``).
        self.last_push: dict[int, str] = {}
        #: The last acknowledgement's bounded-staleness clocks: ``(this task's, the slowest's)``.
        self.last_clock: tuple | None = None

    def _pushers(self) -> list:
        """The tasks that push gradients (their task keys, in order). Default: every replica."""
        return [task_key(t) for t in self.cluster.replicas()]

    def _server_config(self) -> dict:
        return {**self.consistency, "pushers": self._pushers(), "clock": "ps:0"}

    # -- ps tasks ----------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            stats = ParameterServer(self.transport, timeout=self.config["timeout"], compressor=self.compressor).serve()
        finally:
            self.shutdown()
        #: On a ps task (``exit_after_serving=False``): the server's counters when it stopped.
        self.served = stats
        if self.config["exit_after_serving"]:
            raise SystemExit(0)

    def _check_worker(self, what: str) -> None:
        self._check_open()
        if self.task.job == "ps":
            raise ConfigurationError(f"{self.task} is a ps task: it serves the variables and cannot {what}")

    # -- variables ---------------------------------------------------------------------------------
    def _on_variable_impl(self, variable) -> None:
        self._check_worker("create variables")
        try:
            dtype_name(variable.dtype)
        except ProtocolError as exc:
            raise ConfigurationError(f"variable {variable.name!r} cannot live on a ps task: {exc}") from None
        pieces = self._place(variable)
        self._pieces[variable.name] = pieces
        for piece in pieces:
            self._where[piece.name] = (variable.name, piece)
            self._client.pieces.setdefault(piece.ps, []).append(piece.name)
        variable._set_store(RemoteStore(self, variable.name, variable.store.read()))

    def _place(self, variable) -> list:
        """The pieces of a new variable and their shards (the placement policy's choice)."""
        return self._placer.place(variable.name, variable.shape, variable.dtype)

    def _cache(self, name: str):
        return self._variables[name].store.cache

    def _piece_value(self, piece, array):
        if piece.parts == 1:
            return array
        return array[piece.lo:piece.hi]

    def _specs_and_values(self, variables) -> tuple[dict, dict]:
        specs, values = {}, {}
        for var in variables:
            cache = self._cache(var.name)
            for piece in self._pieces[var.name]:
                specs.setdefault(piece.ps, []).append(piece_spec(piece, var.shape, var.dtype))
                values.setdefault(piece.ps, []).append(to_module(self._piece_value(piece, cache), np))
        return specs, values

    def _on_scope_end_impl(self, created: list, *, first: bool) -> None:
        if self.task.job == "ps" or not (created or first):
            return
        if self.is_chief:
            self._initialize(created, first)
        else:
            self._wait_for(created)
        self._initialized.update(v.name for v in created)
        self._pull_all()

    def _initialize(self, created: list, first: bool) -> None:
        """On the chief: declare the variables (existing values on the shards are kept), restore the
        latest checkpoint of ``checkpoint_dir`` if there is one, and mark the shards ready."""
        specs, values = self._specs_and_values(created)
        replies = self._client.init(specs, values, self._server_config())
        self._check_declared(replies, created)
        directory = self.config["checkpoint_dir"]
        if first and directory and checkpoint.latest_checkpoint(directory) is not None:
            self._initialized.update(v.name for v in created)
            self._load_checkpoint(directory)
        self._client.ready()

    def _check_declared(self, replies: dict, created: list) -> None:
        """The shards' answer to init: fine, or the job's settings differ (raised as RemoteError)."""

    def _wait_for(self, created: list) -> None:
        """Until the chief has declared (and readied) ``created`` on the shards; then check their specs."""
        wanted = {piece.name: (var, piece) for var in created for piece in self._pieces[var.name]}
        deadline = time.monotonic() + self._timeout
        while True:
            catalogs = self._client.catalog()
            held = {spec["name"]: (index, spec) for index, meta in catalogs.items() for spec in meta["vars"]}
            ready = all(meta["ready"] for meta in catalogs.values())
            if ready and all(name in held for name in wanted):
                break
            if time.monotonic() > deadline:
                missing = sorted({var.name for name, (var, _) in wanted.items() if name not in held})
                what = (f"variable(s) {', '.join(map(repr, missing))}" if missing
                        else "the variables (they are declared but not marked ready)")
                raise TransportTimeout(
                    f"{self.task}: the chief {self.cluster.chief} did not initialise {what} on the ps tasks "
                    f"within {self._timeout:g} s: is it running, and does it create the same variables?"
                )
            time.sleep(READY_POLL)
        problems = []
        for name, (var, piece) in wanted.items():
            index, spec = held[name]
            mine = piece_spec(piece, var.shape, var.dtype)
            if index != piece.ps or not same_spec(spec, mine):
                problems.append(f"{name!r} is {describe_spec(spec)} on /job:ps/task:{index} but "
                                f"{describe_spec(mine)} on /job:ps/task:{piece.ps} here")
        if problems:
            raise ConfigurationError(
                f"{self.task} declared its variables differently from the chief: {'; '.join(problems)}. Every "
                f"task must create the same variables in the same order, with the same placement options"
            )
        config = next(iter(catalogs.values()))["config"] or {}
        if config.get("mode") != self.consistency["mode"]:
            raise ConfigurationError(f"{self.task} runs mode={self.consistency['mode']!r} but the chief "
                                     f"mode={config.get('mode')!r}; start every task with the same options")

    # -- reading and writing ----------------------------------------------------------------------
    def _mark_stale(self) -> None:
        """The variables may have changed on the shards (an update this task did not see the result of)."""
        self._stale = True
        self._current.clear()

    def _fresh(self, name: str) -> bool:
        """True when the cache of ``name`` holds the shards' values as far as this task knows."""
        if self.is_evaluator:
            return False  # it pushes nothing, so it never learns of updates: it reads afresh every time
        return name in self._current

    def _read(self, name: str) -> None:
        """A dense read of ``name`` (``var.value``): refresh its cache if needed."""
        self._sparse_read.discard(name)
        self._refresh(name)

    def _refresh(self, name: str) -> None:
        if not self._closed and name in self._initialized and not self._fresh(name):
            self._pull_dense()

    def _pull_all(self) -> None:
        """Pull every piece of every variable (after initialisation, a restore)."""
        self._absorb(self._client.pull())
        self._current = set(self._initialized)

    def _pull_dense(self) -> None:
        """One batched pull (one request per shard, all shards at once) of every variable that is not
        sparse-read: what a dense read of any of them refreshes."""
        dense = [name for name in self._variables if name in self._initialized and name not in self._sparse_read]
        if not self._sparse_read:
            replies = self._client.pull()
        else:
            names: dict[int, list] = {i: [] for i in range(self._client.num_shards)}  # every shard: its step
            for name in dense:
                for piece in self._pieces[name]:
                    names[piece.ps].append(piece.name)
            replies = self._client.pull(names)
        self._absorb(replies)
        self._current = set(dense)

    def _gather(self, name: str, rows):
        """Rows ``rows`` (checked int64) of variable ``name``, a new array: from the cache when it is
        fresh, else pulled from the shards holding them (:func:`~stratagem.ps.rows.fetch_rows`).
        Makes ``name`` sparse-read."""
        var = self._variables[name]
        self._sparse_read.add(name)
        cache = var.store.cache
        xp = array_module(cache)
        if self._closed or name not in self._initialized or self._fresh(name) or not len(rows):
            return cache[rows if xp is np else xp.asarray(rows)]
        out, replies = fetch_rows(self._client, self._pieces[name], rows, var.shape, var.dtype)
        for index, reply in replies.items():
            self._note(index, reply.meta)
        if len(replies) == self._client.num_shards:
            self._stale = False          # every shard told its step
        return to_module(out, xp)        # on the GPU for a cupy variable, as var.value is

    def _absorb(self, replies: dict) -> None:
        """Copy the values in ``replies`` into the caches; record versions, the global step, stop."""
        for index, reply in replies.items():
            self._absorb_one(index, reply)
        self._stale = False

    def _absorb_one(self, index: int, reply) -> None:
        meta = reply.meta
        for name, value in zip(meta.get("names") or [], reply.buffers):
            found = self._where.get(name)
            if found is None or found[0] not in self._initialized:
                continue
            var_name, piece = found
            store = self._variables[var_name].store
            if piece.parts == 1 and adoptable(value, store):
                store.cache = value   # no copy: the received buffer becomes this task's copy
            else:
                write_into(self._piece_value(piece, store.cache), value)
        self._note(index, meta)

    def _note(self, index: int, meta: dict) -> None:
        if "step" in meta:
            self._versions[index] = int(meta["step"])
            if index == 0:
                self._global_step = self._step = int(meta["step"])
                for optimizer in self._optimizers:    # the updates the shards applied: also on a
                    optimizer.iterations = self._global_step   # coordinator, whose steps run elsewhere
        if meta.get("stop"):
            self._stop = True

    def _assign(self, name: str, array) -> None:
        var = self._variables[name]
        cache = var.store.cache
        if self.is_evaluator and name in self._initialized:
            raise ConfigurationError(
                f"{self.task} is an evaluator: it reads the variables on the ps tasks but does not write them "
                f"(assign to {name!r} on a training task)"
            )
        write_into(cache, array)
        if name not in self._initialized:
            return  # before the chief declared it: this is (part of) the initial value
        by_shard: dict[int, tuple[list, list]] = {}
        for piece in self._pieces[name]:
            names, arrays = by_shard.setdefault(piece.ps, ([], []))
            names.append(piece.name)
            arrays.append(to_module(self._piece_value(piece, cache), np))
        self._client.assign(by_shard)

    # -- the sync point ----------------------------------------------------------------------------
    def _on_apply_gradients_impl(self, optimizer, pairs: list):
        """Push the gradients to the shards; the servers apply them (by the mode)."""
        self._check_worker("apply gradients")
        self._check_trains()
        self.on_optimizer(optimizer)
        if self._optimizer_sent is not optimizer:
            self._client.set_optimizer(optimizer.get_config())
            self._optimizer_sent = optimizer
        recorder = _timeline.RECORDER
        started = recorder.now() if recorder is not None else 0
        by_shard: dict[int, tuple[list, list]] = {}
        rows: dict[int, tuple[list, list, list]] = {}
        for grad, var in pairs:
            pieces = self._pieces.get(var.name)
            if pieces is None or self._variables.get(var.name) is not var:
                raise ConfigurationError(f"variable {var.name!r} does not belong to this strategy")
            if isinstance(grad, IndexedSlices):     # merged by the optimizer: sorted, unique rows
                for piece, local, values in split_gradient(grad, pieces):
                    names, indices, arrays = rows.setdefault(piece.ps, ([], [], []))
                    names.append(piece.name)
                    indices.append(local)
                    arrays.append(values)
                continue
            grad = to_module(grad, np)
            for piece in pieces:
                names, arrays = by_shard.setdefault(piece.ps, ([], []))
                names.append(piece.name)
                arrays.append(self._piece_value(piece, grad))
        compression = self._compress(by_shard) if self.compressor is not None else None
        if recorder is not None:
            recorder.add("pack", "pack", started, recorder.now(), {"shards": len(by_shard) + len(rows)})
        if self._stale and self.consistency["mode"] == "sync":
            # The step did not read the variables since they changed: it works on the current step.
            for index, meta in self._client.hello().items():
                self._note(index, meta)
        pull = bool(self.config["pull_with_push"])
        skip: dict[int, list] = {}
        for name in self._sparse_read if pull else ():   # the replies leave out the tables read by rows
            for piece in self._pieces[name]:
                skip.setdefault(piece.ps, []).append(piece.name)
        try:
            replies = self._client.push(by_shard, versions=self._versions, weight=self._push_weight(), pull=pull,
                                        on_reply=self._absorb_one if pull else None, rows=rows, skip=skip,
                                        compression=compression)
        except BaseException:
            self._mark_stale()   # some parts of the replies may be copied in already: read afresh
            raise
        self.last_push = {i: r.meta.get("status") for i, r in replies.items()}
        if pull:
            self._stale = False      # every reply was copied in as it arrived
            self._current = {n for n in self._initialized if n not in self._sparse_read}
        else:
            for index, reply in replies.items():
                self._note(index, reply.meta)
            self._mark_stale()
        clock = replies[0].meta.get("clock") if 0 in replies else None
        if clock is not None:
            self.last_clock = (clock, replies[0].meta.get("min_clock"))
        optimizer.iterations = self._global_step
        return self.last_push

    def _compress(self, by_shard: dict) -> dict[int, dict]:
        """Replace each shard's dense gradients in ``by_shard`` by their compressed payloads, in place;
        return each shard's ``compression`` metadata. Each piece has its own error-feedback state."""
        wire = {}
        for index, (names, arrays) in by_shard.items():
            states = {name: self.compression_states.get(name, grad.shape, grad.dtype)
                      for name, grad in zip(names, arrays) if grad.dtype in FLOAT_DTYPES}
            wire[index], payload = compress_pieces(self.compressor, states, names, arrays)
            by_shard[index] = (names, payload)
        return wire

    def _reduce_gradients_impl(self, pairs: list) -> list:
        """Refused: on parameter servers the gradients are reduced and applied on the ps tasks."""
        raise ConfigurationError(
            f"under {self.name!r} the gradients are reduced and applied on the ps tasks: push them with "
            f"optimizer.apply_gradients (stratagem.torch.DistributedOptimizer translates a torch "
            f"optimizer into the rule the ps tasks run)"
        )

    def _push_weight(self) -> float:
        if self.gradient_reduction == "sum":      # each push as computed (TF's ParameterServerStrategy)
            return 1.0
        return 1.0 if self._batch_share is None else float(self._batch_share)

    # -- training control --------------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """The job's step (updates applied on ``ps:0``) as of this task's last exchange with it."""
        return self._global_step

    def refresh(self) -> int:
        """Ask the shards for their status now (one small round trip); return the global step."""
        self._check_worker("ask the shards")
        for index, meta in self._client.hello().items():
            self._note(index, meta)
        return self._global_step

    def should_stop(self) -> bool:
        """True once the chief called :meth:`request_stop` (as of the last exchange with the shards)."""
        return self._stop

    def request_stop(self) -> None:
        """Ask every task to stop: their ``should_stop()`` turns true at their next exchange, and
        pushes waiting in a sync round or a staleness bound are released."""
        self._check_worker("request a stop")
        self._client.stop()
        self._stop = True

    def ps_stats(self) -> dict[int, dict]:
        """Every shard's counters (:meth:`ParameterServer.stats`), by shard index."""
        self._check_worker("ask the shards")
        return self._client.stats()

    @property
    def acks(self) -> dict[int, dict]:
        """This task's acknowledged pushes, ``{shard: {status: count}}``."""
        return {i: dict(c) for i, c in self._client.acks.items()}

    def _num_replicas_impl(self) -> int:
        """Replicas whose gradients make one update: ``replicas_to_aggregate`` under ``sync``, else 1."""
        consistency = getattr(self, "consistency", None)
        if consistency and consistency["mode"] == "sync":
            return consistency["replicas_to_aggregate"]
        return 1

    def _distribute_dataset_impl(self, batches):
        """This task's shard of each global batch, split over the tasks that push gradients (see
        ``Strategy.distribute_dataset``); under ``sync`` the shards' row counts weigh the mean."""
        self._check_worker("take a shard of the data")
        self._check_trains()
        pushers = self._pushers()
        me = task_key(self.task)
        if me not in pushers:
            raise ConfigurationError(f"{self.task} does not compute gradients under {self.name!r}")
        return self._shard_batches_impl(batches, pushers.index(me), len(pushers))

    def _input_pipeline_impl(self) -> tuple[int, int]:
        """One input pipeline per task that pushes gradients (``distribute_datasets_from_function``)."""
        self._check_worker("take a part of the data")
        pushers = self._pushers()
        me = task_key(self.task)
        if me not in pushers:
            raise ConfigurationError(f"{self.task} does not compute gradients under {self.name!r}")
        return len(pushers), pushers.index(me)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save_impl(self, path, max_to_keep) -> str | None:
        """On the chief: write a checkpoint of every variable on the shards, the optimizer's state and
        the global step into directory ``path``; return its file. Other tasks need not call it (they
        get ``None``). Partitioned variables are reassembled: the checkpoint does not depend on the
        number of ps tasks."""
        self._check_worker("save")
        if not self.is_chief:
            return None
        values, state, step = snapshot(self._client)
        extra = {"strategy": self.name, "mode": self.consistency["mode"], "ps_tasks": self._client.num_shards}
        return checkpoint.save(path, values, state, step, extra=extra, max_to_keep=max_to_keep)

    def _restore_impl(self, path) -> int:
        """On the chief: load checkpoint ``path`` (a file, or a directory's latest) onto the shards:
        values, optimizer state, global step; return the step. On other tasks: refresh the values and
        return the global step (the chief's restore may not have happened yet: to restore before
        anyone starts, give the strategy ``checkpoint_dir=``)."""
        self._check_worker("restore")
        if self.is_chief:
            self._load_checkpoint(path)
        self._pull_all()
        return self._global_step

    def _load_checkpoint(self, path) -> None:
        self._global_step = self._step = load_onto_shards(self._client, self._pieces, self._variables, path)

    # -- lifecycle -----------------------------------------------------------------------------------
    def _shutdown_impl(self) -> None:
        """Tell the shards this task is leaving (they stop once every replica has), then close."""
        self._say_goodbye()
        super()._shutdown_impl()

    def _say_goodbye(self) -> None:
        """Tell the shards this task leaves, with ``_exit_error`` if it failed (best effort)."""
        client = getattr(self, "_client", None)
        # An evaluator is no member the shards wait for: its goodbye (or failure) is none of theirs.
        if client is not None and not self._closed and not self.is_evaluator:
            try:
                client.bye(self._exit_error)
            except Exception:  # noqa: BLE001 - leaving anyway
                pass

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            self._exit_error = f"{type(exc).__name__}: {exc}"
        self.shutdown()

    def _leave_with_error_impl(self, error: str) -> None:
        # The script ended by an exception: the shards learn why (and fail the job, naming this task)
        # rather than seeing a replica vanish, which they would take for a worker to be restarted.
        self.fail(error)

    def fail(self, error: BaseException | str) -> None:
        """Leave with an error: the shards fail the job with it at once, naming this task (every later
        request of the other replicas is refused with it), and exit non-zero."""
        self._exit_error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.shutdown()
