"""What the ``between_graph`` and ``parameter_server`` strategies share: remote variables on ps tasks.

:class:`PSStrategyBase` is a :class:`~stratagem.strategies.base.Strategy` whose variables live on the
cluster's ``ps`` tasks:

- On a ``ps`` task the constructor *serves* (:class:`~stratagem.ps_service.server.ParameterServer`)
  until the job ends, then exits the process cleanly (``SystemExit(0)``; ``exit_after_serving=False``
  returns instead, with the counters in ``strategy.served``). So every task can run the same script.
- A variable created in ``scope()`` is placed (:mod:`stratagem.ps_service.placement`) and gets a
  :class:`~stratagem.strategies.ps.remote.RemoteStore` (kept in the task's
  :class:`~stratagem.strategies.ps.remote.RemoteVariables`): the task keeps a local copy (the *cache*, the array ``var.value`` returns,
  refreshed in place so ``torch.from_numpy(var.value)`` views stay valid; a received array becomes the
  copy instead when nobody holds the old one), pulled from the shards when it is read after an
  update, and ``assign`` writes go to the shards. A variable created from a cupy array keeps its copy
  on the GPU (the classic layout: GPU workers, CPU parameter servers): values arrive in host memory
  and are copied to the device, gradients are copied to the host to be pushed; the ps tasks hold
  numpy arrays.
- Tables read by rows (TensorFlow's embedding lookups on parameter servers): ``var.gather(ids)`` pulls
  just those rows from the shards that hold them (:mod:`stratagem.ps_service.rows`), and an
  :class:`~stratagem.training.sparse.IndexedSlices` gradient is pushed as rows
  (``sparse_gradients = True``). Staleness is kept per variable: a variable gathered since its last
  dense read is *sparse-read*, and neither the batched pull of the other variables nor the values a
  push brings back include it; reading its ``var.value`` pulls it (it is then dense-read again).
- When the outermost ``scope()`` block ends, the chief sends the initial values to the shards (or,
  with ``checkpoint_dir=``, restores the latest checkpoint there) and marks them ready; the other
  tasks wait for that, check that they declared the same pieces, and pull the values.
- ``optimizer.apply_gradients`` pushes the gradients (batched per shard, to all shards at once); the
  optimizer runs on the servers (row gradients: :mod:`stratagem.ps_service.rows` says when that is
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
``replicas_to_aggregate``, ``total_replicas``, ``staleness`` (see :mod:`stratagem.ps_service.server`),
``placement`` (``"round_robin"`` or ``"greedy"``), ``partition_bytes`` (variables larger than this are
split across shards; default 1 MiB; ``None`` never), ``partitioner`` (how many slices: default one per
ps task; a slice larger than the transport's ``whole_buffer_bytes`` is further cut into row slices on
the same shard, see :mod:`stratagem.ps_service.placement`), ``timeout`` (seconds a request to the shards may
take; default the transport's), ``checkpoint_dir`` (the chief restores the latest checkpoint found
there, if any, before anyone starts), ``pull_with_push``, ``exit_after_serving``, ``compression`` and ``compression_options``: workers push
compressed dense gradients (each piece compressed on its own, its error-feedback residual kept on the
worker) and the ps tasks decompress them before applying (:mod:`stratagem.ps_service.compressed`); every
task, the ps tasks included, must be started with the same compression. Row gradients
(``IndexedSlices``) are pushed as they are.
"""

from __future__ import annotations

import time


from stratagem.training import checkpoint
from stratagem.strategies.ps.checkpoint import load_onto_shards, snapshot
from stratagem.core.errors import ConfigurationError, ProtocolError, TransportTimeout
from stratagem.ps_service.placement import DEFAULT_PARTITION_BYTES, Placer
from stratagem.ps_service.client import PSClient
from stratagem.ps_service.protocol import check_mode, describe_spec, piece_spec, same_spec, task_key
from stratagem.ps_service.server import ParameterServer
from stratagem.strategies.base import Strategy
from stratagem.strategies import compressing
from stratagem.strategies.ps.remote import RemoteVariables
from stratagem.core.wire import dtype_name

