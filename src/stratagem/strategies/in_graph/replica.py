"""The ``in_graph`` replica: a worker task serving the client's steps until the client shuts it down.

A worker task never runs the user's training loop: its ``stratagem.strategy("in_graph", ...)`` call
serves here. The client's messages (tag ``in_graph/request``), in order:

- ``hello``: the client's script (sha256) and protocol; the replica answers ``ready``.
- ``step``: the values of the variables that changed since this replica last saw them (by version),
  the step function (by name, or serialized: :mod:`.functions`), and this replica's shard of
  the arguments. The replica loads the values, runs the step with the gradient capture on, and
  answers ``done`` with every ``apply_gradients`` call's gradients (by variable name, in call order)
  and the step's result, or ``error`` with the exception's type, message and traceback.
- ``shutdown``: the replica answers ``bye`` and stops serving.
- ``abort``: the client leaves because the job failed (``culprit``: the task that failed, ``error``:
  why); the replica stops serving with :class:`~stratagem.core.errors.JobFailedError` naming it.

Answers go under ``in_graph/reply``. A client that disappears (``PeerLostError``) ends the serving.
Values are held once per variable (:class:`HeldValue`), shared by every copy of a variable on the
replica: the script's own (created when the replica imports the script) and those standing in for the
client's in serialized functions. They are updated in place, so views of them (``torch.from_numpy``)
stay valid.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

import numpy as np

from stratagem.strategies.remote_calls import values
from stratagem.core.cluster import TaskId
from stratagem.core.errors import (ConfigurationError, JobFailedError, PeerLostError, TransportClosed,
                                   TransportTimeout)
from stratagem.training.optimizers.rules import from_config
from stratagem.core.transport import Message
from stratagem.training.variables import Variable, VariableStore, is_device_array, strategy_scope
from stratagem.strategies.in_graph.devices import CURRENT_STEP
from stratagem.strategies.in_graph.functions import FunctionResolver

log = logging.getLogger(__name__)

REQUEST, REPLY = "in_graph/request", "in_graph/reply"
#: Version of the client/replica protocol; the client checks the replicas speak it.
PROTOCOL = 1
#: Seconds one wait for the client's next message lasts before checking the idle limit again.
_POLL = 30.0


class StepContext:
    """One replica's step in progress: its device (``None`` on a remote replica) and what it applied."""

    def __init__(self, device=None):
        self.device = device
        #: ``[(optimizer, [(variable name, gradient copy, variable), ...]), ...]`` in call order.
        self.calls: list[tuple[Any, list]] = []

    def record(self, optimizer, pairs) -> None:
        entries = []
        for grad, var in pairs:
            copy = grad.copy() if is_device_array(grad) else np.array(grad, copy=True)
            if np.dtype(copy.dtype).kind in "biu":          # accepted by the optimizers; averaged as floats
                copy = copy.astype(var.dtype)
            entries.append((var.name, copy, var))
        self.calls.append((optimizer, entries))


def run_step(fn, args, kwargs, context: StepContext):
    """``fn(*args, **kwargs)`` with ``apply_gradients`` recording into ``context``."""
    token = CURRENT_STEP.set(context)
    try:
        return fn(*args, **kwargs)
    finally:
        CURRENT_STEP.reset(token)


class HeldValue(VariableStore):
    """A replica's value of one of the client's variables, shared by every copy of it here."""

    live = True

    def __init__(self, name: str, array: np.ndarray):
        self.name = name
        self.array = np.array(array, copy=True)

    def read(self):
        return self.array

    def write(self, array) -> None:
        if CURRENT_STEP.get() is not None:
            raise ConfigurationError(
                f"variable {self.name!r} was assigned inside a step; under in_graph a step only computes "
                f"gradients (the client applies them after every replica is done): update variables with "
                f"optimizer.apply_gradients, or assign them outside strategy.run() on the client"
            )
        # Outside steps (the replica importing the script): the client's values are the ones that count.

    def load(self, array) -> None:
        if tuple(array.shape) != self.array.shape or array.dtype != self.array.dtype:
            raise ConfigurationError(
                f"the client sent variable {self.name!r} as {array.dtype}{list(array.shape)}, but this "
                f"replica holds it as {self.array.dtype}{list(self.array.shape)}"
            )
        np.copyto(self.array, array)


class _PickledScope:
    """The owner of the replica's stand-ins for the client's variables and optimizers that arrive in
    serialized step functions (a strategy as far as ``Variable`` and ``Optimizer`` are concerned)."""

    def __init__(self, server: "ReplicaServer"):
        self._server = server

    def on_variable(self, variable) -> None:
        pass

    def on_optimizer(self, optimizer) -> None:
        pass      # a stand-in for the client's optimizer, whose state the client keeps

    def on_apply_gradients(self, optimizer, pairs):
        return self._server.strategy.on_apply_gradients(optimizer, pairs)

    @property
    def recorder(self):
        """The replica's timeline recorder (its strategy's: see ``Strategy.recorder``)."""
        return self._server.strategy.recorder


