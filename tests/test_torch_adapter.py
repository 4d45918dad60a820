"""stratagem.torch: a torch module trained through ``DistributedOptimizer`` equals plain single-process torch.

Real jobs (``stratagem.launch.launcher.launch``, processes over zmq) run tests/scripts/torch_adapter_train.py:
2 and 3 replicas under ``mirrored`` (the gradients all-reduced, then the torch optimizer's own
``step()``) and under ``between_graph`` in sync mode (the torch optimizer translated to torch's exact
rule, run on the ps tasks). The final parameters of every replica must equal, within 1e-6, those of
one process that trains the same module on whole global batches with plain ``torch.optim`` (no
stratagem). The global batch (25 rows) divides by neither 2 nor 3 and the inputs span four decades of
scale (tiny gradients, where Adam's epsilon placement shows), non-chief replicas build their module
from another seed (the chief's values must win), and checkpoints written under one strategy resume
under the other. In-process tests (a world of one) cover the API's checks and the checkpoint bridge.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch): stratagem.torch is not tested")

import stratagem  # noqa: E402
from stratagem.core.errors import ConfigurationError  # noqa: E402
from stratagem.launch.launcher import launch  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "torch_adapter_train.py"
STEPS = 20
TOLERANCE = 1e-6
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")
#: One math thread per process: the tasks share the machine's cores.
THREADS = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

pytestmark = pytest.mark.timeout(240)


def alone_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    return {**env, **THREADS}


#: Every optimizer the tests compare with plain torch: their references come from one process.
OPTIMIZERS = ("adam", "sgd", "adagrad", "rmsprop")


def run_references(out: Path, steps: int = STEPS) -> dict[str, tuple[dict, dict]]:
    """Plain torch for every optimizer, in one process: {optimizer: (final parameters, initial ones)}."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(steps),
                             "--optimizer", ",".join(OPTIMIZERS), "--reference"],
                            capture_output=True, text=True, timeout=120, env=alone_env())
    assert result.returncode == 0, result.stdout + result.stderr
    return {kind: (dict(np.load(out / kind / "reference.npz")), dict(np.load(out / kind / "initial.npz")))
            for kind in OPTIMIZERS}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Plain single-process torch, per optimizer (all computed on first use, by one process)."""
    cache: dict[str, tuple[dict, dict]] = {}

    def get(optimizer: str):
        if not cache:
            cache.update(run_references(tmp_path_factory.mktemp("references")))
        return cache[optimizer]

    return get


def run_job(out: Path, strategy: str, n: int, *args: str, stderr=None):
    ps = 1 if strategy == "between_graph" else 0
    return launch([sys.executable, str(SCRIPT), "--out", str(out), "--strategy", strategy, *args],
                  workers=n, ps=ps, timeout=150, env=THREADS, error_output=stderr)


def replicas_output(out: Path, n: int) -> tuple[list[dict], list[dict]]:
    params = [dict(np.load(out / f"worker_{i}.npz")) for i in range(n)]
    logs = [json.loads((out / f"worker_{i}.json").read_text()) for i in range(n)]
    return params, logs


def max_abs_diff(params: dict, expected: dict) -> float:
    assert sorted(params) == sorted(NAMES)
    return max(float(np.abs(params[name] - expected[name]).max()) for name in NAMES)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("strategy, optimizer", [("mirrored", "adam"), ("between_graph", "adam")])
def test_distributed_optimizer_equals_plain_torch(strategy, optimizer, n, references, tmp_path):
    expected, initial = references(optimizer)
    assert max_abs_diff(initial, expected) > 1e-2      # training moved the parameters far beyond the tolerance

    result = run_job(tmp_path, strategy, n, "--optimizer", optimizer, "--steps", str(STEPS))
    assert result.ok, result.summary()
    params, logs = replicas_output(tmp_path, n)
    # Every replica trained on its rows of each global batch (25 = 13 + 12, 9 + 8 + 8).
    assert [log["rows"][0] for log in logs] == [len(part) for part in np.array_split(np.arange(25), n)]
    assert all(len(log["rows"]) == STEPS for log in logs)
    for replica in params:
        assert max_abs_diff(replica, expected) <= TOLERANCE, max_abs_diff(replica, expected)
    # broadcast_parameters gave every replica the last replica's tensor.
    assert [log["broadcast"] for log in logs] == [[float(n - 1)] * 3] * n


@pytest.mark.parametrize("strategy, optimizer, n", [("between_graph", "sgd", 2), ("between_graph", "adagrad", 3),
                                                    ("mirrored", "rmsprop", 2)])
def test_other_torch_optimizers_equal_plain_torch(strategy, optimizer, n, references, tmp_path):
    """SGD (Nesterov momentum, weight decay) and Adagrad (lr decay) run as torch's rules on the ps
    tasks; under mirrored any torch optimizer (RMSprop here) runs as it is."""
    expected, initial = references(optimizer)
    assert max_abs_diff(initial, expected) > 1e-2
    result = run_job(tmp_path, strategy, n, "--optimizer", optimizer, "--steps", str(STEPS))
    assert result.ok, result.summary()
    for replica in replicas_output(tmp_path, n)[0]:
        assert max_abs_diff(replica, expected) <= TOLERANCE, max_abs_diff(replica, expected)


@pytest.mark.parametrize("first, then", [(("between_graph", 2), ("mirrored", 3)),
                                         (("mirrored", 2), ("between_graph", 3))],
                         ids=["between_graph-to-mirrored", "mirrored-to-between_graph"])
def test_checkpoint_resumes_under_either_strategy(first, then, references, tmp_path):
    """Half the steps, ``strategy.save``; a new job restores and does the rest: the parameters equal
    an uninterrupted plain torch run, so the optimizer's state (torch's Adam moments, step) survived."""
    expected, _ = references("adam")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    half = STEPS // 2
    result = run_job(out, first[0], first[1], "--steps", str(half), "--save", str(ckpt))
    assert result.ok, result.summary()
    assert sorted(os.listdir(ckpt)) == [f"ckpt-{half:08d}.npz", "latest"]
    # The checkpoint holds the module's state_dict: a plain torch module loads it.
    state = stratagem.torch.module_state_dict(ckpt)
    assert sorted(state) == sorted(NAMES)
    torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5)).load_state_dict(state)

    result = run_job(out, then[0], then[1], "--first", str(half), "--steps", str(STEPS), "--restore", str(ckpt))
    assert result.ok, result.summary()
    for replica in replicas_output(out, then[1])[0]:
        assert max_abs_diff(replica, expected) <= TOLERANCE, max_abs_diff(replica, expected)


def test_unsupported_optimizer_on_parameter_servers_fails_the_job_naming_the_supported_ones(tmp_path):
    stderr = io.StringIO()
    result = run_job(tmp_path, "between_graph", 2, "--optimizer", "rmsprop", "--steps", "3", stderr=stderr)
    assert not result.ok
    output = stderr.getvalue()
    assert "RMSprop cannot run on the ps tasks" in output and "SGD, Adam, AdamW and Adagrad" in output, output


# -- in one process (a world of one) ------------------------------------------------------------------

@pytest.fixture
def strategy():
    with stratagem.strategy("mirrored", transport="zmq") as strategy:
        yield strategy


def test_parameters_are_views_of_the_variables(strategy):
    import stratagem.torch as st

    module = torch.nn.Linear(4, 2)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    variables = st.wrap_module(module, strategy, prefix="enc.")
    assert sorted(variables) == ["enc.bias", "enc.weight"]
    for name, param in module.named_parameters():
        var = variables["enc." + name]
        assert torch.equal(param.detach(), before[name])
        assert np.shares_memory(param.detach().numpy(), var.value)
        var.assign(np.full(var.shape, 3.0, np.float32))       # written in place: the module sees it
        assert float(param.detach().min()) == 3.0
        assert st.variable_of(param) is var
    assert st.wrap_module(module, strategy, prefix="enc.") == variables   # wrapping again keeps them


def test_step_equals_torch_step_in_a_world_of_one(strategy):
    import stratagem.torch as st

    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    opt = st.DistributedOptimizer(torch.optim.AdamW(ours.parameters(), lr=0.05), ours.named_parameters(),
                                  strategy=strategy)
    plain = torch.optim.AdamW(theirs.parameters(), lr=0.05)
    x = torch.randn(8, 5)
    for _ in range(5):
        for model, optimizer in ((ours, opt), (theirs, plain)):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a.detach(), b.detach())
    assert opt.param_groups[0]["lr"] == 0.05 and "DistributedOptimizer(AdamW" in repr(opt)


def test_checkpoint_bridge_keeps_torch_state(strategy, tmp_path):
    import stratagem.torch as st

    module = torch.nn.Linear(3, 1)
    opt = st.DistributedOptimizer(torch.optim.Adam(module.parameters(), lr=0.1), module.named_parameters(),
                                  strategy=strategy)
    for _ in range(3):
        module(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    saved_params = {n: p.detach().clone() for n, p in module.named_parameters()}
    saved_state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in module.named_parameters()}
    path = strategy.save(tmp_path)
    assert path.endswith("ckpt-00000003.npz")
    module(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert strategy.restore(tmp_path) == 3
    for name, param in module.named_parameters():
        assert torch.equal(param.detach(), saved_params[name])
        for key, value in saved_state[name].items():
            assert torch.equal(opt.state[param][key], value), (name, key)


def test_clear_errors():
    import stratagem.torch as st

    module = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigurationError, match="needs a strategy"):
        st.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    with stratagem.strategy("mirrored", transport="zmq") as strategy:
        with pytest.raises(ConfigurationError, match="wraps a torch.optim optimizer"):
            st.DistributedOptimizer(object(), strategy=strategy)
        opt = st.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), strategy=strategy)
        assert sorted(opt.variables) == ["param.0", "param.1"]      # positional names without named_parameters
        with pytest.raises(ConfigurationError, match="no parameter has a gradient"):
            opt.step()
        with pytest.raises(ConfigurationError, match="takes a module, a state_dict"):
            st.broadcast_parameters(3, strategy=strategy)
        with pytest.raises(ConfigurationError, match="root must be a replica rank"):
            st.broadcast_parameters(module, root=2, strategy=strategy)


def test_ps_rule_translation_and_refusals():
    import stratagem.torch as st

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert st.ps_rule_config(torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)) == {
        "name": "TorchAdam", "learning_rate": 0.01, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8,
        "weight_decay": 0.1, "amsgrad": False, "decoupled_weight_decay": True, "maximize": False}
    assert st.ps_rule_config(torch.optim.SGD(params, lr=0.1, momentum=0.9))["name"] == "TorchSGD"
    with pytest.raises(ConfigurationError, match="SGD, Adam, AdamW and Adagrad only"):
        st.ps_rule_config(torch.optim.RMSprop(params))
    groups = torch.optim.SGD([{"params": params}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0}], lr=0.1)
    with pytest.raises(ConfigurationError, match="parameter groups have different settings"):
        st.ps_rule_config(groups)


# -- the example, as a user runs it ------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn is not installed (no digits data)")
def test_example_mlp_torch_prints_the_same_figures_alone_mirrored_and_on_parameter_servers():
    root = Path(__file__).resolve().parent.parent
    example = [sys.executable, str(root / "examples" / "mlp_torch.py"), "--epochs", "2", "--log-every", "5"]
    launcher = [sys.executable, "-m", "stratagem", "launch", "--timeout", "150"]
    runs = {"alone": example,
            "mirrored": [*launcher, "--worker", "2", "--", *example],
            "between_graph": [*launcher, "--ps", "1", "--worker", "2", "--", *example, "--strategy", "between_graph"]}
    figures = {}
    for name, command in runs.items():
        result = subprocess.run(command, capture_output=True, text=True, timeout=200, env=alone_env())
        assert result.returncode == 0, result.stdout + result.stderr
        figures[name] = re.findall(r"(?:loss|test accuracy) (\d\.\d+)", result.stdout)
    assert len(figures["alone"]) == 9 + 2 + 1 and float(figures["alone"][-1]) > 0.9, figures
    assert figures["mirrored"] == figures["alone"] and figures["between_graph"] == figures["alone"], figures


def readme_block(heading: str) -> str:
    """The first python code block after ``heading`` in the README."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    after = text[text.index(heading):]
    return after[after.index("```python\n") + len("```python\n"):after.index("\n```", after.index("```python"))]


