"""stratagem.torch as DDP users expect it: overlap with the backward pass, bucket rebuild, ``no_sync()``,
``find_unused_parameters``, ``convert_sync_batchnorm``, ``on_reduced_gradients`` and torch tensors in
the communicator's collectives.

tests/scripts/torch_ddp_train.py is a plain user script (no ``__main__`` guard, no close). It runs
once alone (one process on whole global batches: the reference) and once under
``stratagem launch --worker 2`` (7-row batches: 4 + 3 rows, so SyncBatchNorm's statistics and the
gradient weights must be count-weighted); the tests compare what both wrote. A third job, without
``find_unused_parameters``, must fail naming the unused parameter and the option.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch): stratagem.torch is not tested")

import stratagem  # noqa: E402
import stratagem.torch as st  # noqa: E402
from stratagem.core.errors import ConfigurationError  # noqa: E402
from stratagem.testing.world import local_world  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "torch_ddp_train.py"
TOLERANCE = 1e-5
THREADS = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
#: Bytes one SyncBatchNorm backward moves (two float64 sums of 16 channels; with the peer's next
#: forward's statistics, 520): the gradient buckets' traffic during a backward pass is what exceeds
#: them (the script waits for 1000 bytes; without overlap it sees 256 at most).
SYNCBN_BYTES = 2 * 16 * 8

pytestmark = pytest.mark.timeout(240)


def env() -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    return {**clean, **THREADS}


def run(out: Path, *args: str, workers: int = 0) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), str(out), *args]
    if workers:
        command = [sys.executable, "-m", "stratagem", "launch", "--worker", str(workers), "--timeout", "150",
                   "--", *command]
    return subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=200, env=env())


def read(out: Path, task: str) -> tuple[dict, dict]:
    return dict(np.load(out / f"{task}.npz")), json.loads((out / f"{task}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(reference arrays, reference log), [(arrays, log) of each replica]."""
    alone, job = tmp_path_factory.mktemp("ddp_alone"), tmp_path_factory.mktemp("ddp_job")
    result = run(alone)
    assert result.returncode == 0, result.stdout + result.stderr
    result = run(job, workers=2)
    assert result.returncode == 0, result.stdout + result.stderr
    return read(alone, "worker_0"), [read(job, f"worker_{i}") for i in range(2)]


def max_diff(a: dict, b: dict, prefix: str) -> float:
    keys = [k for k in b if k.startswith(prefix)]
    assert keys and sorted(k for k in a if k.startswith(prefix)) == sorted(keys)
    return max(float(np.abs(a[k] - b[k]).max()) for k in keys)


def test_replicas_equal_one_process_and_each_other(runs):
    (ref, _), replicas = runs
    for arrays, _ in replicas:
        assert max_diff(arrays, ref, "param/") <= TOLERANCE
    first, second = replicas[0][0], replicas[1][0]
    assert all(np.array_equal(first[k], second[k]) for k in first if k.startswith("param/"))   # bitwise


def test_overlap_reduces_gradient_buckets_during_the_backward_pass(runs):
    """From step 1 (after the rebuild) the buckets of head and mid are all-reduced, by the background
    thread, while the backward pass has still to reach body: more bytes than SyncBatchNorm's arrived."""
    for _, log in runs[1]:
        assert len(log["received_in_backward"]) == 3
        assert all(received >= 1000 > SYNCBN_BYTES for received in log["received_in_backward"]), log


def test_buckets_are_rebuilt_in_the_order_gradients_arrived(runs):
    for _, log in runs[1]:
        # First: reverse parameter order (extra, registered last, comes first and never arrives).
        assert log["buckets_before"][0][:2] == ["extra.bias", "extra.weight"]
        # After step 0: the order of arrival (head's gradients first), the unused parameter last. A
        # bucket closes once it holds bucket_bytes=256, as DDP's do: head's 204 bytes take mid.bias
        # (64) in, and mid.weight (1024) makes a bucket alone.
        assert log["buckets_after"][:2] == [["head.bias", "head.weight", "mid.bias"], ["mid.weight"]]
        assert log["buckets_after"][-1] == ["extra.bias", "extra.weight"]
    assert runs[1][0][1]["buckets_after"] == runs[1][1][1]["buckets_after"]


def test_no_sync_accumulates_without_reducing(runs):
    (ref, _), replicas = runs
    for arrays, log in replicas:
        # Inside no_sync only SyncBatchNorm's statistics move (its backward's sums, perhaps the peer's
        # next forward's: 520 bytes at most; the gradients are over 1500); the accumulated gradients of
        # two batches are reduced by the next backward pass, and the update equals one process's.
        assert len(log["received_in_no_sync"]) == 4
        assert all(received < 1000 for received in log["received_in_no_sync"]), log["received_in_no_sync"]
        assert max_diff(arrays, ref, "param/") <= TOLERANCE