class ReplicaServer:
    """Serves one worker task's strategy (see the module doc)."""

    def __init__(self, strategy, serving_context):
        self.strategy = strategy
        self.transport = strategy.transport
        self.client = strategy.cluster.chief
        self.resolver = FunctionResolver(strategy, serving_context, self)
        self._held: dict[str, HeldValue] = {}
        self.scope_context = _PickledScope(self)
        self._stand_in_vars: dict[str, Variable] = {}
        self._stand_in_opts: dict[int, Any] = {}

    # -- what step functions see -------------------------------------------------------------------
    def held(self, name: str) -> HeldValue:
        held = self._held.get(name)
        if held is None:
            raise ConfigurationError(f"the client has no variable {name!r} (or has not sent it to this replica)")
        return held

    def adopt(self, variable) -> None:
        """A variable the replica's copy of the script created: make it show the client's value."""
        held = self._held.get(variable.name)
        if held is None:
            raise ConfigurationError(
                f"the replica's copy of your script created variable {variable.name!r} "
                f"({variable.dtype}{list(variable.shape)}) that the client does not have: create the same "
                f"variables on every task (not under `if strategy.is_chief:` or the main guard)"
            )
        if tuple(variable.shape) != held.array.shape or variable.dtype != held.array.dtype:
            raise ConfigurationError(
                f"variable {variable.name!r} is {variable.dtype}{list(variable.shape)} in the replica's copy "
                f"of your script but {held.array.dtype}{list(held.array.shape)} on the client"
            )
        variable.store = held

    def pickled_variable(self, name: str):
        variable = self._stand_in_vars.get(name)
        if variable is None:
            held = self.held(name)
            with strategy_scope(self.scope_context):
                variable = Variable(held.array, name=name)
            variable.store = held
            self._stand_in_vars[name] = variable
        return variable

    def pickled_optimizer(self, key, config):
        optimizer = self._stand_in_opts.get(key)
        if optimizer is None:
            with strategy_scope(self.scope_context):
                optimizer = self._stand_in_opts[key] = from_config(config)
        return optimizer

    # -- serving -------------------------------------------------------------------------------------
    def serve(self, first_timeout: float | None, idle_timeout: float | None) -> None:
        """Answer the client until it says ``shutdown``. Raises ``PeerLostError`` if the client is lost,
        ``JobFailedError`` if it left because the job failed, ``TransportTimeout`` if it stays silent
        beyond the limits (``None``: no limit)."""
        heard_from_client = False
        since = time.monotonic()
        while True:
            limit = idle_timeout if heard_from_client else first_timeout
            wait = _POLL if limit is None else max(0.001, min(_POLL, since + limit - time.monotonic()))
            try:
                message = self.transport.recv(self.client, REQUEST, timeout=wait)
            except TransportTimeout:
                if limit is not None and time.monotonic() - since >= limit:
                    raise TransportTimeout(
                        f"{self.strategy.task}: no request from the in_graph client {self.client} for "
                        f"{limit:g} s; stopping serving"
                    ) from None
                continue
            except TransportClosed:
                return
            heard_from_client, since = True, time.monotonic()
            op = message.meta.get("op")
            if op == "shutdown":
                self._answer({"op": "bye"})
                return
            if op == "abort":
                raise self._aborted(message.meta)
            if op == "hello":
                self._hello(message.meta)
            elif op == "step":
                self._answer(*self._step(message))
            else:
                log.warning("%s: ignored a request %r from the client", self.strategy.task, op)
                self._answer({"op": "error", "step": message.meta.get("step"), "where": "setup",
                              "type": "ConfigurationError", "message": f"unknown request {op!r}", "traceback": ""})

    def _aborted(self, meta: dict) -> JobFailedError:
        """The client left because the job failed: the error naming the task that failed."""
        error, culprit = str(meta.get("error") or "an error"), meta.get("culprit")
        try:
            culprit = TaskId.parse(str(culprit))
        except Exception:  # noqa: BLE001 - a notice without a task: the client is all we know
            culprit = self.client
        if culprit == self.client:
            return JobFailedError(culprit, f"the job failed because the in_graph client {culprit} failed: {error}")
        return JobFailedError(culprit, f"the job failed because {culprit} failed (the in_graph client "
                                       f"{self.client} stopped on it: {error})")

    def _answer(self, meta: dict, buffers: list | None = None) -> None:
        try:
            self.transport.send(self.client, REPLY, Message(meta, buffers or []))
        except PeerLostError:
            if meta.get("op") != "bye":
                raise

    def _hello(self, meta: dict) -> None:
        self.resolver.client_script_sha = meta.get("script")
        self.resolver.reset()
        self._answer({"op": "ready", "protocol": PROTOCOL, "script": self.resolver.script_sha, "pid": os.getpid(),
                      "authenticated": self.transport.secret is not None})

    def _step(self, message: Message) -> tuple[dict, list]:
        meta, buffers = message.meta, list(message.buffers)
        step = meta.get("step")
        where = "setup"
        try:
            changed = meta["values"]
            loaded = buffers[:len(changed)]
            rest = buffers[len(changed):]
            for (name, _version), array in zip(changed, loaded):
                held = self._held.get(name)
                if held is None:
                    self._held[name] = HeldValue(name, array)
                else:
                    held.load(array)
            data = rest.pop(0) if meta.get("fn_bytes") else None
            fn = self.resolver.resolve(meta["fn"], data)
            args, kwargs = values.decode_call(meta["args"], rest)
            where = "step"
            context = StepContext()
            result = run_step(fn, args, kwargs, context)
            where = "reply"
            names, grads = [], []
            for _, entries in context.calls:
                names.append([name for name, _, _ in entries])
                grads.extend(grad for _, grad, _ in entries)
            skeleton, arrays = values.encode(result, what="the step's result")
            return {"op": "done", "step": step, "calls": names, "result": skeleton}, grads + arrays
        except Exception as exc:  # noqa: BLE001 - told to the client, which raises it naming this replica
            return {"op": "error", "step": step, "where": where, "type": type(exc).__name__,
                    "message": str(exc), "traceback": traceback.format_exc()}, []