def test_readme_torch_section_runs_as_written(tmp_path):
    (tmp_path / "train.py").write_text(readme_block("### PyTorch"))
    result = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--worker", "2", "--timeout", "150", "--",
                             sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=200, env=alone_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("/job:worker/task:") == 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-00000001.npz", "ckpt-00000051.npz", "latest"]


def test_device_variables_are_viewed_through_dlpack(fake_cupy):
    """The GPU path's torch side: a variable holding a (fake, numpy-backed) cupy array is seen by torch
    through DLPack, sharing memory. (Without a CUDA build of torch, cupy.from_dlpack of a CUDA tensor,
    the other direction, does not run in these tests.)"""
    from stratagem.adapters.torch_tensors import as_tensor
    from stratagem.training.variables import Variable, is_device_array

    var = Variable(fake_cupy.zeros(3, dtype=np.float32), name="on_device")
    assert is_device_array(var.value)
    tensor = as_tensor(var.value)
    var.assign(np.array([1.0, 2.0, 3.0], np.float32))          # in place, as the optimizers write
    assert tensor.tolist() == [1.0, 2.0, 3.0]


def test_parameter_server_strategy_is_refused_with_the_way_to_train_there():
    """Under parameter_server the coordinator's steps run on the workers: the wrapper cannot follow."""
    import threading

    import stratagem.torch as st
    from stratagem.core.cluster import ClusterSpec
    from stratagem.strategies.ps.parameter_server import ParameterServerStrategy
    from stratagem.transports.local import LocalFabric

    cluster = ClusterSpec({"chief": ["local:0"], "worker": ["local:1"], "ps": ["local:2"]})
    fabric = LocalFabric()

    def start(task):
        return ParameterServerStrategy("local", cluster=cluster, task=task, exit_after_serving=False,
                                       transport_options={"fabric": fabric, "timeout": 30})

    servers = [threading.Thread(target=start, args=(t,)) for t in ("ps:0", "worker:0")]
    for t in servers:
        t.start()
    coordinator = start("chief:0")
    try:
        module = torch.nn.Linear(2, 1)
        with pytest.raises(ConfigurationError, match="pass the Variables and a stratagem optimizer"):
            st.DistributedOptimizer(torch.optim.Adam(module.parameters()), strategy=coordinator)
    finally:
        coordinator.shutdown()
        for t in servers:
            t.join(30)
    assert not any(t.is_alive() for t in servers)
