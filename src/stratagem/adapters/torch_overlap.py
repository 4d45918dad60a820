"""Gradients all-reduced while the backward pass runs, as PyTorch's DDP does, for ``DistributedOptimizer``
under ``mirrored``.

:class:`GradientReducer` lays the parameters out in flat buckets (one dtype and device per bucket,
each closed once it holds ``bucket_bytes``, as DDP's ``bucket_cap_mb``), in reverse parameter order at first: the order in which a backward pass
usually produces the gradients. A post-accumulate-grad hook on every parameter copies its gradient,
times this replica's weight (its share of the global batch), into its bucket; when a bucket is full it
is handed to one background thread that all-reduces it (a sum) through the reducer's own communicator
while the backward pass goes on. Buckets are reduced strictly in bucket order, so every replica makes
the same calls in the same order whatever order its gradients arrive in. ``synchronize()`` (called by
the optimizer's ``step()``) waits for the last buckets and writes the reduced gradients into
``param.grad``. After the first step the buckets are rebuilt in the order the chief's gradients
actually arrived (the chief's order is broadcast, so every replica builds the same buckets), as DDP
does.

- ``overlap=False``: no hooks; the same buckets are packed and all-reduced in ``synchronize()``.
- ``no_sync()``: the hooks stand aside; gradients accumulate locally, and the next backward pass
  outside it reduces the accumulated sum.
- A parameter with no gradient at the step: with ``find_unused_parameters`` its slot counts as zeros
  (every replica must reduce the same buckets), and a parameter that no replica used keeps
  ``grad = None`` (one small all-reduce of a used-flag per parameter tells); without it, an error
  naming the parameter and the option.
- Two backward passes before a step outside ``no_sync()``: the second one's hooks mark the round, and
  ``synchronize()`` reduces the accumulated gradients again from ``param.grad`` (correct, not overlapped).

The background thread is the only user of the reducer's communicator (a name of its own, so its
messages never meet the strategy's collectives, which the main thread may run meanwhile).
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
from typing import Callable

import numpy as np

from stratagem.collectives.communicator import Communicator
from stratagem.core.errors import ConfigurationError
from stratagem.adapters.torch_tensors import as_array

#: Seconds between checks that the reducing thread is still alive while a step waits for it.
POLL_S = 1.0


class _Bucket:
    """Gradients of one dtype and device, fused into one flat buffer (a torch tensor)."""

    def __init__(self, members: list[int], params: list, torch):
        self.members = members
        self.offsets: dict[int, tuple[int, int]] = {}
        offset = 0
        for index in members:
            size = params[index].numel()
            self.offsets[index] = (offset, size)
            offset += size
        first = params[members[0]]
        self.buffer = torch.empty(offset, dtype=first.dtype, device=first.device)
        self.array = as_array(self.buffer)          # what the communicator reduces, in place
        self.pending: set[int] = set(members)
        self.done = threading.Event()

    def view(self, index: int, shape):
        offset, size = self.offsets[index]
        return self.buffer[offset:offset + size].view(shape)

    def reset(self) -> None:
        self.pending = set(self.members)
        self.done = threading.Event()


class GradientReducer:
    """Buckets, hooks and the reducing thread of one ``DistributedOptimizer`` (see the module doc).

    Args:
        named: ``[(name, parameter), ...]`` in the optimizer's order (parameters that do not require a
            gradient are left out).
        strategy: the ``mirrored`` strategy (more than one replica).
        bucket_bytes: a bucket is closed once it holds at least this many bytes (DDP's rule).
        overlap: reduce during the backward pass (hooks), else all at ``synchronize()``.
        find_unused_parameters: a missing gradient counts as zeros instead of being an error.
    """

    def __init__(self, named: list, strategy, *, bucket_bytes: int, overlap: bool, find_unused_parameters: bool):
        import torch

        self._torch = torch
        self._named = [(name, p) for name, p in named if p.requires_grad]
        self._params = [p for _, p in self._named]
        self._strategy = strategy
        self._bucket_bytes = int(bucket_bytes)
        self.overlap = bool(overlap)
        self.find_unused_parameters = bool(find_unused_parameters)
        self._lock = threading.Lock()
        self._buckets: list[_Bucket] = []
        self._where: dict[int, _Bucket] = {}
        self._layout(list(reversed(range(len(self._params)))))
        self._rebuilt = False
        self._syncing_off = False
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._comm: Communicator | None = None
        self._reset_round()
        self._handles = []
        if self.overlap:
            index_of = {id(p): i for i, p in enumerate(self._params)}
            for param in self._params:
                self._handles.append(param.register_post_accumulate_grad_hook(
                    lambda p, i=index_of[id(param)]: self._on_gradient(i, p)))

    # -- layout ---------------------------------------------------------------------------------------
    def _layout(self, order: list[int]) -> None:
        """Buckets along ``order``, one open bucket per dtype and device, each closed once it holds at
        least ``bucket_bytes`` (DDP's rule for ``bucket_cap_mb``: the parameter that reaches the cap
        goes in, so a layer's bias and weight, whose gradients arrive together, share a bucket
        rather than the bias making a bucket of its own, a whole all-reduce for a few bytes)."""
        open_runs: dict[tuple, tuple[list[int], int]] = {}
        runs: list[list[int]] = []
        for index in order:
            param = self._params[index]
            key = (str(param.dtype), str(param.device))
            run, used = open_runs.get(key, (None, 0))
            if run is None:
                run, used = [], 0
                runs.append(run)
            run.append(index)
            used += param.numel() * param.element_size()
            open_runs[key] = (run, used) if used < self._bucket_bytes else (None, 0)
        self._buckets = [_Bucket(run, self._params, self._torch) for run in runs]
        self._where = {index: bucket for bucket in self._buckets for index in bucket.members}

    @property
    def bucket_members(self) -> list[list[str]]:
        """The parameters' names, bucket by bucket, in the order the buckets are reduced."""
        return [[self._named[i][0] for i in bucket.members] for bucket in self._buckets]

    # -- a round: the backward passes between two steps --------------------------------------------
    def _reset_round(self) -> None:
        self._seen = [0] * len(self._params)
        self._arrival: list[int] = []
        self._next_launch = 0
        self._repeated = False
        self._weight: float | None = None
        for bucket in self._buckets:
            bucket.reset()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally (see the module doc)."""
        if self._syncing_off:
            raise ConfigurationError("no_sync() blocks do not nest")
        self._syncing_off = True
        try:
            yield
        finally:
            self._syncing_off = False

    @property
    def in_no_sync(self) -> bool:
        return self._syncing_off

    def _on_gradient(self, index: int, param) -> None:
        """A parameter's gradient is complete in this backward pass (autograd's hook)."""
        if self._syncing_off or self._error is not None:
            return
        with self._lock:
            self._seen[index] += 1
            if self._seen[index] > 1:
                self._repeated = True       # a second backward pass: synchronize() reduces param.grad again
                return
            self._arrival.append(index)
            if self._repeated:
                return
            if self._weight is None:
                self._weight = float(self._strategy.gradient_weight)
            bucket = self._where[index]
            self._pack(bucket, index, param.grad, self._weight)
            bucket.pending.discard(index)
            self._launch_ready()

    def _pack(self, bucket: _Bucket, index: int, grad, weight: float) -> None:
        view = bucket.view(index, self._params[index].shape)
        if grad is None or weight == 0:     # an empty shard's mean gradient may be NaN: it adds nothing
            view.zero_()
        elif grad.is_sparse:
            raise ConfigurationError(f"parameter {self._named[index][0]!r} has a sparse gradient; "
                                     f"stratagem.torch reduces dense gradients only (use a dense embedding)")
        else:
            self._torch.mul(grad.detach(), weight, out=view)

    def _launch_ready(self) -> None:
        """Hand the full buckets to the reducing thread, in bucket order (the same on every replica)."""
        while self._next_launch < len(self._buckets) and not self._buckets[self._next_launch].pending:
            bucket = self._buckets[self._next_launch]
            if bucket.buffer.is_cuda:       # the packing kernels finish before another thread reads it
                self._torch.cuda.current_stream(bucket.buffer.device).synchronize()
            self._submit(lambda b=bucket: self._comm_allreduce(b.array), bucket.done)
            self._next_launch += 1

    # -- the reducing thread ---------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], None], done: threading.Event) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stratagem-torch-reduce", daemon=True)
            self._thread.start()
        self._queue.put((fn, done))

    def _run(self) -> None:
        while True:
            fn, done = self._queue.get()
            try:
                if self._error is None:
                    fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread at the step
                self._error = exc
            finally:
                done.set()

    def _communicator(self) -> Communicator:
        if self._comm is None:
            names = "|".join(name for name, _ in self._named)
            tag = hashlib.sha1(names.encode()).hexdigest()[:12]
            strategy = self._strategy
            self._comm = Communicator(strategy.transport, strategy.cluster.replicas(), name=f"torch.grads.{tag}",
                                      **strategy.communicator_options())
        return self._comm

    def _comm_allreduce(self, array) -> None:
        if array.size:
            self._communicator().allreduce(array, op="sum", out=array)

    def _wait(self, event: threading.Event) -> None:
        while not event.wait(POLL_S):
            if self._thread is None or not self._thread.is_alive():
                raise RuntimeError("stratagem.torch's gradient-reducing thread is gone")
        if self._error is not None:
            raise self._error

    def _run_here(self, fn: Callable[[], object]):
        """Run ``fn`` on the reducing thread, after everything queued before it; return its result."""
        result: list = []
        done = threading.Event()
        self._submit(lambda: result.append(fn()), done)
        self._wait(done)
        return result[0]

    # -- the step ------------------------------------------------------------------------------------
    def has_gradients(self) -> bool:
        return any(self._seen) or any(p.grad is not None for p in self._params)

    def synchronize(self) -> list:
        """Wait for (or run) every bucket's all-reduce, write the results into ``param.grad`` and start
        a new round; return the parameters that now have a gradient."""
        if self._error is not None:
            raise self._error
        with self._lock:
            again = self._repeated or not self.overlap or not any(self._seen)
            weight = self._weight
        if again:
            for bucket in self._buckets[:self._next_launch]:
                self._wait(bucket.done)     # in flight from an earlier backward pass: let it finish first
            weight = float(self._strategy.gradient_weight)
            for bucket in self._buckets:
                bucket.reset()
                bucket.pending = {i for i in bucket.members if self._params[i].grad is None}
                for index in bucket.members:
                    if index not in bucket.pending:
                        self._pack(bucket, index, self._params[index].grad, weight)
            self._next_launch = 0
        missing = [i for bucket in self._buckets for i in sorted(bucket.pending)]
        if missing and not self.find_unused_parameters:
            names = ", ".join(repr(self._named[i][0]) for i in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            self._reset_round()
            raise ConfigurationError(
                f"parameter(s) {names}{more} got no gradient in this step's backward pass, so the replicas "
                f"cannot reduce them: pass find_unused_parameters=True to DistributedOptimizer (a missing "
                f"gradient then counts as zeros, DDP's option), or leave the parameter out of the optimizer "
                f"(or set requires_grad=False)")
        for bucket in self._buckets:
            for index in sorted(bucket.pending):
                self._pack(bucket, index, None, 0.0)
            bucket.pending.clear()
        with self._lock:
            self._launch_ready()
        used = None
        if self.find_unused_parameters:
            for bucket in self._buckets:
                self._wait(bucket.done)
            flags = np.array([1.0 if (self._seen[i] or p.grad is not None) else 0.0
                              for i, p in enumerate(self._params)], np.float32)
            used = self._run_here(lambda: self._communicator().allreduce(flags, op="sum"))
        written = [False] * len(self._params)
        with self._torch.no_grad():
            for bucket in self._buckets:
                self._wait(bucket.done)     # a bucket is copied out while the next ones are still reduced
                for index in bucket.members:
                    if used is not None and used[index] == 0:
                        continue            # no replica used it: it keeps no gradient, as in DDP
                    param = self._params[index]
                    reduced = bucket.view(index, param.shape)
                    if param.grad is None:
                        param.grad = reduced.clone()
                    else:
                        param.grad.copy_(reduced)
                    written[index] = True
        with_grad = [param for index, param in enumerate(self._params) if written[index]]
        arrival, clean = list(self._arrival), not again
        self._reset_round()
        if clean and not self._rebuilt:
            self._rebuild(arrival)
        return with_grad

    def _rebuild(self, arrival: list[int]) -> None:
        """Buckets in the order the chief's gradients arrived in its first step (DDP's rebuild)."""
        comm_rank = self._strategy.cluster.replicas().index(self._strategy.task)
        order = np.array(arrival + [i for i in reversed(range(len(self._params))) if i not in set(arrival)],
                         np.int64)
        chosen = self._run_here(lambda: self._communicator().broadcast(order if comm_rank == 0 else None, root=0))
        self._layout([int(i) for i in chosen])
        self._rebuilt = True
        self._reset_round()

    def close(self) -> None:
        """Remove the hooks (the reducing thread ends with the process)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
