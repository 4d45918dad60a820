"""The public face of the collectives: a :class:`Communicator` over one transport
(README: "The API in one example").

A communicator is a group of tasks (by default the world's replicas: the chief, then the workers),
each with a ``rank``. Every member calls the same collectives in the same order; each call returns a
new array and never modifies its input. A call that does not match its peers' (another collective,
op, dtype or shape, or a skipped call) raises :class:`~stratagem.core.errors.CollectiveMismatchError`
on every rank instead of hanging; a dead peer raises
:class:`~stratagem.core.errors.PeerLostError` naming it. After either, the communicator is broken:
make a new one.

Example (three ranks as threads of one process, over the in-process transport)::

    >>> import numpy as np
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from stratagem.testing.world import local_world
    >>> comms = local_world(3)
    >>> def step(comm):
    ...     return comm.allreduce(np.full(2, comm.rank + 1.0, np.float32), op="sum")
    >>> with ThreadPoolExecutor(3) as pool:
    ...     results = list(pool.map(step, comms))
    >>> results[0], results[2]
    (array([6., 6.], dtype=float32), array([6., 6.], dtype=float32))
    >>> for comm in comms: comm.close()

In a real job, every process runs ``comm = stratagem.communicator(transport="zmq")`` (the cluster
and this task come from the environment) and calls the same collectives.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Sequence

import numpy as np

from stratagem.collectives import algorithms as coll
from stratagem.collectives import hierarchical as hier
from stratagem.core.cluster import ClusterResolver, TaskId
from stratagem.core.errors import CollectiveMismatchError, CommunicationError, ConfigurationError, PeerLostError, TransportClosed
from stratagem.core.transport import NativeCollective, Transport
from stratagem.core.transport_factory import default_factory
from stratagem.core import endpoints

#: Options ``open_communicator`` passes to the Communicator (anything else must go in transport_options).
COMMUNICATOR_OPTIONS = ("members", "name", "timeout", "chunk_bytes", "small_bytes", "hierarchical")


def _identity(result):
    return result


def _stage(x, device_buffers: bool) -> tuple[Any, Callable]:
    """Where the algorithms may touch ``x``: ``(array to work on, function returning a result to x's kind)``.

    A cupy array over a transport that moves only host memory is copied to the host and the result
    copied back to the device; everything else is used as it is. cupy is imported only when the
    caller already holds a cupy array.
    """
    if x is None or device_buffers or not coll.is_device_array(x):
        return x, _identity
    import cupy  # the caller holds a cupy array, so cupy is installed

    return x.get(), cupy.asarray


def _torch_tensor_type():
    """``torch.Tensor`` if torch is already imported (a caller holding a tensor has imported it), else None."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None)


def _from_torch(x):
    """``(x as an array, function turning a result back to x's kind)``: a torch tensor becomes a numpy
    view (CPU, ``tensor.numpy()``: no copy) or a cupy view (CUDA, DLPack), and results come back as
    tensors sharing the result's memory; anything else passes as it is. torch is never imported here."""
    tensor_type = _torch_tensor_type()
    if tensor_type is None or not isinstance(x, tensor_type):
        return x, _identity
    torch = sys.modules["torch"]
    x = x.detach()
    if x.device.type == "cpu":
        return x.resolve_conj().numpy(), torch.from_numpy
    import cupy  # a CUDA tensor: cupy is how the transports hold device memory

    return cupy.from_dlpack(x), torch.from_dlpack


def _torch_out(out):
    """``out`` as an array the collective writes into in place (a torch tensor: its numpy/cupy view)."""
    array, back = _from_torch(out)
    if back is not _identity and not out.is_contiguous():
        raise ConfigurationError("out= must be a contiguous tensor (the result is written into its memory)")
    return array


def _with_kind(result, back):
    return result if result is None or back is _identity else back(result)


class Communicator:
    """Collectives among ``members`` over ``transport``.

    Args:
        transport: this task's transport (started here if it is not yet).
        members: the tasks of the group, in rank order; default: ``transport.cluster.replicas()``
            (chief, then workers). Must include ``transport.task``.
        name: distinguishes communicators sharing a transport; all collective traffic goes under
            the tag ``coll/<name>``, so two live communicators on one transport need different names.
        timeout: seconds any single receive may wait (default: the transport's timeout).
        chunk_bytes: largest message of a pipelined algorithm (default 4 MiB). Same on every rank.
        small_bytes: tensors of at most this size use the latency-optimal algorithms (direct
            exchange or recursive doubling, binomial tree) instead of the bandwidth-optimal ones
            (default 64 KiB; up to 4 ranks the direct exchange also covers tensors a little larger,
            see :mod:`stratagem.collectives.algorithms`).
        owns_transport: close the transport in :meth:`close` (``open_communicator`` sets it).
        hierarchical: ``True``: all-reduces larger than the latency-bound sizes run hierarchically
            (:mod:`stratagem.collectives.hierarchical`: inside each host, then between hosts), the
            hosts found from the members' addresses; or the members of each host, as lists of ranks
            or tasks (``[[0, 1], [2, 3]]``); ``False`` (the default): flat. Every host must have as
            many members. Either way ``allreduce(x, algorithm="hierarchical")`` forces it.

    If the transport's ``native_collectives()`` offers a collective
    (:class:`~stratagem.core.transport.NativeCollective`) and it accepts the call, it runs instead of
    the core algorithm (:mod:`stratagem.collectives.algorithms`); a call it declines runs core's. Either
    way the call is numbered once, by the session.

    Methods may be called from one thread at a time per communicator (calls are serialised).

    The collectives take and give torch tensors too: a CPU tensor goes in as a numpy view of its memory
    (no copy), a CUDA one through DLPack, and the result comes back as a tensor (``out=`` a tensor is
    written in place and returned). torch is never imported by this module.
    """

    def __init__(self, transport: Transport, members: Sequence[TaskId | str] | None = None, *,
                 name: str = "world", timeout: float | None = None,
                 chunk_bytes: int = coll.DEFAULT_CHUNK_BYTES, small_bytes: int = coll.DEFAULT_SMALL_BYTES,
                 owns_transport: bool = False, hierarchical=False):
        if not isinstance(transport, Transport):
            raise ConfigurationError(f"a Communicator needs a Transport, got {type(transport).__name__}")
        self.transport = transport
        self._owns_transport = owns_transport
        members = _check_members(transport, members)
        _check_options(name, timeout, chunk_bytes, small_bytes, transport)
        transport.start()  # idempotent; a communicator on an unstarted transport would only time out
        self._session = coll.CollectiveSession(
            transport, members, members.index(transport.task), name=name,
            timeout=transport.timeout if timeout is None else float(timeout),
            chunk_bytes=int(chunk_bytes), small_bytes=int(small_bytes),
        )
        self._native = _natives(transport)
        #: Which members share a host, for the hierarchical all-reduce (None: flat).
        self._hosts = hier.HostLayout.from_option(hierarchical, members, transport.cluster)
        self._checked: dict[tuple, np.dtype] = {}   # (dtype, op, algorithm) -> result dtype, checked
        self._lock = threading.Lock()  # one collective at a time: interleaved calls would mismatch
        self._close_lock = threading.Lock()
        self._closed = False
        self._recorder = transport.recorder   # the task's timeline (a no-op one when it is off)
        self._recorder.attach(transport)

    # -- identity ------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This task's position in ``members`` (0 is the chief when members are the default)."""
        return self._session.rank

    @property
    def size(self) -> int:
        """Number of members."""
        return self._session.size

    @property
    def members(self) -> list[TaskId]:
        """The member tasks in rank order (a copy)."""
        return list(self._session.members)

    @property
    def task(self) -> TaskId:
        """This process's task."""
        return self.transport.task

    @property
    def name(self) -> str:
        return self._session.name

    @property
    def timeout(self) -> float | None:
        return self._session.timeout

    @property
    def chunk_bytes(self) -> int:
        return self._session.chunk_bytes

    @property
    def small_bytes(self) -> int:
        return self._session.small_bytes

    def __repr__(self) -> str:
        return f"<Communicator {self.name!r} rank {self.rank}/{self.size} on {self.transport!r}>"

    # -- collectives ---------------------------------------------------------------------------------
    def allreduce(self, x, op: str = "sum", algorithm: str = "auto", out=None):
        """Reduce ``x`` elementwise over every rank; every rank gets the same bits.

        ``op``: ``sum``, ``mean``, ``min``, ``max`` or ``prod``. Returns a new array of ``x``'s shape
        and dtype (``mean`` of integers or bools returns float64, as ``np.mean`` does; otherwise
        ``mean`` sums in ``x``'s dtype, then divides; bools accept ``min``/``max``/``mean`` only).
        ``algorithm``: ``auto`` (up to 4 ranks: a direct exchange for small tensors, else pairwise
        or, at 2 ranks, the ring; larger worlds: recursive doubling up to ``small_bytes``, else the
        pipelined ring: see :mod:`stratagem.collectives.algorithms`), ``ring``, ``recursive_doubling``,
        ``direct``, ``pairwise`` or ``hierarchical`` (a communicator made with ``hierarchical=``: inside
        each host, then between hosts; ``auto`` picks it there instead of ``ring`` or ``pairwise``). ``out``: write the result there instead (an array of x's
        shape and the result dtype; ``out=x`` reduces in place); reusing one buffer across steps
        saves an allocation per call.

        >>> import numpy as np
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from stratagem.testing.world import local_world
        >>> comms = local_world(2)
        >>> with ThreadPoolExecutor(2) as pool:
        ...     out = list(pool.map(lambda c: c.allreduce(np.array([c.rank, 5]), op="max"), comms))
        >>> out[1]
        array([1, 5])
        >>> for c in comms: c.close()
        """
        back, given_out = _identity, out
        tensor = _torch_tensor_type() if "torch" in sys.modules else None   # on every step's path
        if tensor is not None and (isinstance(x, tensor) or isinstance(out, tensor)):
            given, (x, back) = x, _from_torch(x)
            if out is not None:
                out = x if out is given else _torch_out(out)     # out=x: in place, one view of one tensor
        if type(x) is not np.ndarray:
            x = coll.as_array(x)
        if self._hosts is not None or algorithm == hier.ALGORITHM:
            if hier.chooses(self._hosts, self._session, x, op, algorithm):
                run = functools.partial(hier.allreduce, layout=self._hosts)
                if out is None:
                    return _with_kind(self._call("allreduce", x, op=op, algorithm=algorithm, run=run), back)
                self._call("allreduce", x, op=op, algorithm=algorithm, out=out, run=run)
                return given_out
        if "allreduce" in self._native or type(x) is not np.ndarray:
            # A native implementation is handed checked arguments, and a device array's out is not
            # passed on (the result is copied into it); otherwise core's allreduce checks them itself,
            # the same way (once per call: this is on every training step's path, so what depends
            # only on dtype, op and algorithm is checked once for each, and out on every call).
            key = (x.dtype, op, algorithm) if type(op) is str and type(algorithm) is str else None
            dtype = self._checked.get(key)
            if dtype is None:
                dtype = coll.check_allreduce(x, op, algorithm, None)
                if key is not None:
                    self._checked[key] = dtype
            if out is not None:
                coll.check_out(out, x, dtype, "allreduce")
        if out is None:
            return _with_kind(self._call("allreduce", x, op=op, algorithm=algorithm), back)
        self._call("allreduce", x, op=op, algorithm=algorithm, out=out)
        return given_out

    def broadcast(self, x, root: int = 0, algorithm: str = "auto"):
        """The root's ``x`` on every rank, as a new array.

        Non-roots pass either an array of the root's shape and dtype (checked against the root's; its
        contents are ignored and it is not modified) or ``None`` (shape and dtype come from the root).
        Every rank first checks with every other one that they make the same call (root, dtype,
        shape), so a rank that disagrees makes every rank raise ``CollectiveMismatchError``, the root
        included. ``algorithm`` (the root's counts): ``auto`` (up to ``small_bytes`` the tensor rides
        on the root's agreement messages, else scatter + ring all-gather), ``binomial_tree`` or
        ``scatter_allgather``.

        >>> import numpy as np
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from stratagem.testing.world import local_world
        >>> comms = local_world(3)
        >>> def share(c):
        ...     return c.broadcast(np.arange(3) * 10 if c.rank == 1 else None, root=1)
        >>> with ThreadPoolExecutor(3) as pool:
        ...     out = list(pool.map(share, comms))
        >>> out[0]
        array([ 0, 10, 20])
        >>> for c in comms: c.close()
        """
        root = coll.check_root(root, self.size)
        coll.check_algorithm(algorithm, coll.BROADCAST_ALGORITHMS, "broadcast")
        if x is None and self.rank == root:
            raise ConfigurationError(f"broadcast: the root (rank {root}) must pass the array to send, not None")
        x, back = _from_torch(x)
        if x is not None:
            x = coll.as_array(x)
            coll.check_dtype(x.dtype, "broadcast")
        return _with_kind(self._call("broadcast", x, root=root, algorithm=algorithm), back)

    def allgather(self, x):
        """Every rank's ``x`` stacked in rank order: a new array of shape ``(size, *x.shape)``.

        Every rank must pass the same shape and dtype.

        >>> import numpy as np
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from stratagem.testing.world import local_world
        >>> comms = local_world(2)
        >>> with ThreadPoolExecutor(2) as pool:
        ...     out = list(pool.map(lambda c: c.allgather(np.array([c.rank, c.rank])), comms))
        >>> out[0]
        array([[0, 0],
               [1, 1]])
        >>> for c in comms: c.close()
        """
        x, back = _from_torch(x)
        x = coll.as_array(x)
        coll.check_dtype(x.dtype, "allgather")
        return _with_kind(self._call("allgather", x), back)

    def reduce_scatter(self, x, op: str = "sum"):
        """Reduce ``x`` over every rank; return this rank's segment of the flattened result.

        Segments are split like ``np.array_split(reduced.reshape(-1), size)``: with ``L`` elements,
        the first ``L % size`` ranks get ``L // size + 1`` elements, the others ``L // size``. The
        result is a new 1-d array (float64 for ``mean`` of integers or bools).

        >>> import numpy as np
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from stratagem.testing.world import local_world
        >>> comms = local_world(2)
        >>> with ThreadPoolExecutor(2) as pool:
        ...     out = list(pool.map(lambda c: c.reduce_scatter(np.arange(5)), comms))
        >>> out
        [array([0, 2, 4]), array([6, 8])]
        >>> for c in comms: c.close()
        """
        x, back = _from_torch(x)
        x = coll.as_array(x)
        coll.check_dtype(x.dtype, "reduce_scatter")
        coll.check_op(op, x.dtype, "reduce_scatter")
        return _with_kind(self._call("reduce_scatter", x, op=op), back)

    def barrier(self) -> None:
        """Return only once every rank has called ``barrier``.

        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from stratagem.testing.world import local_world
        >>> comms = local_world(2)
        >>> with ThreadPoolExecutor(2) as pool:
        ...     list(pool.map(lambda c: c.barrier(), comms))
        [None, None]
        >>> for c in comms: c.close()
        """
        self._call("barrier", None)

    # -- lifecycle -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop using the communicator; closes the transport if the communicator opened it. Idempotent.

        >>> from stratagem.testing.world import local_world
        >>> (comm,) = local_world(1)
        >>> comm.close(); comm.close()
        """
        # Not under the call lock: closing is how another thread interrupts a collective stuck in a
        # receive (the transport wakes it with TransportClosed).
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_transport:
            self._recorder.settle(self.transport)
            self.transport.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- dispatch ------------------------------------------------------------------------------------
    def _call(self, collective: str, x, run=None, **kwargs):
        """Run one collective: ``run(session, x, **kwargs)`` if given (the hierarchical all-reduce), else
        native if the transport has it, else core's algorithm."""
        recorder = self._recorder
        started = recorder.now() if recorder.enabled else 0   # (the timeline off: no call per step)
        with self._lock:
            self._check_usable()
            if type(x) is np.ndarray or x is None:
                restore = _identity
            else:
                x, restore = _stage(x, self.transport.device_buffers)
            out = kwargs.get("out")
            if out is not None and restore is not _identity:
                del kwargs["out"]  # computed on the host, then copied into the device's out
            native = None if run is not None else self._native.get(collective)
            if native is not None and not native.takes(self._session, x, kwargs):
                native = None
            if run is not None:
                result = run(self._session, x, **kwargs)
            elif native is None:
                result = self._core(collective, x, kwargs)
            else:
                result = self._run_native(native, collective, x, kwargs)
        if recorder.enabled:
            recorder.record("collective", collective, started, self._describe, collective, x, result, kwargs, native)
        if result is None:
            return None
        if out is not None and restore is not _identity:
            out[...] = restore(result)
            return out
        return restore(result)

    def _describe(self, collective: str, x, result, kwargs: dict, native) -> dict:
        """One collective on the timeline: its payload bytes, the other members, op and path."""
        nbytes = int(getattr(x if x is not None else result, "nbytes", 0))
        args = {"bytes": nbytes, "wire_bytes": _ring_bytes(collective, nbytes, self.size),
                "peers": [str(m) for m in self._session.members if m != self.transport.task],
                "communicator": self.name, "native": native is not None}
        for key in ("op", "root", "algorithm"):
            if key in kwargs:
                args[key] = kwargs[key]
        return args

    def _core(self, collective: str, x, kwargs: dict):
        algorithm = coll.ALGORITHMS[collective]
        return algorithm(self._session) if collective == "barrier" else algorithm(self._session, x, **kwargs)

    def _run_native(self, native: NativeCollective, collective: str, x, kwargs: dict):
        session = self._session
        session.next_seq()  # "collective #N" counts every call, native or not
        try:
            result = native.run(session) if collective == "barrier" else native.run(session, x, **kwargs)
        except Exception as exc:
            session.broken = exc
            raise
        if collective != "barrier":
            sized = x if x is not None else result       # a broadcast's non-roots pass no input
            nbytes = _ring_bytes(collective, int(getattr(sized, "nbytes", 0)), session.size)
            self.transport.traffic.count_exchanged(None, nbytes, nbytes)
        return result

    def _check_usable(self) -> None:
        if not self._closed and self._session.broken is None:
            return
        if self._closed:
            raise TransportClosed(f"communicator {self.name!r} is closed; create a new one")
        broken = self._session.broken
        if broken is not None:
            raise _broken_error(self.name, broken) from broken


def _natives(transport: Transport) -> dict[str, NativeCollective]:
    natives = dict(transport.native_collectives() or {})
    for name, native in natives.items():
        if name not in coll.ALGORITHMS or not isinstance(native, NativeCollective):
            raise ConfigurationError(
                f"{type(transport).__name__}.native_collectives() must map collective names "
                f"({', '.join(coll.ALGORITHMS)}) to NativeCollective(run, accepts) objects "
                f"(stratagem.core.transport), not {name!r}: {type(native).__name__}")
    return natives


def _broken_error(name: str, cause: BaseException) -> Exception:
    """The error for a call on a broken communicator: the same kind as the failure that broke it."""
    message = (f"communicator {name!r} is unusable since a collective failed ({cause}); peers may be "
               f"mid-call, so create a new communicator (and transport) to continue")
    if isinstance(cause, CollectiveMismatchError):
        return CollectiveMismatchError(message)
    if isinstance(cause, PeerLostError):
        return PeerLostError(cause.task, message)
    return CommunicationError(message)


def _check_members(transport: Transport, members) -> list[TaskId]:
    if members is None:
        members = transport.cluster.replicas()
    members = [transport.cluster.check(TaskId.parse(m)) for m in members]
    if not members:
        raise ConfigurationError("a communicator needs at least one member")
    duplicates = sorted({str(m) for m in members if members.count(m) > 1})
    if duplicates:
        raise ConfigurationError(f"communicator members must be distinct; repeated: {', '.join(duplicates)}")
    if transport.task not in members:
        raise ConfigurationError(
            f"{transport.task} is not among the communicator's members ({', '.join(map(str, members))}); "
            f"pass members=[...] that include it (by default the members are the chief and workers)"
        )
    return members


def _check_options(name, timeout, chunk_bytes, small_bytes, transport: Transport) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"communicator name must be a non-empty string, got {name!r}")
    limit = transport.limits.max_tag_chars - len("coll/")
    if len(name) > limit:
        raise ConfigurationError(f"communicator name of {len(name)} characters is too long (at most {limit})")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ConfigurationError(f"timeout must be a number of seconds > 0 (or None), got {timeout!r}")
    for option, value, minimum in (("chunk_bytes", chunk_bytes, 1), ("small_bytes", small_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigurationError(f"{option} must be an integer >= {minimum}, got {value!r}")


def open_communicator(transport_name: str | None = None, *, transport_options: dict | None = None,
                      **options) -> Communicator:
    """A communicator over a new, started transport for this process's task.

    ``transport_name`` defaults to the environment's ``STRATAGEM_TRANSPORT``
    (``stratagem launch --transport``), else ``zmq``.

    The cluster, task and secret come from the environment (``ClusterResolver.from_env()``:
    ``STRATAGEM_CONFIG``, ``TF_CONFIG`` or MPI variables). ``options`` are the Communicator's
    (``members``, ``name``, ``timeout``, ``chunk_bytes``, ``small_bytes``; ``timeout`` also becomes the
    transport's default); ``transport_options`` go to the transport plugin. The communicator owns the
    transport and closes it in ``close()``. If a strategy or communicator of this process already
    runs this task's transport (bound to a fixed address), the communicator shares it instead (and
    leaves it to its owner): see :mod:`stratagem.core.endpoints`.

    >>> from stratagem.transports.local import LocalTransport
    >>> comm = open_communicator("local", transport_options=LocalTransport.world_options())  # doctest: +SKIP
    >>> comm.size  # doctest: +SKIP
    1
    """
    unknown = sorted(set(options) - set(COMMUNICATOR_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown communicator option(s) {', '.join(unknown)}; known: {', '.join(COMMUNICATOR_OPTIONS)} "
            f"(pass transport settings as transport_options={{...}})"
        )
    resolved = ClusterResolver.from_env()
    transport_options = dict(transport_options or {})
    if options.get("timeout") is not None:
        transport_options.setdefault("timeout", options["timeout"])
    factory = default_factory()
    transport_name = factory.transport_or_default(transport_name)
    # A strategy (or communicator) of this process already serves this task: share its transport.
    running = endpoints.shared(transport_name, resolved.cluster, resolved.task,
                               {k: v for k, v in transport_options.items() if not (k == "timeout" and
                                                                                  options.get("timeout") == v)},
                               who="stratagem.communicator()")
    if running is not None:
        return Communicator(running, owns_transport=False, **options)
    transport = factory.create_transport(
        transport_name, cluster=resolved.cluster, task=resolved.task, secret=resolved.secret,
        **transport_options,
    )
    try:
        transport.start()
        endpoints.hold(transport)
        return Communicator(transport, owns_transport=True, **options)
    except BaseException:
        transport.close()
        raise


def _ring_bytes(collective: str, nbytes: int, size: int) -> int:
    """What one rank would send (and receive) running ``collective`` on ``nbytes`` with a ring: the
    traffic a native collective is booked at, since the library moving it cannot be watched."""
    if size <= 1:
        return 0
    if collective == "allreduce":
        return 2 * (size - 1) * nbytes // size
    if collective == "allgather":          # x is this rank's piece: it passes on the others'
        return (size - 1) * nbytes
    return (size - 1) * nbytes // size     # broadcast, reduce_scatter
