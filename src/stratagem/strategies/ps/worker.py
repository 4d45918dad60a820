"""A worker of the ``parameter_server`` strategy: runs the closures the coordinator sends.

The worker serves from inside ``stratagem.strategy("parameter_server", ...)``: it tells the coordinator
it is there, then waits for closures (tag ``ps.closure``), runs each and sends back its result (tag
``ps.result``) until the coordinator says it is done. The variables a closure uses are this worker's
remote copies of the coordinator's (built from the shards' catalog, by name); the optimizer is rebuilt
from its config; a per-worker iterator is this worker's own iterator over ``dataset_fn(context)``.

It fails (the process exits non-zero) when a shard is lost (:class:`ShardLostError` naming it), when the
coordinator disappears, or when it says the job failed (``op: abort``: :class:`JobFailedError` naming the
task that failed); an exception in a closure is sent back to the coordinator instead.
"""

from __future__ import annotations

import json
import logging
import traceback
from dataclasses import dataclass

from stratagem.core import job_state
from stratagem.strategies.remote_calls import functions as remote_code
from stratagem.strategies.remote_calls import values
from stratagem.core.cluster import TaskId
from stratagem.core.failures import culprit_of
from stratagem.core.errors import (FunctionNotFound, JobFailedError, PeerLostError, ProtocolError, StratagemError,
                                   TransportTimeout)
from stratagem.strategies.ps.coordinator import CLOSURE_TAG, POLL, RESULT_TAG
from stratagem.ps_service.protocol import ShardLostError
from stratagem.core.transport import Message
from stratagem.training.variables import Variable

log = logging.getLogger(__name__)

#: Tag of the message a worker sends the coordinator when it starts.
HELLO_TAG = "ps.worker"
#: Said when a function named by the coordinator is not in this worker's ``__main__``.
_MISSING_IN_MAIN = (": define it in the script before the call to stratagem.strategy(...) (workers serve inside "
                    "that call, so what comes after it does not exist there), or in a module of your own code, or "
                    + remote_code.SECRET_HINT + " so that functions may be sent with cloudpickle")


@dataclass(frozen=True)
class WorkerContext:
    """What ``dataset_fn(context)`` learns about the worker it runs on.

    >>> WorkerContext(1, 3, "worker:2").input_pipeline_id
    1
    """

    worker_index: int
    num_workers: int
    task: str

    @property
    def input_pipeline_id(self) -> int:      # TF's InputContext names
        return self.worker_index

    @property
    def num_input_pipelines(self) -> int:
        return self.num_workers


