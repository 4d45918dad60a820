"""A DDP-style training script on stratagem.torch, for tests/test_torch_ddp.py, written as a user writes it
(no ``__main__`` guard, no close):

    stratagem launch --worker 2 -- python3 torch_ddp_train.py OUT [--no-find-unused] [--no-overlap]
    python3 torch_ddp_train.py OUT                  alone: one process on the whole global batches

The model has a SyncBatchNorm (``convert_sync_batchnorm``), a layer it never uses (``extra``:
``find_unused_parameters=True``) and layers registered in another order than they run (the buckets
are rebuilt after the first step from the order the gradients arrived). Each step accumulates two
global batches of 7 rows (4 + 3 per replica; 4 steps) with ``no_sync()`` (recording the bytes received during
that backward pass: SyncBatchNorm's only), clips the reduced gradients in
``on_reduced_gradients`` and takes an SGD step. A function between ``body`` and ``bn`` waits, in the
backward pass of steps >= 1, until the bytes received since the backward pass began exceed what
SyncBatchNorm's own reduction moves: the gradient buckets of ``head`` and ``mid`` were all-reduced
while the backward pass was still running. OUT/<task>.npz and .json hold what the test compares.
"""

import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import stratagem
import stratagem.torch

out = sys.argv[1]
find_unused = "--no-find-unused" not in sys.argv
overlap = "--no-overlap" not in sys.argv
torch.set_num_threads(1)
torch.manual_seed(0)
strategy = stratagem.strategy("mirrored", transport="zmq", timeout=60)
alone = strategy.num_replicas_in_sync == 1
watch = {"armed": False, "start": None, "seen": []}


class WatchTraffic(torch.autograd.Function):
    """Identity; its backward records whether gradient buckets were reduced before it ran."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if watch["armed"]:
            deadline, received = time.monotonic() + 20, 0
            while time.monotonic() < deadline:
                received = (strategy.transport.traffic.snapshot() - watch["start"]).received_bytes()
                if received >= 1000:
                    break
                time.sleep(0.01)
            watch["seen"].append(received)
        return grad


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 3)          # registered first, runs last
        self.mid = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.body = torch.nn.Linear(6, 16)
        self.extra = torch.nn.Linear(3, 3)          # never used

    def forward(self, x):
        h = self.bn(WatchTraffic.apply(self.body(x)))
        return self.head(torch.tanh(self.mid(torch.tanh(h))))


model = stratagem.torch.convert_sync_batchnorm(Net(), strategy)
norms, first_grads = [], {}


def clip(params):
    if not first_grads:
        first_grads.update({n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()
                            if p.grad is not None})
    norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))


opt = stratagem.torch.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), model.named_parameters(), strategy=strategy,
    bucket_bytes=256, overlap=overlap, find_unused_parameters=find_unused, on_reduced_gradients=clip)
buckets_before = opt.bucket_members
g = torch.Generator().manual_seed(1)
data = [(torch.randn(7, 6, generator=g) * 3 + 1, torch.randint(0, 3, (7,), generator=g)) for _ in range(8)]
outputs, in_no_sync = [], []
for step, ((x1, y1), (x2, y2)) in enumerate(zip(*[iter(strategy.distribute_dataset(data))] * 2)):
    with opt.no_sync():
        loss = F.cross_entropy(model(x1), y1)
        before = strategy.transport.traffic.snapshot()
        loss.backward()
        in_no_sync.append((strategy.transport.traffic.snapshot() - before).received_bytes())
    prediction = model(x2)
    if step == 0:
        outputs = prediction.detach().numpy().tolist()
    watch["armed"], watch["start"] = step >= 1 and not alone, strategy.transport.traffic.snapshot()
    F.cross_entropy(prediction, y2).backward()
    watch["armed"] = False
    opt.step()
    opt.zero_grad()
    if step == 0:
        buckets_after = opt.bucket_members

task = f"{strategy.task.job}_{strategy.task.index}"
np.savez(os.path.join(out, task + ".npz"),
         **{"param/" + n: p.detach().numpy() for n, p in model.named_parameters()},
         **{"grad/" + n: v for n, v in first_grads.items()},
         running_mean=model.bn.running_mean.numpy(), running_var=model.bn.running_var.numpy())
with open(os.path.join(out, task + ".json"), "w") as f:
    json.dump({"norms": norms, "outputs": outputs, "received_in_backward": watch["seen"],
               "received_in_no_sync": in_no_sync,
               "buckets_before": buckets_before, "buckets_after": buckets_after,
               "extra_grad_is_none": model.extra.weight.grad is None}, f)
