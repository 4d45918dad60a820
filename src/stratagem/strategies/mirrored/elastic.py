"""Elastic training for the ``mirrored`` strategy: commit, roll back, shrink and grow
(``stratagem.strategy("mirrored", on_failure="shrink")``; README: "Elastic training").

:class:`ElasticTraining` is what a :class:`~stratagem.strategies.mirrored.strategy.MirroredStrategy` delegates
to when ``on_failure="shrink"``. The membership itself is the collectives layer's
(:class:`~stratagem.collectives.elastic.ElasticCommunicator`); this module keeps the state and the place in
the user's program that go with it:

* **Commits.** ``strategy.commit()`` (and the strategy itself, before every ``commit_every``-th
  batch that ``distribute_dataset`` yields) agrees with the other members that the world is intact
  and copies the variables, the optimizers' state, the step and the position in the training
  function into memory. The last two commits are kept (see the communicator's doc for why two).
* **Resets.** The training function runs inside ``strategy.elastic(fn)``. When the world changes in
  it (a member lost in a collective, or a restarted worker waiting at a commit), the
  ``WorldChangedError`` unwinds to that wrapper on every member; there they re-form the world, roll
  back to the commit the coordinator chose, call the ``on_reset`` callbacks and call ``fn`` again.
  ``distribute_dataset`` then *fast-forwards* to the commit: a loop over it that had ended before
  the commit yields nothing, the loop in progress skips the batches it had yielded. Global batches
  are sharded over the new world, and each replica's gradients weighted by its share of the rows, so
  the retried steps make the update one process makes on the whole batch, whatever the world size.
* **Joining.** A restarted worker (a new process for a task) joins at the first ``scope()`` block's
  end: it waits for the next commit, receives the committed state from the chief and, in its
  ``strategy.elastic(fn)``, fast-forwards to that commit like the others.

The chief coordinates: its loss ends the job, as without shrink.

Three replicas as threads of one process (over processes: the same script under ``stratagem launch
--worker 3 --restart-workers 1`` with ``transport="zmq"``); replica 2 dies in the middle of step 3,
the two others finish the 6 steps, rolling step 3 back and doing it again without it::

    >>> import threading
    >>> import numpy as np
    >>> import stratagem
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.strategies.mirrored.strategy import MirroredStrategy
    >>> from stratagem.transports.local import LocalFabric
    >>> cluster, fabric = ClusterSpec({"worker": ["local:0", "local:1", "local:2"]}), LocalFabric()
    >>> batches = [np.full((6, 1), float(step)) for step in range(6)]       # six global batches of 6 rows
    >>> def replica(index, results):
    ...     strategy = MirroredStrategy("local", cluster=cluster, task=f"worker:{index}", on_failure="shrink",
    ...                                 transport_options={"fabric": fabric, "timeout": 30})
    ...     with strategy.scope():
    ...         w = stratagem.Variable(np.zeros(1), name="w")
    ...         opt = stratagem.optimizers.SGD(learning_rate=1.0)
    ...     @strategy.elastic
    ...     def train():
    ...         for x in strategy.distribute_dataset(batches):
    ...             if index == 2 and opt.iterations == 3:
    ...                 strategy.transport.abort()                           # as if killed
    ...                 return
    ...             opt.apply_gradients([(-x.mean(axis=0), w)])            # w += the batch's mean
    ...     train()
    ...     results[index] = (w.numpy(), opt.iterations, strategy.num_replicas_in_sync)
    ...     strategy.shutdown()
    >>> results = {}
    >>> threads = [threading.Thread(target=replica, args=(i, results)) for i in range(3)]
    >>> for t in threads: t.start()
    >>> for t in threads: t.join()
    >>> results[0], results[1]                         # 0 + 1 + ... + 5, as one process makes it
    ((array([15.]), 6, 2), (array([15.]), 6, 2))
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from stratagem.collectives.elastic import Admission, ElasticCommunicator, WorldChange
from stratagem.core.errors import ConfigurationError, StratagemError, WorldChangedError
from stratagem.core.transport import Transport
from stratagem.core.transport_factory import default_factory
from stratagem.training.replica_sync import dtype_key, flatten_state, rebuild_state
from stratagem.training.sharding import shard_batch
from stratagem.training.variables import is_device_array


@dataclass
class Snapshot:
    """One commit: copies of the variables and the optimizers' state, the step, and the position in
    the training function (``(distribute_dataset calls started, batches yielded by the last one)``)."""

    number: int
    step: int
    values: dict[str, Any]
    optimizers: list[dict]
    position: tuple[int, int]


class ElasticTraining:
    """The elastic side of one mirrored strategy (see the module doc).

    Its collaborators are narrow: the strategy's public API (``transport``, ``cluster``,
    ``communicator``...), its :class:`~stratagem.strategies.training_state.TrainingState` (the variables,
    optimizers, step and batch share it copies and rolls back), and two callables the strategy hands
    over: ``sync_variables(created)`` (check the replicas created the same variables, give them the
    chief's values) and ``forget_plans()`` (drop the gradient buckets, checked anew in a new world).
    """

    def __init__(self, strategy, commit_every: int | None, *, sync_variables: Callable[[list], None],
                 forget_plans: Callable[[], None]):
        self.strategy = strategy
        self.state = strategy.training_state
        self._sync_variables = sync_variables
        self._forget_plans = forget_plans
        self.commit_every = commit_every
        self.comm: ElasticCommunicator | None = None
        self.snapshots: list[Snapshot] = []        # the last two commits, oldest first
        self.callbacks: list[Callable[[WorldChange], Any]] = []
        self.last_reset: WorldChange | None = None
        self.joined_late = False
        self._welcome: Admission | None = None     # a newcomer's state, until its variables exist
        self._replay_next = False                  # a newcomer's first elastic call fast-forwards
        self._pending_states: list[dict] = []      # optimizer states for optimizers not yet seen
        self._initial_states: dict[int, dict] = {} # id(optimizer) -> its state when first seen
        self.active = False                        # inside strategy.elastic(fn)
        self.started = False                       # an elastic call has begun
        self.calls = 0                             # distribute_dataset loops started in this call
        self.consumed = 0                          # batches the latest one yielded
        self.since_commit = 0                      # batches yielded since the last commit
        self._in_batch = False                     # the user's loop body runs on the batch yielded last
        self._step_at_yield = 0                    # the strategy's update count when it was yielded
        self.target: tuple[int, int] | None = None # the position to fast-forward to
        self._iterators: weakref.WeakSet = weakref.WeakSet()

    # -- the communicator and joining ---------------------------------------------------------------
    @property
    def formed(self) -> bool:
        return self.comm is not None

    def communicator(self) -> ElasticCommunicator:
        """The replicas' elastic communicator; made, and joined, on first use (the strategy's
        ``communicator``: its ``shutdown()`` closes it)."""
        if self.comm is None:
            return self.strategy.communicator     # made by form(), through the strategy
        return self.comm

    def form(self) -> ElasticCommunicator:
        """Make the replicas' elastic communicator and join the world (the strategy calls it once,
        when its communicator is first needed)."""
        s = self.strategy
        comm = ElasticCommunicator(s.transport, s.cluster.replicas(), name=f"strategy.{s.name}",
                                   coordinator=s.cluster.chief, **s.communicator_options())
        try:
            admission = comm.join()
        except BaseException:
            comm.close()
            raise
        self.comm = comm
        if admission.joined_late:
            self._welcome, self.joined_late = admission, True
        return comm

    def end_scope(self, created: list, first: bool) -> None:
        """The first outermost ``scope()`` block ended: join; the first world syncs the variables,
        a newcomer loads the committed state."""
        if not first:
            if created:
                raise ConfigurationError(
                    f"with on_failure='shrink', create every variable in the first scope() block (here: "
                    f"{', '.join(repr(v.name) for v in created)}): a restarted worker receives the "
                    f"variables when that block ends")
            return
        comm = self.communicator()
        if self._welcome is not None:
            self._load_welcome()
            return
        if comm.size > 1:
            self._sync_variables(created)
        self._snapshot((0, 0))   # commit 0: where every member of the first world starts

    def registered(self, optimizer) -> None:
        """A new optimizer: remember its pristine state (restored when a reset goes back to before
        its first step); a newcomer gives it the state it received."""
        index = next(i for i, o in enumerate(self.state.optimizers) if o is optimizer)
        self._initial_states[id(optimizer)] = optimizer.state_dict()
        if index < len(self._pending_states):
            optimizer.load_state_dict(self._pending_states[index])

    # -- commits -------------------------------------------------------------------------------------
    def commit(self) -> None:
        """Agree that the world is intact, then snapshot the state (see the module doc)."""
        comm = self.communicator()
        if self._welcome is not None:
            self._load_welcome()
        grow = comm.sync_point()
        consumed = self.consumed
        if self._in_batch and self.state.step == self._step_at_yield:
            consumed -= 1   # inside a loop's body, before its update: a retry starts with this batch again
        self._snapshot((self.calls, consumed))
        if grow:
            raise WorldChangedError("a restarted worker is waiting to join at this commit; the world grows")

    def _snapshot(self, position: tuple[int, int]) -> None:
        s = self.state
        reuse = self.snapshots[0].values if len(self.snapshots) >= 2 else {}
        values = {}
        for name, variable in s.variables.items():
            live, old = variable.value, reuse.get(name)
            if old is not None and type(old) is type(live) and old.shape == live.shape and old.dtype == live.dtype:
                old[...] = live          # the oldest commit's buffers are reused: no allocation per commit
                values[name] = old
            else:
                values[name] = live.copy()
        number = self.snapshots[-1].number + 1 if self.snapshots else 0
        snapshot = Snapshot(number, s.step, values, [o.state_dict() for o in s.optimizers], position)
        self.snapshots = [*self.snapshots, snapshot][-2:]
        self.since_commit = 0

    def _restore(self, number: int) -> None:
        snapshot = next((x for x in self.snapshots if x.number == number), None)
        if snapshot is None:
            raise StratagemError(f"{self.strategy.task}: cannot roll back to commit {number}: it keeps "
                                 f"{[x.number for x in self.snapshots]} (a bug: please report it)")
        s = self.state
        for name, variable in s.variables.items():
            variable.assign(snapshot.values[name])
        for index, optimizer in enumerate(s.optimizers):
            state = (snapshot.optimizers[index] if index < len(snapshot.optimizers)
                     else self._initial_states.get(id(optimizer)))
            if state is not None:
                optimizer.load_state_dict(state)
        s.step = snapshot.step
        self._forget_plans()   # every member (and a newcomer) checks the gradients anew in the new world
        self.snapshots = [x for x in self.snapshots if x.number <= number]
        self.since_commit = 0
        self.target = snapshot.position

    # -- what a newcomer receives --------------------------------------------------------------------
    def state_for(self, number: int) -> tuple[dict, list]:
        """The coordinator: commit ``number`` as ``(meta, arrays)`` for a newcomer."""
        snapshot = next(x for x in self.snapshots if x.number == number)
        names = list(self.state.variables)
        arrays = [np.ascontiguousarray(_host(snapshot.values[name])) for name in names]
        skeletons, counts = [], []
        for state in snapshot.optimizers:
            skeleton, state_arrays = flatten_state(state)
            skeletons.append(skeleton)
            counts.append(len(state_arrays))
            arrays += [np.ascontiguousarray(a) for a in state_arrays]
        meta = {"number": snapshot.number, "step": snapshot.step, "position": list(snapshot.position),
                "variables": [[n, list(arrays[i].shape), dtype_key(arrays[i].dtype)] for i, n in enumerate(names)],
                "optimizers": skeletons, "counts": counts}
        return meta, arrays

    def _load_welcome(self) -> None:
        admission, self._welcome = self._welcome, None
        s, meta, buffers = self.state, admission.state or {}, admission.buffers
        specs = {name: (tuple(shape), dtype) for name, shape, dtype in meta.get("variables", [])}
        mine = {name: (tuple(v.shape), dtype_key(v.dtype)) for name, v in s.variables.items()}
        if specs != mine:
            problems = [f"{n!r} {specs[n]} is missing here" for n in sorted(specs.keys() - mine.keys())]
            problems += [f"{n!r} {mine[n]} is not in the chief's state" for n in sorted(mine.keys() - specs.keys())]
            problems += [f"{n!r} is {mine[n]} here but {specs[n]} on the chief"
                         for n in sorted(specs.keys() & mine.keys()) if specs[n] != mine[n]]
            raise ConfigurationError(f"{self.strategy.task} cannot join: its variables differ from the chief's: "
                                     f"{'; '.join(problems)}. Every replica must create the same variables")
        names = [name for name, _, _ in meta["variables"]]
        values = dict(zip(names, buffers))
        for name in names:
            s.variables[name].assign(values[name])
        offset, states = len(names), []
        for skeleton, count in zip(meta["optimizers"], meta["counts"]):
            states.append(rebuild_state(skeleton, buffers[offset:offset + count]))
            offset += count
        self._pending_states = states
        for index, optimizer in enumerate(s.optimizers[:len(states)]):
            optimizer.load_state_dict(states[index])
        s.step = int(meta["step"])
        position = tuple(int(p) for p in meta["position"])
        self.snapshots = [Snapshot(int(meta["number"]), s.step, {n: values[n].copy() for n in names},
                                   states, position)]
        self.since_commit, self.target, self._replay_next = 0, position, True

    # -- the training function -------------------------------------------------------------------
    def run(self, fn: Callable, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)``, called again from the last commit whenever the world changes."""
        if self.active:   # nested: the outermost call does the retrying
            return fn(*args, **kwargs)
        self.communicator()
        if self._welcome is not None:
            self._load_welcome()
        if not self.snapshots:
            self._snapshot((0, 0))
        fresh, self._replay_next = not self._replay_next, False
        self.active = self.started = True
        self._iterators = weakref.WeakSet()
        try:
            while True:
                self.calls = self.consumed = 0
                try:
                    if fresh:
                        fresh, self.target = False, None
                        self.commit()   # the state this call starts from, whatever ran before it
                    return fn(*args, **kwargs)
                except WorldChangedError as exc:
                    self._reset(exc)
        finally:
            self.active = False

    def _reset(self, exc: WorldChangedError) -> None:
        change = self.comm.reform(self.snapshots[-1].number, lost=exc.lost, state_for=self.state_for)
        self._restore(change.commit)
        states = getattr(self.strategy, "compression_states", None)
        if states is not None:   # residuals of the steps rolled back must not be sent twice: start afresh
            states.clear()
        self.last_reset = change
        for callback in list(self.callbacks):
            callback(change)

    def shards(self, batches):
        """``distribute_dataset`` under shrink: fast-forward to the commit, commit every
        ``commit_every`` batches, and shard each global batch over the current world."""
        self.calls += 1
        skip = 0
        if self.target is not None:
            if self.calls < self.target[0]:
                return                      # this loop had ended before the commit
            skip, self.target = self.target[1], None
            if _one_shot(batches) and batches in self._iterators:
                raise ConfigurationError(
                    "distribute_dataset() got the same iterator again when the training function was "
                    "called again after a reset: it cannot start over. Make the batches inside the "
                    "function, or pass a list (any iterable that iter() starts afresh)")
        if _one_shot(batches):
            self._iterators.add(batches)
        s, comm = self.state, self.comm
        self.consumed = skip
        for index, batch in enumerate(batches):
            if index < skip:
                continue
            if self.commit_every is not None and self.since_commit >= self.commit_every:
                self.commit()
            shard, rows, total = shard_batch(batch, comm.rank, comm.size, what=f"global batch {index}")
            s.batch_share = rows / total if total else 1.0 / comm.size
            self.consumed = index + 1
            self.since_commit += 1
            self._in_batch, self._step_at_yield = True, s.step
            try:
                yield shard
            finally:
                self._in_batch = False


