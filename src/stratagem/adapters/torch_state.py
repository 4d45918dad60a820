"""A torch optimizer's state in stratagem's checkpoints, and checkpoints back as a torch ``state_dict``.

Checkpoints go through the strategy (``strategy.save(dir)`` / ``strategy.restore(dir)``), as for any
stratagem model: every replica calls them, the chief writes one ``.npz`` (no pickle) and, on restore,
sends the values and the optimizer state to the others (no shared filesystem needed). The variables
are the module's parameters under their ``state_dict`` names, so :func:`module_state_dict` turns a
checkpoint into a ``state_dict`` that a plain torch module loads.

Under ``mirrored`` the update runs in the torch optimizer, so its state is what must be kept:
:class:`TorchOptimizerState` is what the strategy sees as its optimizer — ``state_dict()`` in
stratagem's format (``{"iterations": step, "slots": {parameter name: {state key: array}}}``, the
torch state's tensors under their own keys) and ``load_state_dict`` back into the torch optimizer.
On parameter servers the ps tasks run :mod:`stratagem.training.optimizers.torch_rules` rules whose slots carry
the same keys, so a checkpoint written under either strategy restores under the other.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from stratagem.core.errors import ConfigurationError


class TorchOptimizerState:
    """The torch optimizer's state as the strategy's checkpoints keep it (see the module doc).

    Args:
        optimizer: the ``torch.optim`` optimizer.
        names: ``[(name, parameter), ...]`` of the parameters it updates.
    """

    def __init__(self, optimizer, names: list[tuple[str, Any]]):
        self.optimizer = optimizer
        self._params = dict(names)
        #: Steps taken (torch's ``state["step"]``), restored with the state.
        self.iterations = 0

    def get_config(self) -> dict[str, Any]:
        return {"name": f"torch.optim.{type(self.optimizer).__name__}"}

    def state_dict(self) -> dict[str, Any]:
        """``{"iterations": int, "slots": {name: {key: array}}}``: every tensor of the torch state but
        ``step`` (kept as ``iterations``), copied to host memory."""
        slots: dict[str, dict[str, np.ndarray]] = {}
        for name, param in self._params.items():
            state = self.optimizer.state.get(param)
            if not state:
                continue
            entries = {key: value.detach().cpu().numpy().copy() for key, value in state.items()
                       if key != "step" and _is_tensor(value)}
            if entries:
                slots[name] = entries
        return {"iterations": int(self.iterations), "slots": slots}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put ``state`` (from :meth:`state_dict` or a checkpoint) into the torch optimizer."""
        import torch

        if not isinstance(state, Mapping) or not isinstance(state.get("slots"), Mapping):
            raise ConfigurationError("an optimizer state is {'iterations': int, 'slots': {...}} from a checkpoint")
        unknown = sorted(set(state["slots"]) - set(self._params))
        if unknown:
            raise ConfigurationError(
                f"the checkpoint's optimizer state names parameter(s) {', '.join(map(repr, unknown[:10]))} that "
                f"this torch optimizer does not update; restore it into the same model"
            )
        iterations = int(state.get("iterations", 0))
        keeps_step = not isinstance(self.optimizer, torch.optim.SGD)
        for name, param in self._params.items():
            entries = state["slots"].get(name)
            if not entries:
                self.optimizer.state.pop(param, None)
                continue
            restored = {}
            for key, array in entries.items():
                value = torch.from_numpy(np.array(array, copy=True))
                restored[key] = value.to(device=param.device, dtype=param.dtype if value.ndim else value.dtype)
            if keeps_step:
                restored["step"] = torch.tensor(float(iterations), dtype=torch.float32)
            self.optimizer.state[param] = restored
        self.iterations = iterations


def module_state_dict(path, *, prefix: str = "") -> dict[str, Any]:
    """The variables of checkpoint ``path`` (a file, or a directory's latest) as a torch ``state_dict``
    (CPU tensors), keeping those named ``prefix...`` with the prefix removed: ``module.load_state_dict``
    takes it, in a plain torch program with no strategy."""
    import torch

    from stratagem.training import checkpoint

    loaded = checkpoint.load(path)
    return {name[len(prefix):]: torch.from_numpy(np.array(value, copy=True))
            for name, value in loaded.variables.items() if name.startswith(prefix)}


def _is_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")
