"""Checkpoints of a strategy's variables and optimizer state: ``save`` and ``restore``
(README: "Training with a strategy").

:class:`Checkpointing` is a mixin of :class:`~stratagem.strategies.base.Strategy`: the chief writes
and reads the files (:mod:`stratagem.training.checkpoint`), and the other replicas get the outcome and
the values from it (``_share_from_chief``, ``_share_arrays_from_chief``), so every replica ends
identical even without a shared filesystem. The parameter-server strategies override both (the
values live on the ps tasks: :mod:`stratagem.strategies.ps.checkpoint`).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from stratagem.core.errors import ConfigurationError, StratagemError
from stratagem.training.replica_sync import dtype_key, flatten_state, rebuild_state

#: Keep at most this many checkpoints in a directory unless ``save(max_to_keep=...)`` says otherwise.
DEFAULT_MAX_TO_KEEP = 5


class Checkpointing:
    """``save``/``restore`` for a strategy (mixed into ``Strategy``; uses its variables, optimizers,
    step and chief-to-replica sharing)."""

    def save(self, path, *, max_to_keep: int = DEFAULT_MAX_TO_KEEP) -> str:
        """Write a checkpoint of the variables, the optimizer's state and the step into directory ``path``.

        Every replica calls it, at the same point of the program: the chief writes
        ``path/ckpt-<step>.npz`` and then the ``latest`` pointer, each atomically (a crash never leaves
        a corrupt checkpoint), keeping the newest ``max_to_keep``; the others wait for it. Returns the
        checkpoint file's path on every replica. If the chief cannot write it, every replica raises.
        The step is the number of updates applied through the strategy (restored by ``restore``).

        >>> import tempfile
        >>> from stratagem.core.cluster import ClusterSpec
        >>> from stratagem.training.variables import Variable
        >>> from stratagem.transports.local import LocalFabric
        >>> directory = tempfile.mkdtemp()
        >>> from stratagem.strategies.base import Strategy
        >>> with Strategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
        ...               transport_options={"fabric": LocalFabric()}) as strategy:
        ...     with strategy.scope():
        ...         w = Variable(np.arange(3.0), name="w")
        ...     path = strategy.save(directory)
        ...     _ = w.assign(np.zeros(3))
        ...     step = strategy.restore(directory)
        ...     w.numpy(), step, path.endswith("ckpt-00000000.npz")
        (array([0., 1., 2.]), 0, True)
        """
        self._check_open()
        self._replica_rank("save()")
        self._check_one_optimizer()
        status, failure = None, None
        if self.is_chief:
            status, failure = self._write_checkpoint(path, self._optimizer_state(), max_to_keep)
        status = self._share_from_chief(status)
        if "error" in status:
            if failure is not None:
                raise failure
            raise StratagemError(f"the chief ({self.cluster.chief}) could not save a checkpoint in {path}: "
                                 f"{status['error']}")
        return status["path"]

    def _check_one_optimizer(self) -> None:
        if len(self._optimizers) > 1:
            names = ", ".join(repr(_optimizer_name(o)) for o in self._optimizers)
            raise ConfigurationError(
                f"save()/restore() keep one optimizer's state, but strategy {self.name!r} has "
                f"{len(self._optimizers)} optimizers ({names}); use a single optimizer per strategy"
            )

    def _optimizer_state(self) -> dict | None:
        """The state ``save`` stores: the one optimizer's ``state_dict()`` (or state restored for it)."""
        self._check_one_optimizer()
        if self._optimizers:
            return self._optimizers[0].state_dict()
        return self._pending_optimizer_state

    def _write_checkpoint(self, path, state, max_to_keep) -> tuple[dict, Exception | None]:
        """On the chief: write the checkpoint; return ``({"path": ...}, None)`` or ``({"error": ...}, exc)``."""
        from stratagem.training import checkpoint

        try:
            values = {name: var.numpy() for name, var in self._variables.items()}
            extra = {"strategy": self.name, "replicas": self.num_replicas_in_sync}
            written = checkpoint.save(path, values, state, self._step, extra=extra, max_to_keep=max_to_keep)
        except Exception as exc:  # noqa: BLE001 - told to every replica, then re-raised here
            return {"error": f"{type(exc).__name__}: {exc}"}, exc
        return {"path": str(written)}, None

    def restore(self, path) -> int:
        """Load the checkpoint ``path`` (a file, or a directory: its latest) into the variables and the
        optimizer; return its step.

        Every replica calls it; only the chief reads the file, then it sends the values and the
        optimizer state to the others, so every replica ends identical even without a shared
        filesystem. Call it after creating the variables (and the optimizer) in ``scope()``; the
        checkpoint must hold exactly those variables, with the same shapes and dtypes. An optimizer
        the strategy has not seen yet gets its state at its first ``apply_gradients``. See ``save``.
        """
        self._check_open()
        self._replica_rank("restore()")
        arrays, failure, plan = [], None, None
        if self.is_chief:
            try:
                plan, arrays = self._read_checkpoint(path)
            except Exception as exc:  # noqa: BLE001 - told to every replica, then re-raised here
                plan, failure = {"error": f"{type(exc).__name__}: {exc}"}, exc
        plan = self._share_from_chief(plan)
        if "error" in plan:
            if failure is not None:
                raise failure
            raise StratagemError(f"the chief ({self.cluster.chief}) could not restore {path}: {plan['error']}")
        arrays = self._share_arrays_from_chief([tuple(spec) for spec in plan["arrays"]], arrays)
        names = plan["variables"]
        missing = [name for name in names if name not in self._variables]
        if missing:
            raise ConfigurationError(
                f"cannot restore {path} on {self.task}: the chief restored variable(s) "
                f"{', '.join(map(repr, missing))} that this replica did not create; create the same "
                f"variables on every replica"
            )
        for name, value in zip(names, arrays):
            self._variables[name].assign(value)
        if plan["optimizer"] is not None:
            self._load_optimizer_state(rebuild_state(plan["optimizer"], arrays[len(names):]))
        self._step = int(plan["step"])
        return self._step

    def _read_checkpoint(self, path) -> tuple[dict, list]:
        """On the chief: load and check the checkpoint; return the plan every replica follows and its arrays."""
        from stratagem.training import checkpoint

        loaded = checkpoint.load(path)
        check_restorable(self._variables, loaded.variables, path)
        names = list(self._variables)
        arrays = [np.asarray(loaded.variables[name]) for name in names]
        skeleton = None
        if loaded.optimizer_state is not None:
            skeleton, optimizer_arrays = flatten_state(loaded.optimizer_state)
            arrays += optimizer_arrays
        plan = {"step": int(loaded.step), "variables": names, "optimizer": skeleton,
                "arrays": [[list(a.shape), dtype_key(a.dtype)] for a in arrays]}
        return plan, arrays

    def _load_optimizer_state(self, state: dict) -> None:
        self._check_one_optimizer()
        if self._optimizers:
            self._optimizers[0].load_state_dict(state)
        else:
            self._pending_optimizer_state = state


