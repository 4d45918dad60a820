"""Batch normalisation over the global batch: :class:`SyncBatchNorm` and :func:`convert_sync_batchnorm`.

In training, a plain BatchNorm layer normalises each replica's shard with the shard's own mean and
variance. :class:`SyncBatchNorm` all-reduces, per channel, the shard's element count, sum and sum of
squares (one ``strategy.reduce("sum", ...)`` of a float64 vector), so every replica normalises with
the global batch's statistics (count-weighted: shards of different sizes are right) and updates the
running statistics as one process on the global batch would. Its backward pass is the global batch's
too: the two per-channel sums of the backward formula are all-reduced, each replica's weighted by its
share of the global batch (the weight its parameter gradients get in the reduction), so that the
gradients the optimizer then reduces equal one process's on the whole batch. In eval mode, or in a
world of one, it is torch's ``batch_norm``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from stratagem.core.errors import ConfigurationError
from stratagem.training.variables import resolve_strategy


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """A BatchNorm layer (any number of spatial dimensions) whose batch statistics are the replicas'
    global batch's (see the module doc). ``strategy``: whose replicas share the statistics."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, strategy=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.strategy = resolve_strategy(strategy, "SyncBatchNorm")

    def _check_input_dim(self, input) -> None:
        if input.dim() < 2:
            raise ConfigurationError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), "
                                     f"got {input.dim()}")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or self.strategy.num_replicas_in_sync == 1:
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                            self.eps, momentum, self.strategy)


def _reduce_sum(strategy, tensor):
    """``tensor`` (float64, CPU or CUDA) summed over the replicas."""
    array = tensor.detach().cpu().numpy()
    total = strategy.reduce("sum", np.ascontiguousarray(array))
    return torch.from_numpy(np.asarray(total)).to(tensor.device)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: normalise with the global statistics; backward: the global batch's gradient."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, strategy):
        channels = input.shape[1]
        dims = [d for d in range(input.dim()) if d != 1]
        local = input.detach().to(torch.float64)
        count = input.numel() // channels if input.numel() else 0
        stats = torch.cat([local.sum(dims) if count else local.new_zeros(channels),
                           (local * local).sum(dims) if count else local.new_zeros(channels),
                           local.new_tensor([float(count)])])
        total = _reduce_sum(strategy, stats)
        n = float(total[-1])
        if n == 0:
            raise ConfigurationError("SyncBatchNorm: the global batch is empty")
        mean = total[:channels] / n
        var = (total[channels:2 * channels] / n - mean * mean).clamp_min(0.0)
        if running_mean is not None and momentum:
            with torch.no_grad():
                unbiased = var * (n / (n - 1)) if n > 1 else var
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (input.dim() - 2)
        invstd = torch.rsqrt(var + eps)
        xhat = (local - mean.view(shape)) * invstd.view(shape)
        out = xhat
        if weight is not None:
            out = out * weight.detach().to(torch.float64).view(shape)
        if bias is not None:
            out = out + bias.detach().to(torch.float64).view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.n, ctx.dims, ctx.shape, ctx.strategy = n, dims, shape, strategy
        ctx.share = float(strategy.gradient_weight)
        ctx.has_bias = bias is not None
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        xhat, invstd, weight = ctx.saved_tensors
        g = grad_output.to(torch.float64)
        shape, dims = ctx.shape, ctx.dims
        channels = xhat.shape[1]
        share = ctx.share if ctx.share > 0 else 1.0     # an empty shard has no rows to pass a gradient to
        dxhat = g * weight.detach().to(torch.float64).view(shape) if weight is not None else g
        local = torch.cat([dxhat.sum(dims), (dxhat * xhat).sum(dims)]) if g.numel() else g.new_zeros(2 * channels)
        # The global batch's sums, each replica's part weighted by its share (the true dL/dy is share * g).
        total = _reduce_sum(ctx.strategy, local * ctx.share) / share
        sum_dxhat, sum_dxhat_xhat = total[:channels].view(shape), total[channels:].view(shape)
        grad_input = invstd.view(shape) * (dxhat - (sum_dxhat + xhat * sum_dxhat_xhat) / ctx.n)
        grad_weight = (g * xhat).sum(dims).to(weight.dtype) if weight is not None else None
        grad_bias = g.sum(dims).to(weight.dtype) if ctx.has_bias else None
        return grad_input.to(grad_output.dtype), grad_weight, grad_bias, None, None, None, None, None


def convert_sync_batchnorm(module, strategy=None):
    """``module`` with every BatchNorm layer (``BatchNorm1d/2d/3d``) replaced by a :class:`SyncBatchNorm`
    that keeps its parameters, running statistics and settings (DDP's
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``). Returns the module (a new one if ``module``
    itself is a BatchNorm layer). Convert before ``DistributedOptimizer`` or ``wrap_module``, so that
    the optimizer holds the parameters the model uses."""
    strategy = resolve_strategy(strategy, "convert_sync_batchnorm()")
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, strategy=strategy)
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, strategy))
    return module
