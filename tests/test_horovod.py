"""``stratagem.horovod``: Horovod scripts run with only their import changed.

- Horovod's PyTorch MNIST example, reshaped for the digits (examples/horovod_digits.py), runs under
  ``stratagem launch --worker 2`` and ends with the same weights on every rank, equal within 1e-5 to one
  plain torch process trained on the same global batches (the ranks' DistributedSampler shards put
  together), both without a strategy and, with the script unchanged, on the ``mirrored`` strategy
  (``STRATAGEM_HOROVOD_STRATEGY``); on ``between_graph`` (SGD on a ps task) it trains and ends.
- tests/scripts/horovod_api.py asserts every name on 3 ranks (allreduce ops, ragged allgather,
  broadcasts, optimizer state, DistributedOptimizer's options, join with uneven batches), without a
  strategy and on ``mirrored``.
- A rank failing: the other's next collective names it.
- Errors that name the fix, and ``import stratagem.horovod`` not importing torch.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (the digits)")

import stratagem  # noqa: E402
import stratagem.horovod as hvd  # noqa: E402
from stratagem.launch.launcher import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "horovod_digits.py"
API_SCRIPT = Path(__file__).parent / "scripts" / "horovod_api.py"
EPOCHS, LR, BATCH = 2, 0.05, 64
THREADS = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

pytestmark = pytest.mark.timeout(240)


def example_args(out: Path) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--epochs", str(EPOCHS), "--lr", str(LR), "--batch-size", str(BATCH),
            "--save-dir", str(out)]


@pytest.fixture(scope="module")
def reference():
    """One plain torch process (no stratagem, no Horovod) on the global batches of 2 ranks: each step the
    two ranks' DistributedSampler batches put together, SGD at the example's lr scaled by 2."""
    spec = importlib.util.spec_from_file_location("horovod_digits", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)       # defines Net and the data; the script body is under __main__
    import torch.nn.functional as F

    ranks = 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # as the example does (and the machine is shared)
    try:
        return _train_reference(example, F, ranks)
    finally:
        torch.set_num_threads(threads)


def _train_reference(example, F, ranks: int) -> dict:
    torch.manual_seed(42)
    model = example.Net()
    initial = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * ranks, momentum=0.5)
    train_dataset, _ = example.digits_datasets()
    samplers = [torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=ranks, rank=rank)
                for rank in range(ranks)]
    for epoch in range(1, EPOCHS + 1):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        loaders = [torch.utils.data.DataLoader(train_dataset, batch_size=BATCH, sampler=s) for s in samplers]
        for batches in zip(*loaders, strict=True):
            data = torch.cat([b[0] for b in batches])
            target = torch.cat([b[1] for b in batches])
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
    final = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    # Training moved the weights well beyond the tolerance, so matching them means something.
    assert max(float(np.abs(final[k] - initial[k]).max()) for k in final) > 1e-2
    return {"initial": initial, "final": final}


def assert_ranks_match(out: Path, expected: dict, ranks: int = 2) -> None:
    weights = [dict(np.load(out / f"rank{rank}.npz")) for rank in range(ranks)]
    assert sorted(weights[0]) == sorted(expected)
    for other in weights[1:]:
        for name in expected:
            np.testing.assert_array_equal(other[name], weights[0][name], err_msg=name)
    for name in expected:
        np.testing.assert_allclose(weights[0][name], expected[name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("strategy", [None, "mirrored"], ids=["communicator", "mirrored"])
def test_horovod_mnist_example_equals_one_process_on_the_global_batch(strategy, reference, tmp_path):
    env = {**THREADS, hvd.STRATEGY_ENV: strategy}
    result = launch(example_args(tmp_path), workers=2, timeout=180, env=env)
    assert result.ok, result.summary()
    assert_ranks_match(tmp_path, reference["final"])


def test_horovod_mnist_example_runs_unchanged_on_parameter_servers(reference, tmp_path):
    lines = []

    class Lines:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    result = launch(example_args(tmp_path), workers=2, ps=1, timeout=180, output=Lines(),
                    env={**THREADS, hvd.STRATEGY_ENV: "between_graph"})
    assert result.ok, result.summary()
    text = "".join(lines)
    assert text.count("Test set: Average loss") == EPOCHS, text
    # SGD ran on the ps task (asynchronous: each worker's pushes applied as they came): each worker
    # ends with the values it last pulled, trained away from the initial ones.
    for rank in range(2):
        weights = dict(np.load(tmp_path / f"rank{rank}.npz"))
        assert sorted(weights) == sorted(reference["initial"])
        assert all(np.isfinite(w).all() for w in weights.values())
        moved = max(float(np.abs(weights[k] - reference["initial"][k]).max()) for k in weights)
        assert moved > 1e-2, moved


@pytest.mark.parametrize("strategy", [None, "mirrored"], ids=["communicator", "mirrored"])
def test_every_horovod_name_on_three_ranks(strategy, tmp_path):
    result = launch([sys.executable, str(API_SCRIPT), str(tmp_path)], workers=3, timeout=180,
                    env={**THREADS, hvd.STRATEGY_ENV: strategy})
    assert result.ok, result.summary()
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert [s["rank"] for s in seen] == [0, 1, 2]
    assert all(s["join_last"] == 2 for s in seen)
    assert seen[0]["weight_after_join"] == seen[1]["weight_after_join"] == seen[2]["weight_after_join"]
    assert seen[0]["mismatch"] == seen[1]["mismatch"] == seen[2]["mismatch"]


def test_a_rank_that_fails_is_named_by_the_others(tmp_path):
    """The plain script ending by an exception on one rank: the other's next collective names it."""
    out, err = io.StringIO(), io.StringIO()
    result = launch([sys.executable, str(Path(__file__).parent / "scripts" / "horovod_raise.py")], workers=2,
                    timeout=120, output=out, error_output=err)
    assert result.exit_code == 1 and not result.timed_out, result.summary()
    text = err.getvalue()
    assert "[worker:1] RuntimeError: rank 1 ran out of luck" in text, text
    lost = [line for line in text.splitlines() if line.startswith("[worker:0]") and "PeerLostError" in line]
    assert lost and "lost peer /job:worker/task:1" in lost[-1], text
    assert "went on without" not in out.getvalue()


