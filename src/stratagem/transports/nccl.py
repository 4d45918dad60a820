"""NCCL collectives on the GPU, with a ZeroMQ control channel (``nccl`` transport, needs cupy).

One process drives one GPU: by default the *local rank* (the position of this task among the
cluster's tasks on the same host, or ``LOCAL_RANK`` when set), modulo the visible devices; the
``device=`` option picks one explicitly.

* **Control transport.** Every NCCL transport creates a :class:`~stratagem.transports.zmq.transport.ZmqTransport`
  on this task's own address. It carries the contract's point-to-point messages and the NCCL
  unique ids. cupy buffers of a message are staged to the host for the trip and come back as cupy
  arrays on this transport's device (a reserved metadata key says which buffers were on the device).
  NCCL's own send/recv are *not* used for the mailbox: they are rendezvous operations that both
  sides must post with the same count in the same order, with no tags, no receive-from-any-peer and
  no timeout, so they cannot give the contract's semantics; the collectives are where NCCL pays.
* **Native collectives.** ``allreduce``, ``broadcast``, ``allgather`` and ``reduce_scatter`` run as
  NCCL calls on a stream of this device, with one NCCL communicator per member list, made on first
  use: the first member makes the unique id (``nccl.get_unique_id()``) and sends it to the others
  over the control transport. Every call first *agrees*: an NCCL all-reduce (max) of a hash of the
  call's fingerprint and of its negation, so ranks that called different things raise
  ``CollectiveMismatchError`` instead of reducing garbage. Waiting polls the stream with the
  communicator's timeout; on timeout the NCCL communicator is aborted and ``TransportTimeout`` raised.
  numpy inputs are copied to the device and the result copied back (the result has the input's kind).
  Dtypes NCCL has no type for are carried as one it has where the result is the same (bool as
  uint8, int16/uint16 widened for min/max and wrapping sum/prod, complex sum/mean as float pairs);
  the rest (bfloat16, complex prod/min/max) falls back to core's algorithms over the control
  transport, after the agreement. ``barrier`` is core's, over the control transport.

cupy is imported only inside functions: importing this module, or listing plugins, never needs it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Callable, Mapping

import msgpack
import numpy as np

from stratagem.collectives import algorithms as coll
from stratagem.core.cluster import TaskId, host_of
from stratagem.collectives.session import CollectiveSession, describe, fingerprint
from stratagem.core.errors import (CollectiveMismatchError, ConfigurationError, PluginError, TransportClosed,
                           TransportTimeout)
from stratagem.core.transport import Message, NativeCollective, SendHandle, Transport
from stratagem.core.wire import DTYPES, dtype_name

INSTALL_HINT = "pip install 'stratagem[gpu]'"
#: Reserved metadata key: indices of the buffers that were cupy arrays when sent.
_DEVICE_KEY = "__nccl_device_buffers__"
_UID_TAG = "nccl/uid"
_HEADER_BYTES = 1024


def _cupy():
    import cupy

    return cupy


def _nccl():
    from cupy.cuda import nccl

    return nccl


def _nccl_type(dtype: np.dtype):
    nccl = _nccl()
    table = {
        "int8": nccl.NCCL_INT8, "uint8": nccl.NCCL_UINT8, "int32": nccl.NCCL_INT32,
        "uint32": nccl.NCCL_UINT32, "int64": nccl.NCCL_INT64, "uint64": nccl.NCCL_UINT64,
        "float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64,
    }
    return table.get(np.dtype(dtype).name)


def _nccl_op(op: str):
    nccl = _nccl()
    return {"sum": nccl.NCCL_SUM, "mean": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD,
            "min": nccl.NCCL_MIN, "max": nccl.NCCL_MAX}[op]


def _carrier(dtype: np.dtype, op: str | None) -> np.dtype | None:
    """The dtype NCCL moves ``dtype`` as (same result bits), or None when core must do it.

    ``op`` None: data movement only (broadcast, allgather), where any dtype goes as bytes.
    """
    dtype = np.dtype(dtype)
    if op is None:
        return np.dtype(np.uint8)
    if dtype.name in ("int16", "uint16"):
        # min/max are exact when widened; sum/prod wrap identically modulo 2**16 when narrowed back
        return np.dtype(np.int32) if dtype.name == "int16" else np.dtype(np.uint32)
    if dtype == np.bool_:
        return np.dtype(np.uint8)  # min/max only (check_op refuses bool sum/prod)
    if dtype.kind == "c":
        return np.dtype(np.float32 if dtype.itemsize == 8 else np.float64) if op in ("sum", "mean") else None
    if _nccl_type(dtype) is not None:
        return dtype
    return None


class NcclTransport(Transport):
    """GPU collectives through NCCL (cupy), point-to-point over a ZeroMQ control transport.

    Args:
        device: the CUDA device of this process (default: the local rank modulo the device count).
        control_options: options for the control :class:`~stratagem.transports.zmq.transport.ZmqTransport` (``bind_host``...).
        **common: the options every transport takes (``secret``, ``timeout``...), shared with the
            control transport.
    """

    name = "nccl"
    device_buffers = True

    def __init__(self, cluster, task, *, device: int | None = None, control_options: dict | None = None,
                 **common):
        super().__init__(cluster, task, **common)
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise ConfigurationError(f"nccl: device must be a CUDA device index >= 0, got {device!r}")
        self._device_opt = device
        self.device: int | None = None
        from stratagem.transports.zmq.transport import ZmqTransport

        self.control = ZmqTransport(self.cluster, self.task, **common, **(control_options or {}))
        self.traffic = self.control.traffic   # point-to-point goes over the control transport
        self._comms: dict[tuple, object] = {}
        self._streams: dict[tuple, object] = {}
        self._lock = threading.RLock()
        self._started = False

    @classmethod
    def check_usable(cls) -> None:
        try:
            import cupy
            from cupy.cuda import nccl
        except Exception as exc:  # ImportError, or a cupy built for another CUDA
            raise PluginError(f"transport 'nccl' needs cupy with NCCL ({exc}); install it with: {INSTALL_HINT}") from None
        if not getattr(nccl, "available", True):
            raise PluginError(f"transport 'nccl': this cupy was built without NCCL; install it with: {INSTALL_HINT}")
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise PluginError(f"transport 'nccl': no CUDA device is visible ({exc})") from None
        if count < 1:
            raise PluginError("transport 'nccl': no CUDA device is visible")

    def local_rank(self) -> int:
        """``LOCAL_RANK`` if set, else this task's position among the cluster's tasks on its host."""
        for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        host = host_of(self.cluster.address(self.task) or "")
        same = [t for t in self.cluster.tasks() if host_of(self.cluster.address(t) or "") == host]
        return same.index(self.task) if self.task in same else 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            if self._closed:
                raise TransportClosed(f"{self.task}: a closed transport cannot be started again")
            self.check_usable()
            cupy = _cupy()
            count = cupy.cuda.runtime.getDeviceCount()
            device = self._device_opt if self._device_opt is not None else self.local_rank() % count
            if device >= count:
                raise ConfigurationError(f"nccl: device {device} does not exist ({count} visible)")
            self.device = device
            cupy.cuda.Device(device).use()
            self.control.start()
            self._started = True

    def _shutdown(self, graceful: bool) -> None:
        with self._lock:
            comms, self._comms = list(self._comms.values()), {}
        for comm in comms:
            try:
                comm.destroy() if graceful else comm.abort()
            except Exception:
                pass
        self.control.close() if graceful else self.control.abort()

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise TransportClosed(f"{self.task}: the nccl transport is "
                                  f"{'closed' if self._closed else 'not started (call start())'}")

    # -- messaging (over the control transport) ----------------------------------------------------
    def _to_host(self, msg: Message) -> Message:
        if _DEVICE_KEY in msg.meta:
            raise ConfigurationError(f"nccl: metadata key {_DEVICE_KEY!r} is reserved")
        on_device = [i for i, b in enumerate(msg.buffers) if coll.is_device_array(b)]
        if not on_device:
            return msg
        buffers = [b.get() if i in on_device else b for i, b in enumerate(msg.buffers)]
        return Message({**msg.meta, _DEVICE_KEY: on_device}, buffers)

    def _from_host(self, msg: Message) -> Message:
        on_device = msg.meta.pop(_DEVICE_KEY, None)
        if on_device:
            cupy = _cupy()
            with cupy.cuda.Device(self.device):
                msg.buffers = [cupy.asarray(b) if i in on_device else b for i, b in enumerate(msg.buffers)]
        return msg

    def send(self, dst: TaskId, tag: str, msg: Message, timeout: float | None = None) -> None:
        self._require_started()
        self.control.send(dst, tag, self._to_host(msg), self._timeout(timeout))

    def send_async(self, dst: TaskId, tag: str, msg: Message, timeout: float | None = None) -> SendHandle:
        self._require_started()
        return self.control.send_async(dst, tag, self._to_host(msg), self._timeout(timeout))

    def recv(self, src: TaskId | None, tag: str, timeout: float | None = None) -> Message:
        self._require_started()
        return self._from_host(self.control.recv(src, tag, self._timeout(timeout)))

    def lost_peers(self) -> dict[TaskId, str]:
        return self.control.lost_peers()

    def flush(self, timeout: float | None = None, tasks=None) -> None:
        self.control.flush(timeout, tasks)

    # -- native collectives ------------------------------------------------------------------------
    def native_collectives(self) -> Mapping[str, NativeCollective]:
        return {"allreduce": NativeCollective(self._allreduce, _accepts_allreduce),
                "broadcast": NativeCollective(self._broadcast),
                "allgather": NativeCollective(self._allgather),
                "reduce_scatter": NativeCollective(self._reduce_scatter, _accepts_reduce_scatter)}

    def _comm(self, session: CollectiveSession):
        """The NCCL communicator of ``session``'s members (made on first use) and its stream."""
        key = tuple(str(m) for m in session.members)
        with self._lock:
            self._require_started()
            if key in self._comms:
                return self._comms[key], self._streams[key]
        nccl, cupy = _nccl(), _cupy()
        tag = f"{_UID_TAG}/{hashlib.sha1('|'.join(key).encode()).hexdigest()[:16]}"
        if session.rank == 0:
            uid = nccl.get_unique_id()
            for member in session.members[1:]:
                self.control.send(member, tag, Message({"uid": list(uid)}), session.timeout)
        else:
            uid = tuple(self.control.recv(session.members[0], tag, session.timeout).meta["uid"])
        with cupy.cuda.Device(self.device):
            comm = nccl.NcclCommunicator(session.size, uid, session.rank)
            stream = cupy.cuda.Stream(non_blocking=True)
        with self._lock:
            self._comms[key], self._streams[key] = comm, stream
        return comm, stream

    def _wait(self, session: CollectiveSession, comm, stream, what: str) -> None:
        timeout = session.timeout if session.timeout is not None else self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while not stream.done:
            if self._closed:
                raise TransportClosed(f"{self.task}: transport closed during {what}")
            if deadline is not None and time.monotonic() > deadline:
                key = tuple(str(m) for m in session.members)
                with self._lock:
                    self._comms.pop(key, None)
                try:
                    comm.abort()
                except Exception:
                    pass
                raise TransportTimeout(f"{self.task}: {what} did not complete within {timeout}s "
                                       f"(some member of {list(key)} is missing or stuck); NCCL communicator aborted")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _agree(self, session: CollectiveSession, fp: dict):
        """Check every rank called the same thing (NCCL all-reduce max of the hash and its negation)."""
        comm, stream = self._comm(session)
        cupy = _cupy()
        h = int.from_bytes(hashlib.sha1(msgpack.packb(fp)).digest()[:7], "little")
        with cupy.cuda.Device(self.device):
            buf = cupy.asarray(np.array([h, -h], dtype=np.int64))
            comm.allReduce(buf.data.ptr, buf.data.ptr, 2, _nccl().NCCL_INT64, _nccl().NCCL_MAX, stream.ptr)
            self._wait(session, comm, stream, describe(fp))
            top, neg = (int(v) for v in buf.get())
        if top != h or -neg != h:
            raise CollectiveMismatchError(
                f"{session.who(session.rank)} called {describe(fp)}, but another member of the "
                f"communicator called something else (the NCCL agreement hashes differ)")
        return comm, stream

    def _device_flat(self, x, dtype: np.dtype):
        """``x`` as a fresh flat C-contiguous cupy array of ``dtype`` on this device."""
        cupy = _cupy()
        with cupy.cuda.Device(self.device):
            return cupy.array(x, dtype=dtype, order="C", copy=True).reshape(-1)

    @staticmethod
    def _like_input(x, result):
        return result if coll.is_device_array(x) else result.get()

    def _allreduce(self, session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto", out=None):
        x = coll.as_array(x)
        dtype = coll.check_allreduce(x, op, algorithm, out)
        fp = fingerprint("allreduce", seq=session.seq, op=op, dtype=dtype_name(x.dtype), shape=x.shape)
        comm, stream = self._agree(session, fp)
        carrier = _carrier(dtype, op)
        cupy = _cupy()
        with cupy.cuda.Device(self.device):
            work = self._device_flat(x, dtype)
            buf = work.view(carrier) if dtype.kind == "c" else work.astype(carrier, copy=False)
            comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _nccl_type(carrier), _nccl_op(op), stream.ptr)
            self._wait(session, comm, stream, describe(fp))
            result = (buf.view(dtype) if dtype.kind == "c" else buf.astype(dtype, copy=False)).reshape(x.shape)
            if op == "mean":
                result /= session.size
            result = self._like_input(x, result)
        if out is None:
            return result
        out[...] = result
        return out

    def _reduce_scatter(self, session: CollectiveSession, x, op: str = "sum"):
        x = coll.as_array(x)
        coll.check_dtype(x.dtype, "reduce_scatter")
        coll.check_op(op, x.dtype, "reduce_scatter")
        dtype = coll.working_dtype(op, x.dtype)
        fp = fingerprint("reduce_scatter", seq=session.seq, op=op, dtype=dtype_name(x.dtype), shape=x.shape)
        comm, stream = self._agree(session, fp)
        carrier = _carrier(dtype, op)
        cupy = _cupy()
        size, bounds = session.size, coll.split_bounds(int(x.size), session.size)
        with cupy.cuda.Device(self.device):
            flat = self._device_flat(x, dtype)
            if dtype.kind == "c":
                flat, unit = flat.view(carrier), 2
            else:
                flat, unit = flat.astype(carrier, copy=False), 1
            seg = (bounds[1] - bounds[0]) * unit  # the longest segment (the first one)
            padded = cupy.zeros(seg * size, dtype=carrier)  # segment i at i*seg, padded to seg
            for i in range(size):
                lo, hi = bounds[i] * unit, bounds[i + 1] * unit
                padded[i * seg:i * seg + hi - lo] = flat[lo:hi]
            recv = cupy.empty(seg, dtype=carrier)
            if seg:
                comm.reduceScatter(padded.data.ptr, recv.data.ptr, seg, _nccl_type(carrier), _nccl_op(op), stream.ptr)
                self._wait(session, comm, stream, describe(fp))
            mine = recv[:(bounds[session.rank + 1] - bounds[session.rank]) * unit]
            mine = (mine.view(dtype) if dtype.kind == "c" else mine.astype(dtype)).copy()
            if op == "mean":
                mine /= size
            return self._like_input(x, mine)

    def _allgather(self, session: CollectiveSession, x):
        x = coll.as_array(x)
        coll.check_dtype(x.dtype, "allgather")
        dtype = coll.working_dtype(None, x.dtype)
        fp = fingerprint("allgather", seq=session.seq, dtype=dtype_name(x.dtype), shape=x.shape)
        comm, stream = self._agree(session, fp)
        cupy = _cupy()
        with cupy.cuda.Device(self.device):
            send = self._device_flat(x, dtype).view(np.uint8)
            recv = cupy.empty(send.size * session.size, dtype=np.uint8)
            if send.size:
                comm.allGather(send.data.ptr, recv.data.ptr, send.size, _nccl().NCCL_UINT8, stream.ptr)
                self._wait(session, comm, stream, describe(fp))
            return self._like_input(x, recv.view(dtype).reshape((session.size, *x.shape)))

    def _broadcast(self, session: CollectiveSession, x, root: int = 0, algorithm: str = "auto"):
        root = coll.check_root(root, session.size)
        coll.check_algorithm(algorithm, coll.BROADCAST_ALGORITHMS, "broadcast")
        is_root = session.rank == root
        if x is None and is_root:
            raise ConfigurationError(f"broadcast: the root (rank {root}) must pass the array to send, not None")
        x = None if x is None else coll.as_array(x)
        if x is not None:
            coll.check_dtype(x.dtype, "broadcast")
        fp = fingerprint("broadcast", seq=session.seq, root=root)
        comm, stream = self._agree(session, fp)
        cupy, nccl = _cupy(), _nccl()
        with cupy.cuda.Device(self.device):
            # The root's dtype and shape first (receivers may pass None), then the bytes.
            header = cupy.zeros(_HEADER_BYTES, dtype=np.uint8)
            if is_root:
                packed = msgpack.packb([dtype_name(x.dtype), [int(d) for d in x.shape]])
                if len(packed) > _HEADER_BYTES:
                    raise ConfigurationError(f"broadcast: the array has too many dimensions ({x.ndim})")
                header[:len(packed)] = cupy.asarray(np.frombuffer(packed, dtype=np.uint8))
            comm.bcast(header.data.ptr, _HEADER_BYTES, nccl.NCCL_UINT8, root, stream.ptr)
            self._wait(session, comm, stream, describe(fp))
            name, shape = _unpack_header(header.get().tobytes())
            dtype, shape = DTYPES[name], tuple(shape)
            if x is not None and not is_root and (dtype_name(x.dtype) != name or tuple(x.shape) != shape):
                raise CollectiveMismatchError(
                    f"broadcast: {session.who(session.rank)} passed {dtype_name(x.dtype)}{tuple(x.shape)}, "
                    f"the root ({session.who(root)}) sends {name}{shape}")
            n = int(np.prod(shape, dtype=np.int64))
            work = self._device_flat(x, dtype) if is_root else cupy.empty(n, dtype=dtype)
            raw = work.view(np.uint8)
            if raw.size:
                comm.bcast(raw.data.ptr, raw.size, nccl.NCCL_UINT8, root, stream.ptr)
                self._wait(session, comm, stream, describe(fp))
            result = work.reshape(shape)
            if x is not None and not coll.is_device_array(x):
                return result.get()
            return result


def _accepts_allreduce(session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto", out=None) -> bool:
    """NCCL reduces the working dtype with ``op`` (else core's algorithm runs the call)."""
    x = coll.as_array(x)
    return _carrier(coll.check_allreduce(x, op, algorithm, out), op) is not None


def _accepts_reduce_scatter(session: CollectiveSession, x, op: str = "sum") -> bool:
    x = coll.as_array(x)
    coll.check_dtype(x.dtype, "reduce_scatter")
    coll.check_op(op, x.dtype, "reduce_scatter")
    return _carrier(coll.working_dtype(op, x.dtype), op) is not None


def _unpack_header(raw: bytes):
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(raw)
    return next(unpacker)

