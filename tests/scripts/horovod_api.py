"""Every name of ``stratagem.horovod`` on 3 ranks, as a Horovod user calls them (tests/test_horovod.py).

Run as ``stratagem launch --worker 3 -- python horovod_api.py OUT`` (with ``STRATAGEM_HOROVOD_STRATEGY=mirrored``:
the same on the mirrored strategy): each rank asserts what every call
returns (a failed assertion fails the job) and writes what it saw to ``OUT/rank<N>.json``. A plain
script: no ``__main__`` guard, no shutdown() until the end.
"""

import json
import os
import sys

import numpy as np
import torch

import stratagem.horovod as hvd
from stratagem import CollectiveMismatchError, ConfigurationError

out = sys.argv[1]
seen = {}

hvd.init()
hvd.init()          # again: nothing happens
r, n = hvd.rank(), hvd.size()
assert n == 3 and hvd.is_initialized()
assert (hvd.local_rank(), hvd.local_size()) == (r, 3)     # stratagem launch: every task on this host
assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
seen["rank"] = r

# -- allreduce: torch in, torch out; Average by default; Sum; the older average=; Min, Max; numpy -------
t = torch.tensor([float(r), 2.0 * r])
avg = hvd.allreduce(t, name="t")
assert isinstance(avg, torch.Tensor) and avg.dtype == torch.float32 and avg.tolist() == [1.0, 2.0], avg
assert hvd.allreduce(t, op=hvd.Sum).tolist() == [3.0, 6.0]
assert hvd.allreduce(t, average=False).tolist() == [3.0, 6.0]
assert hvd.allreduce(t, average=True).tolist() == [1.0, 2.0]
assert t.tolist() == [float(r), 2.0 * r]            # the input is left alone
assert hvd.allreduce(torch.tensor([r, -r]), op=hvd.Max).tolist() == [2, 0]
assert hvd.allreduce(torch.tensor([r, -r]), op=hvd.Min).tolist() == [0, -2]
ints = hvd.allreduce(torch.tensor([2 * r + 1]))        # (1 + 3 + 5) / 3, integers stay integers
assert ints.dtype == torch.int64 and ints.tolist() == [3], ints
half = hvd.allreduce(torch.tensor([0.5 * r, 1.0]), compression=hvd.Compression.fp16)
assert half.dtype == torch.float32 and half.tolist() == [0.5, 1.0]
array = hvd.allreduce(np.full(3, r, np.float64), op=hvd.Sum)
assert type(array) is np.ndarray and array.tolist() == [3.0, 3.0, 3.0]
inplace = torch.tensor([float(r)])
assert hvd.allreduce_(inplace, op=hvd.Sum) is inplace and inplace.tolist() == [3.0]
assert hvd.synchronize(hvd.allreduce_async(torch.tensor([1.0]), op=hvd.Sum)).tolist() == [3.0]

# -- allgather: along dimension 0, ranks with different numbers of rows ---------------------------------
gathered = hvd.allgather(torch.full((r + 1, 2), float(r)))
assert gathered.shape == (6, 2) and gathered[:, 0].tolist() == [0, 1, 1, 2, 2, 2], gathered

# -- broadcast: a new tensor; broadcast_ in place; broadcast_object ------------------------------------
mine = torch.tensor([r, r])
got = hvd.broadcast(mine, root_rank=1)
assert got.tolist() == [1, 1] and mine.tolist() == [r, r] and got is not mine
x = torch.full((3,), float(r))
assert hvd.broadcast_(x, root_rank=2) is x and x.tolist() == [2.0, 2.0, 2.0]
obj = hvd.broadcast_object({"from": r, "rows": np.arange(r + 1), "pair": (r, "x")}, root_rank=2)
assert obj["from"] == 2 and obj["rows"].tolist() == [0, 1, 2] and obj["pair"] == (2, "x")

# -- a mismatch is an error on every rank, naming each rank's call -------------------------------------
try:
    hvd.allreduce(torch.zeros(2 + (r == 1)), name="uneven")
except CollectiveMismatchError as exc:
    assert "rank 1: allreduce(op=average, float32, 3 elements)" in str(exc), exc
    seen["mismatch"] = str(exc)
else:
    raise AssertionError("an allreduce of different sizes was not refused")
# ... found in the negotiation, before any data moved: the world goes on
assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == 3.0

