"""Torch tensors and stratagem arrays as views of one another, without copies.

A CPU tensor and a numpy array share memory through ``tensor.numpy()`` / ``torch.from_numpy``; a CUDA
tensor and a cupy array through DLPack (``cupy.from_dlpack`` / ``torch.from_dlpack``). Variables are
updated in place, so a parameter made a view of a variable's buffer always computes with its current
value. (The CUDA path is written for the DLPack protocol both libraries implement; it has not run on a
GPU in this project's tests, which have no CUDA build of torch.)

>>> import numpy as np
>>> array = np.zeros(3, np.float32)
>>> tensor = as_tensor(array)
>>> array[0] = 7.0
>>> tensor.tolist(), as_array(tensor) is not None and as_array(tensor).base is not None
([7.0, 0.0, 0.0], True)
"""

from __future__ import annotations

import importlib

import torch

from stratagem.training.variables import is_device_array


def as_array(tensor):
    """``tensor`` (detached) as a numpy array (CPU) or a cupy array (CUDA) sharing its memory."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.numpy()
    return importlib.import_module("cupy").from_dlpack(tensor)


def as_tensor(array):
    """A torch tensor sharing the memory of ``array`` (numpy: on the CPU; cupy: on its GPU)."""
    if is_device_array(array):
        return torch.from_dlpack(array)
    return torch.from_numpy(array)