class Worker:
    """The serving loop of one worker task (see the module doc).

    Args:
        strategy: the worker's strategy (its transport; what a ``__strategy__`` reference names).
        workers: the tasks that run closures, in order (this one among them).
        client: the strategy's :class:`~stratagem.ps_service.client.PSClient` (asked for lost shards).
        variables: the :class:`~stratagem.strategies.ps.adopt.Adoption` of the coordinator's variables.
        timeout: seconds a send to the coordinator may take.
        watch: a :class:`~stratagem.strategies.ps.stall.StallWatch`, asked between closures (None: none).
    """

    def __init__(self, strategy, workers: list, *, client, variables, timeout: float, watch=None):
        self.strategy = strategy
        self.client, self.variables, self.timeout = client, variables, timeout
        self.watch = watch
        self.transport = strategy.transport
        self.coordinator: TaskId = strategy.cluster.chief
        self.context = WorkerContext(workers.index(self.transport.task), len(workers), self.transport.task.short)
        self.iterators: dict[int, object] = {}
        self.optimizers: dict[str, object] = {}
        self.ran = 0

    def serve(self) -> int:
        """Run closures until the coordinator is done; return how many ran."""
        # A restarted worker whose coordinator ended meanwhile learns that the job finished (not a timeout).
        job_state.wait_for_peer(
            lambda seconds: self.transport.send(self.coordinator, HELLO_TAG, Message({"ready": True}), timeout=seconds),
            self.timeout, task=self.transport.task, what=f"the coordinator {self.coordinator}")
        while True:
            if self.watch is not None:
                self.watch.check()     # stopped longer than the peers wait: come back as a new process
            try:
                message = self.transport.recv(self.coordinator, CLOSURE_TAG, timeout=POLL)
            except TransportTimeout:
                self.client.check_shards()
                continue
            except PeerLostError as exc:
                job_state.leave_if_finished(self.transport.task, str(exc))
                if self.watch is not None:
                    self.watch.check(losing=True)   # the coordinator dropped this worker after a stall
                raise StratagemError(
                    f"{self.transport.task}: the coordinator {self.coordinator} is gone ({exc}); restart the job"
                ) from None
            if message.meta.get("op") == "shutdown":
                return self.ran
            if message.meta.get("op") == "abort":
                raise self._aborted(message.meta)
            reply, lost = self.run(message)
            self.transport.send(self.coordinator, RESULT_TAG, reply, timeout=self.timeout)
            self.ran += 1
            if lost is not None:
                raise lost

    def _aborted(self, meta: dict) -> JobFailedError:
        """The coordinator left because the job failed: the error naming the task that failed."""
        me, coordinator = self.transport.task, self.coordinator
        error, culprit = str(meta.get("error") or "an error"), meta.get("culprit")
        try:
            culprit = TaskId.parse(str(culprit)) if culprit else None
        except Exception:  # noqa: BLE001 - a notice without a task: its text says what is known
            culprit = None
        if culprit is None:
            text = f"{me}: the job failed ({error}); the coordinator {coordinator} stopped on it"
        elif culprit == coordinator:
            text = f"{me}: the job failed because the coordinator {coordinator} failed: {error}"
        else:
            text = (f"{me}: the job failed because {culprit} failed (the coordinator {coordinator} "
                    f"stopped on it: {error})")
        return JobFailedError(culprit, text)

    def run(self, message: Message) -> tuple[Message, BaseException | None]:
        """Run one closure; return the reply and, if a shard was lost, the error to stop with."""
        meta = message.meta
        reply = {"id": meta.get("id")}
        try:
            buffers = list(message.buffers)
            blobs = meta.get("blobs", 0)
            if type(blobs) is not int or not 0 <= blobs <= len(buffers):
                raise ProtocolError(f"a closure says {blobs!r} of its {len(buffers)} buffers are functions")
            blobs, arrays = buffers[:blobs], buffers[blobs:]
            self.variables.adopt(int(meta.get("variables") or 0))
            for dataset_id, ref in (meta.get("datasets") or {}).items():
                if int(dataset_id) not in self.iterators:
                    dataset_fn = self._function(ref, blobs)
                    self.iterators[int(dataset_id)] = iter(dataset_fn(self.context))
            fn = self._function(meta["fn"], blobs)
            args, kwargs = values.decode_call(meta["values"], arrays, resolve=self._resolve)
            self.variables.remote.mark_stale()   # a step reads the variables as they are now
            with self.strategy.recorder.span("step", "step", {"closure": meta.get("id")}):
                result = fn(*args, **kwargs)
            skeleton, out = values.encode(result, reference=self._reference,
                                          what="the step's result")
            return Message({**reply, "ok": True, "value": skeleton}, out), None
        except ShardLostError as exc:
            reply.update(error=str(exc), error_type=type(exc).__name__, lost_task=str(exc.task))
            return Message(reply), exc
        except PeerLostError as exc:
            if exc.task is not None and TaskId.parse(str(exc.task)).job == "ps":
                reply.update(error=str(exc), error_type=type(exc).__name__, lost_task=str(exc.task))
                return Message(reply), exc
            reply.update(error=str(exc), error_type=type(exc).__name__)
            return Message(reply), None
        except FunctionNotFound as exc:
            reply.update(error=str(exc), error_type=type(exc).__name__, not_found=True)
            return Message(reply), None
        except StopIteration:
            reply.update(error=f"the per-worker dataset is exhausted on {self.transport.task}",
                         error_type="StopIteration")
            return Message(reply), None
        except Exception as exc:  # noqa: BLE001 - the step's own error goes back to the coordinator
            last = traceback.format_exc(limit=-3)
            log.debug("closure failed on %s:\n%s", self.transport.task, last)
            reply.update(error=f"{exc}", error_type=type(exc).__name__, traceback=last[-4000:])
            culprit = culprit_of(exc)      # a shard's refusal names the task that failed the job
            if culprit is not None:
                reply["culprit"] = culprit
            return Message(reply), None

    def _function(self, ref, blobs: list):
        """The function the coordinator sent (the rules: :mod:`stratagem.strategies.remote_calls.functions`)."""
        where = str(self.transport.task)
        if not isinstance(ref, dict):
            raise ProtocolError(f"a closure's function is described by a {type(ref).__name__}")
        if ref.get("kind") == "pickle":
            index = ref.get("blob")
            if type(index) is not int or not 0 <= index < len(blobs):
                raise ProtocolError(f"a closure's function is in buffer {index!r} of its {len(blobs)}")
            return remote_code.loads_function(blobs[index], authenticated=self.transport.secret is not None,
                                              where=where, persistent_load=self._persistent_load)
        return remote_code.find_function(ref, where=where, missing_hint=_MISSING_IN_MAIN
                                         if ref.get("module") == "__main__" else "")

    def _persistent_load(self, pid):
        return self._resolve(json.loads(pid))

    def _reference(self, obj):
        """How a step's result names one of the strategy's variables (sent by name, not by value)."""
        if isinstance(obj, Variable) and obj.strategy is self.strategy:
            return {"__var__": obj.name}
        return None

    def _resolve(self, ref: dict):
        if not isinstance(ref, dict) or len(ref) != 1:
            raise StratagemError(f"unknown reference {ref!r}")
        if "__var__" in ref:
            return self.variables.variable(ref["__var__"])
        if "__opt__" in ref:
            config = ref["__opt__"]
            if config not in self.optimizers:
                self.optimizers[config] = self.variables.optimizer(json.loads(config))
            return self.optimizers[config]
        if "__iter__" in ref:
            iterator = self.iterators.get(int(ref["__iter__"]))
            if iterator is None:
                raise StratagemError(f"no per-worker dataset {ref['__iter__']} on {self.transport.task}")
            return iterator
        if "__strategy__" in ref:
            return self.strategy
        raise StratagemError(f"unknown reference {ref!r}")