# -- broadcast_parameters: every rank gets root 0's values ---------------------------------------------
torch.manual_seed(r)                      # different values on every rank
model = torch.nn.Linear(4, 2)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
torch.manual_seed(0)
reference = torch.nn.Linear(4, 2)
assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)

# -- broadcast_optimizer_state: Adam before its first step (no state anywhere) and after ---------------
opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
hvd.broadcast_optimizer_state(opt, root_rank=0)
assert opt.param_groups[0]["lr"] == 0.01 and len(opt.state) == 0
if r == 0:                                # only the root steps: the others have no state to fill
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
hvd.broadcast_optimizer_state(opt, root_rank=0)
state = opt.state[model.weight]
assert float(state["step"]) == 1.0 and state["exp_avg"].abs().sum() > 0
rows = hvd.allgather(state["exp_avg_sq"].reshape(1, -1))
assert all(torch.equal(rows[0], row) for row in rows), rows
seen["adam_betas"] = list(opt.param_groups[0]["betas"])


# -- DistributedOptimizer: rank k's gradient is k + 1 on every weight -----------------------------------
def linear(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(3, 1, bias=False)
    return layer, layer.weight.detach().clone()


def backward(layer, k):
    layer(torch.full((1, 3), k + 1.0)).sum().backward()


layer, w0 = linear()
opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0), named_parameters=layer.named_parameters())
backward(layer, r)
opt.step()
assert torch.allclose(layer.weight, w0 - 2.0), (layer.weight, w0)          # mean of 1, 2, 3
assert opt.param_groups[0]["lr"] == 1.0 and "momentum" in opt.state_dict()["param_groups"][0]
opt.zero_grad()

layer, w0 = linear()
on_strategy = bool(os.environ.get(hvd.STRATEGY_ENV))   # there, compression is the strategy's option
opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0), named_parameters=layer.named_parameters(),
                               op=hvd.Sum, compression=hvd.Compression.none if on_strategy else hvd.Compression.fp16)
backward(layer, r)
opt.step()
assert torch.allclose(layer.weight, w0 - 6.0), layer.weight                 # sum, through float16

layer, w0 = linear()
opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0), named_parameters=layer.named_parameters(),
                               backward_passes_per_step=2)
backward(layer, r)
backward(layer, r)                        # two passes accumulate locally, one reduction
opt.step()
assert torch.allclose(layer.weight, w0 - 4.0), layer.weight
opt.zero_grad()
backward(layer, r)
backward(layer, r)
try:
    backward(layer, r)                    # a third pass before step()
except ConfigurationError as exc:
    assert "backward_passes_per_step=2" in str(exc), exc
else:
    raise AssertionError("a third backward pass was accepted")

layer, w0 = linear()
opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0), named_parameters=layer.named_parameters())
backward(layer, r)
opt.synchronize()
assert torch.allclose(layer.weight.grad, torch.full((1, 3), 2.0))          # reduced, not yet applied
assert torch.equal(layer.weight, w0)
layer.weight.grad.mul_(0.5)                # what a clip would do
with opt.skip_synchronize():
    opt.step()
assert torch.allclose(layer.weight, w0 - 1.0), layer.weight
opt.zero_grad()

# -- join: rank k has k + 1 batches; the others go on without it ----------------------------------------
layer, w0 = linear()
opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0), named_parameters=layer.named_parameters())
counts = []
for batch in range(r + 1):
    backward(layer, r)
    opt.step()
    opt.zero_grad()
    counts.append(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item())   # the ranks still training
    counts.append(hvd.allgather(torch.tensor([[r]])).reshape(-1).tolist())
last = hvd.join()
assert last == 2, last
# step 1: mean of 1, 2, 3; step 2: rank 0 joined, mean of 2 and 3; step 3: rank 2 alone. Joined ranks
# applied the same updates, so every rank holds the same weights.
assert torch.allclose(layer.weight, w0 - (2.0 + 2.5 + 3.0)), layer.weight
assert counts == [3.0, [0, 1, 2], 2.0, [1, 2], 1.0, [2]][:2 * (r + 1)], counts
seen["join_last"] = last
seen["weight_after_join"] = layer.weight.detach().reshape(-1).tolist()
assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == 3.0      # everyone is back after join

with open(os.path.join(out, f"rank{r}.json"), "w") as f:
    json.dump(seen, f)
hvd.shutdown()
assert not hvd.is_initialized()