#: Seconds between polls while a task waits for the chief to initialise the variables.
READY_POLL = 0.1


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
        self._remote: RemoteVariables | None = None
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
        #: This task's variables on the shards: pieces, caches, staleness, the global step.
        self._remote = RemoteVariables(self._client, self._optimizers, closed=lambda: self.closed,
                                       read_only=self.is_evaluator, who=str(self.task))
        self._optimizer_sent = None
        self._exit_error: str | None = None
        #: ``restore()`` calls on this task: a non-chief's n-th waits for the chief's n-th.
        self._restores = 0
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
        variable.store = self._remote.add(variable, self._place(variable))

    def _place(self, variable) -> list:
        """The pieces of a new variable and their shards (the placement policy's choice)."""
        return self._placer.place(variable.name, variable.shape, variable.dtype)

    def pieces(self, name: str) -> list:
        """The pieces variable ``name`` is stored as (:class:`~stratagem.ps_service.placement.Piece`: its shard
        ``ps``, its rows ``lo:hi`` of ``parts``), on a task that declared it."""
        self._check_worker("hold variables")
        try:
            return list(self._remote.pieces[name])
        except KeyError:
            raise ConfigurationError(f"{self.task} has no variable {name!r} on the ps tasks") from None

    def _on_scope_end_impl(self, created: list, *, first: bool) -> None:
        if self.task.job == "ps" or not (created or first):
            return
        if self.is_chief:
            self._initialize(created, first)
        else:
            self._wait_for(created)
        self._remote.initialized.update(v.name for v in created)
        self._remote.pull_all()
        self._step = self._remote.global_step

    def _initialize(self, created: list, first: bool) -> None:
        """On the chief: declare the variables (existing values on the shards are kept), restore the
        latest checkpoint of ``checkpoint_dir`` if there is one, and mark the shards ready."""
        specs, values = self._remote.specs_and_values(created)
        replies = self._client.init(specs, values, self._server_config())
        self._check_declared(replies, created)
        directory = self.config["checkpoint_dir"]
        if first and directory and checkpoint.latest_checkpoint(directory) is not None:
            self._remote.initialized.update(v.name for v in created)
            self._load_checkpoint(directory)
        self._client.ready()

    def _check_declared(self, replies: dict, created: list) -> None:
        """The shards' answer to init: fine, or the job's settings differ (raised as RemoteError)."""

    def _wait_for(self, created: list) -> None:
        """Until the chief has declared (and readied) ``created`` on the shards; then check their specs."""
        wanted = {piece.name: (var, piece) for var in created for piece in self._remote.pieces[var.name]}
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

    # -- the sync point ----------------------------------------------------------------------------
    def _on_apply_gradients_impl(self, optimizer, pairs: list):
        """Push the gradients to the shards; the servers apply them (by the mode)."""
        self._check_worker("apply gradients")
        self._check_trains()
        self.on_optimizer(optimizer)
        if self._optimizer_sent is not optimizer:
            self._client.set_optimizer(optimizer.get_config())
            self._optimizer_sent = optimizer
        remote = self._remote
        if remote.stale and self.consistency["mode"] == "sync":
            remote.refresh()   # the step did not read the variables since they changed: it works on the current step
        pull = bool(self.config["pull_with_push"])
        started = self.recorder.now()
        requests = remote.requests(pairs, weight=self._push_weight(), pull=pull, compressor=self.compressor,
                                   states=self.compression_states)
        self.recorder.record("pack", "pack", started, _describe_pack, requests)
        acks = remote.push(requests, pull=pull)
        self.last_push = {i: ack.status for i, ack in acks.items()}
        if 0 in acks and acks[0].clock is not None:
            self.last_clock = (acks[0].clock, acks[0].min_clock)
        self._step = optimizer.iterations = remote.global_step
        return self.last_push

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
        return self._remote.global_step if self._remote is not None else 0

    def refresh(self) -> int:
        """Ask the shards for their status now (one small round trip); return the global step."""
        self._check_worker("ask the shards")
        self._step = self._remote.refresh()
        return self._step

    def should_stop(self) -> bool:
        """True once the chief called :meth:`request_stop` (as of the last exchange with the shards)."""
        return self._remote is not None and self._remote.stop

    def request_stop(self) -> None:
        """Ask every task to stop: their ``should_stop()`` turns true at their next exchange, and
        pushes waiting in a sync round or a staleness bound are released."""
        self._check_worker("request a stop")
        self._client.stop()
        self._remote.stop = True

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
        values, optimizer state, global step; return the step. On other tasks: wait until the chief's
        restore of the same count (this task's first ``restore()`` waits for the chief's first) is on
        every shard, then read the values and return the global step. A replica that came first thus
        never pushes a gradient of the values the checkpoint replaces. An evaluator, which trains
        nothing and is no replica the chief's restore pairs with, reads the values as they are."""
        self._check_worker("restore")
        if self.is_chief:
            self._restores += 1
            self._load_checkpoint(path, restore=self._restores)
        elif not self.is_evaluator:
            self._restores += 1
            self._wait_for_restore(self._restores, path)
        self._remote.pull_all()
        self._step = self._remote.global_step
        return self._step

    def _load_checkpoint(self, path, *, restore: int | None = None) -> None:
        self._remote.global_step = self._step = load_onto_shards(self._client, self._remote.pieces,
                                                                 self._variables, path, restore=restore)

    def _wait_for_restore(self, count: int, path) -> None:
        """Until every shard has the chief's ``count``-th ``restore()``; a job that fails meanwhile
        raises here (the shards refuse the poll with the failure, naming its task)."""
        deadline = time.monotonic() + self._timeout
        while min(meta.get("restores", 0) for meta in self._client.hello().values()) < count:
            if time.monotonic() > deadline:
                raise TransportTimeout(
                    f"{self.task}: restore({str(path)!r}) waited {self._timeout:g} s for the chief "
                    f"{self.cluster.chief} to restore it too; call restore() on every replica, the chief "
                    f"included, at the same point of the script")
            time.sleep(READY_POLL)

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


def _describe_pack(requests: dict) -> dict:
    """A push's ``pack`` event on the timeline: the shards its requests go to."""
    return {"shards": sum(1 for r in requests.values() if r.names or r.row_names)}