def check_restorable(variables: Mapping[str, Any], saved: Mapping[str, Any], path) -> None:
    """Raise ``ConfigurationError`` unless the checkpoint holds exactly ``variables``, alike in shape and dtype."""
    problems = []
    missing = [name for name in variables if name not in saved]
    if missing:
        problems.append(f"it lacks variable(s) {', '.join(map(repr, missing))}")
    unknown = [name for name in saved if name not in variables]
    if unknown:
        problems.append(f"it holds variable(s) this program did not create: {', '.join(map(repr, unknown))}")
    for name, var in variables.items():
        if name not in saved:
            continue
        value = saved[name]
        if tuple(value.shape) != tuple(var.shape):
            problems.append(f"variable {name!r} has shape {tuple(value.shape)} there, {tuple(var.shape)} here")
        elif np.dtype(value.dtype) != np.dtype(var.dtype):
            problems.append(f"variable {name!r} has dtype {np.dtype(value.dtype)} there, {np.dtype(var.dtype)} here")
    if problems:
        raise ConfigurationError(
            f"cannot restore {path}: {'; '.join(problems)}. Create the same variables (names, shapes, "
            f"dtypes) in scope() as the program that saved it, before calling restore()"
        )


def _optimizer_name(optimizer) -> str:
    try:
        return str(optimizer.get_config().get("name", type(optimizer).__name__))
    except Exception:  # noqa: BLE001 - only for an error message
        return type(optimizer).__name__