@pytest.fixture
def alone():
    """``hvd.init()`` in this process: a world of one over the in-process transport."""
    hvd.init(transport="local", transport_options=stratagem.plugin_manager().transport_class("local").world_options())
    yield
    hvd.shutdown()


def test_errors_name_the_fix(alone):
    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(stratagem.ConfigurationError, match="use hvd.Average"):
        hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), op=hvd.Adasum)
    with pytest.raises(stratagem.ConfigurationError, match="Compression.none or hvd.Compression.fp16"):
        hvd.DistributedOptimizer(sgd, compression="int8")
    with pytest.raises(stratagem.ConfigurationError, match="wraps a torch.optim optimizer"):
        hvd.DistributedOptimizer(model)
    with pytest.raises(stratagem.ConfigurationError, match="does not name 1 of the optimizer's parameters"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("weight", model.weight)])
    with pytest.raises(stratagem.ConfigurationError, match="root_rank must be a rank in 0..0"):
        hvd.broadcast(torch.zeros(1), root_rank=1)
    with pytest.raises(stratagem.ConfigurationError, match="op= or the older average="):
        hvd.allreduce(torch.zeros(1), average=True, op=hvd.Sum)
    with pytest.raises(stratagem.ConfigurationError, match="torch tensor or a numpy array"):
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(stratagem.ConfigurationError, match="sub-communicators are not supported"):
        hvd.shutdown()
        hvd.init(comm=[0, 1])


def test_distributed_optimizer_passes_for_the_torch_optimizer(alone):
    """Horovod's optimizer is an instance of the wrapped optimizer's class: schedulers take it."""
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    assert opt.param_groups[0]["lr"] == 0.125


def test_fp16_on_a_strategy_is_the_strategys_compression():
    fabric = stratagem.plugin_manager().transport_class("local").world_options
    model = torch.nn.Linear(2, 1)
    hvd.init(strategy="mirrored", transport="local", transport_options=fabric())
    try:
        with pytest.raises(stratagem.ConfigurationError, match="compression='fp16'"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=hvd.Compression.fp16)
    finally:
        hvd.shutdown()
    hvd.init(strategy="mirrored", transport="local", transport_options=fabric(), compression="fp16")
    try:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=hvd.Compression.fp16)
        model(torch.ones(1, 2)).sum().backward()
        before = model.weight.detach().clone()
        opt.step()
        assert torch.allclose(model.weight, before - 0.1)
    finally:
        hvd.shutdown()


def test_calls_before_init_say_to_call_init():
    assert not hvd.is_initialized()
    with pytest.raises(stratagem.ConfigurationError, match=r"call hvd.init\(\) first"):
        hvd.rank()


def test_strategies_that_drive_from_one_task_are_refused_with_the_ones_that_work():
    fabric = stratagem.plugin_manager().transport_class("local").world_options()
    with pytest.raises(stratagem.ConfigurationError, match="Use 'mirrored' .* or 'between_graph'"):
        hvd.init(strategy="in_graph", transport="local", transport_options=fabric)
    assert not hvd.is_initialized()


def test_importing_stratagem_horovod_does_not_import_torch():
    code = ("import sys, stratagem.horovod as hvd; "
            "print(sorted(m for m in ('torch', 'grpc', 'mpi4py', 'jax') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