def check_elastic_transport(transport, plugins) -> None:
    """Refuse ``on_failure="shrink"`` over a transport whose world cannot change, before it starts."""
    factory = plugins if plugins is not None else default_factory()
    transport = factory.transport_or_default(transport)
    if isinstance(transport, Transport):
        cls = type(transport)
    elif isinstance(transport, str):
        cls = factory.transport_class(transport)
    else:
        return   # the base class says what is wrong with it
    if getattr(cls, "elastic", False):
        return
    why = {"mpi": "an MPI world is fixed when mpiexec starts it (MPI cannot add a rank to a running job, "
                  "and ULFM's shrink is not used here)",
           "nccl": "an NCCL communicator is fixed when it is created"}.get(cls.name, "it cannot change its world")
    raise ConfigurationError(
        f"on_failure='shrink' is not supported over transport {cls.name!r}: {why}. Use transport='zmq' "
        f"(or 'grpc', 'shm') for elastic training, or on_failure='raise' over {cls.name!r}")


def elastic_wrapper(training: ElasticTraining | None, fn: Callable) -> Callable:
    """``fn`` wrapped by ``strategy.elastic`` (called as it is without shrink)."""
    if not callable(fn):
        raise TypeError(f"strategy.elastic() wraps your training function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if training is None:
            return fn(*args, **kwargs)
        return training.run(fn, args, kwargs)

    return run


def _one_shot(batches) -> bool:
    """An iterator (iter() returns itself) that can be weakly referenced (generators can)."""
    try:
        if iter(batches) is not batches:
            return False
        weakref.ref(batches)
    except TypeError:
        return False
    return True


def _host(array):
    return array.get() if is_device_array(array) else array
