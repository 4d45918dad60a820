"""What a strategy's checkpoints hold, checked: the default number kept, and whether a checkpoint
fits the variables a program created (``Strategy.save`` and ``restore`` write and read the files through
:mod:`stratagem.training.checkpoint`; the parameter-server strategies through
:mod:`stratagem.strategies.ps.checkpoint`). README: "Training with a strategy".
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from stratagem.core.errors import ConfigurationError

#: Keep at most this many checkpoints in a directory unless ``save(max_to_keep=...)`` says otherwise.
DEFAULT_MAX_TO_KEEP = 5


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


def optimizer_name(optimizer) -> str:
    """The optimizer's name, for error messages."""
    try:
        return str(optimizer.get_config().get("name", type(optimizer).__name__))
    except Exception:  # noqa: BLE001 - only for an error message
        return type(optimizer).__name__