def test_find_unused_parameters_leaves_a_parameter_no_replica_used_untouched(runs):
    (ref, ref_log), replicas = runs
    assert ref_log["extra_grad_is_none"]
    for arrays, log in replicas:
        assert log["extra_grad_is_none"]
        assert np.array_equal(arrays["param/extra.weight"], ref["param/extra.weight"])
        assert "grad/extra.weight" not in arrays


def test_an_unused_parameter_without_the_option_fails_naming_it_and_the_option(tmp_path):
    result = run(tmp_path, "--no-find-unused", workers=2)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "'extra.weight', 'extra.bias' got no gradient" in output and "find_unused_parameters=True" in output, output


def test_sync_batchnorm_matches_one_process_on_the_global_batch(runs):
    """Forward outputs (each replica's rows), the first step's reduced gradients and the running
    statistics equal one process's BatchNorm on the whole (unevenly split) batch."""
    (ref, ref_log), replicas = runs
    rows = [slice(0, 4), slice(4, 7)]
    for (arrays, log), mine in zip(replicas, rows):
        assert np.abs(np.array(log["outputs"]) - np.array(ref_log["outputs"])[mine]).max() <= TOLERANCE
        assert max_diff(arrays, ref, "grad/") <= TOLERANCE
        for key in ("running_mean", "running_var"):
            assert np.abs(arrays[key] - ref[key]).max() <= TOLERANCE
    assert np.abs(ref["running_var"] - 1).max() > 0.1          # the statistics moved: the check means something


def test_on_reduced_gradients_clips_the_reduced_gradients(runs):
    (_, ref_log), replicas = runs
    assert max(ref_log["norms"]) > 0.5                          # clipping acted
    for _, log in replicas:
        assert np.abs(np.array(log["norms"]) - ref_log["norms"]).max() <= TOLERANCE
    assert replicas[0][1]["norms"] == replicas[1][1]["norms"]


def test_communicator_collectives_take_and_return_torch_tensors():
    comms = local_world(2)

    def step(comm):
        x = torch.full((3,), comm.rank + 1.0, requires_grad=True)
        out = torch.zeros(3)
        result = {"sum": comm.allreduce(x), "out_is_out": comm.allreduce(x.detach() * 2, out=out) is out,
                  "out": out, "bcast": comm.broadcast(torch.arange(3) * (comm.rank + 1), root=1),
                  "gather": comm.allgather(torch.tensor([comm.rank])), "scatter": comm.reduce_scatter(torch.arange(4.0))}
        inplace = torch.ones(2)
        comm.allreduce(inplace, out=inplace)
        result["inplace"] = inplace
        return result

    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(step, comms))
    finally:
        for comm in comms:
            comm.close()
    for rank, result in enumerate(results):
        assert all(isinstance(v, torch.Tensor) for k, v in result.items() if k != "out_is_out")
        assert result["sum"].tolist() == [3.0] * 3 and result["out_is_out"] and result["out"].tolist() == [6.0] * 3
        assert result["bcast"].tolist() == [0, 2, 4] and result["gather"].tolist() == [[0], [1]]
        assert result["scatter"].tolist() == [[0.0, 2.0], [4.0, 6.0]][rank]
        assert result["inplace"].tolist() == [2.0, 2.0]


def test_convert_sync_batchnorm_keeps_the_layers_state_and_is_batchnorm_alone():
    with stratagem.strategy("mirrored", transport="zmq") as strategy:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=None)))
        weight = plain[1][0].weight
        converted = st.convert_sync_batchnorm(plain, strategy)
        layer = converted[1][0]
        assert isinstance(layer, st.SyncBatchNorm) and layer.weight is weight and layer.momentum is None
        reference = torch.nn.BatchNorm2d(3, momentum=None)
        reference.load_state_dict(layer.state_dict())
        x = torch.randn(4, 3, 2, 2)
        assert torch.allclose(layer(x), reference(x)) and torch.equal(layer.running_var, reference.running_var)
        with pytest.raises(ConfigurationError, match="at least 2 dimensions"):
            layer(torch.ones(3))


def test_ddp_options_are_checked():
    module = torch.nn.Linear(2, 1)
    with stratagem.strategy("mirrored", transport="zmq") as strategy:
        def make(**options):
            return st.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), strategy=strategy, **options)

        with pytest.raises(ConfigurationError, match="bucket_bytes=25 << 20"):
            make(bucket_bytes=0)
        with pytest.raises(ConfigurationError, match="overlap=...\\) takes True or False"):
            make(overlap="yes")
        with pytest.raises(ConfigurationError, match="on_reduced_gradients takes a function"):
            make(on_reduced_gradients=3)
        seen = []
        opt = make(on_reduced_gradients=lambda params: seen.append(len(params)))
        with opt.no_sync():                     # a world of one: accumulating needs nothing
            module(torch.ones(1, 2)).sum().backward()
        module(torch.ones(1, 2)).sum().backward()
        assert module.bias.grad.item() == 2.0
        opt.step()
        assert seen == [2] and opt.bucket_members is None
