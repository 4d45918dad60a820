"""stratagem.jax: a pytree of parameters trained through the strategy equals single-process JAX.

Real jobs (``stratagem.launch.launcher.launch``, 2 processes over zmq) run tests/scripts/jax_adapter_train.py:
the gradient pytree from ``jax.grad`` goes to ``tree.apply_gradients`` with stratagem's Adam under
``mirrored`` and ``between_graph`` (sync), or through ``tree.reduce_gradients`` to an update rule the
script writes in jax.numpy (mirrored). The final parameters must equal, within 1e-6, those of one
process training on whole global batches in plain JAX with the same rule. The global batch (25 rows)
does not divide by 2 and the non-chief replica starts from another seed. examples/mlp_jax.py runs as
a user runs it, under ``stratagem launch --worker 2`` and alone, and prints the same figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install jax): stratagem.jax is not tested")
jnp = jax.numpy

import stratagem  # noqa: E402
from stratagem.core.errors import ConfigurationError  # noqa: E402
from stratagem.launch.launcher import launch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).parent / "scripts" / "jax_adapter_train.py"
STEPS = 20
TOLERANCE = 1e-6
NAMES = ["hidden/b", "hidden/w", "out/b", "out/w"]
THREADS = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

pytestmark = pytest.mark.timeout(240)


def alone_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    return {**env, **THREADS}


def max_abs_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) == NAMES
    return max(float(np.abs(a[k] - b[k]).max()) for k in NAMES)


@pytest.mark.parametrize("strategy, update", [("mirrored", "adam"), ("mirrored", "own"), ("between_graph", "adam")])
def test_two_replicas_equal_single_process_jax(strategy, update, tmp_path):
    reference = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", str(STEPS),
                                "--update", update, "--reference"],
                               capture_output=True, text=True, timeout=120, env=alone_env())
    assert reference.returncode == 0, reference.stdout + reference.stderr
    expected, initial = dict(np.load(tmp_path / "reference.npz")), dict(np.load(tmp_path / "initial.npz"))
    assert max_abs_diff(expected, initial) > 1e-2     # training moved the parameters far beyond the tolerance

    result = launch([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--strategy", strategy,
                     "--steps", str(STEPS), "--update", update],
                    workers=2, ps=1 if strategy == "between_graph" else 0, timeout=150, env=THREADS)
    assert result.ok, result.summary()
    for index in range(2):
        params = dict(np.load(tmp_path / f"worker_{index}.npz"))
        assert max_abs_diff(params, expected) <= TOLERANCE, max_abs_diff(params, expected)
        log = json.loads((tmp_path / f"worker_{index}.json").read_text())
        assert log["rows"] == [13 - index] * STEPS              # 25 rows = 13 + 12
        assert log["names"] == NAMES                            # variables named by their pytree paths
        assert log["broadcast"] == [1.0, 1.0, 1.0]              # broadcast_parameters: replica 1's tree


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn is not installed (no digits data)")
def test_example_mlp_jax_learns_and_two_processes_print_what_one_does():
    outputs = []
    for workers in (2, None):
        command = [sys.executable, str(ROOT / "examples" / "mlp_jax.py"), "--epochs", "2"]
        if workers:
            command = [sys.executable, "-m", "stratagem", "launch", "--worker", str(workers), "--timeout", "150",
                       "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=200, env=alone_env())
        assert result.returncode == 0, result.stdout + result.stderr
        outputs.append(result.stdout)
    figures = [re.findall(r"(?:loss|test accuracy) (\d\.\d+)", out) for out in outputs]
    assert figures[0] == figures[1] and figures[0], outputs
    losses = [float(x) for x in re.findall(r"step +\d+  loss (\d\.\d+)", outputs[1])]
    assert losses[-1] < losses[0]
    assert float(re.search(r"final test accuracy (\d\.\d+)", outputs[1]).group(1)) > 0.9
    assert "2 replica(s)" in outputs[0] and "1 replica(s)" in outputs[1]


# -- in one process (a world of one) ------------------------------------------------------------------

@pytest.fixture
def strategy():
    with stratagem.strategy("mirrored", transport="zmq") as strategy:
        yield strategy


def test_tree_variables_names_copies_and_checks(strategy):
    import stratagem.jax as sj

    params = {"layers": [{"w": jnp.ones((2, 2))}, {"w": jnp.zeros(3)}], "scale": jnp.float32(2.0)}
    with strategy.scope():
        tree = sj.TreeVariables(params, prefix="net/")
        opt = stratagem.optimizers.SGD(learning_rate=0.5)
    assert tree.names == ["net/layers/0/w", "net/layers/1/w", "net/scale"]
    values = tree.values()
    assert jax.tree_util.tree_structure(values) == jax.tree_util.tree_structure(params)
    tree.apply_gradients(opt, jax.tree_util.tree_map(jnp.ones_like, params))
    # values() gave copies: the arrays handed out before the step still hold the old values.
    assert float(values["layers"][0]["w"][0, 0]) == 1.0
    assert float(tree.values()["layers"][0]["w"][0, 0]) == 0.5 and float(tree.values()["scale"]) == 1.5
    reduced = tree.reduce_gradients(jax.tree_util.tree_map(jnp.ones_like, params))   # a world of one: as given
    assert float(reduced["scale"]) == 1.0
    with pytest.raises(ConfigurationError, match="is not the parameters'"):
        tree.apply_gradients(opt, {"layers": [jnp.ones((2, 2))]})
    assert float(sj.broadcast_parameters({"x": jnp.ones(2)}, strategy=strategy)["x"][0]) == 1.0


def test_tree_variables_need_a_strategy():
    import stratagem.jax as sj

    with pytest.raises(ConfigurationError, match="needs a strategy"):
        sj.TreeVariables({"w": jnp.ones(2)})


def test_readme_jax_section_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    after = text[text.index("### JAX"):]
    start = after.index("```python\n") + len("```python\n")
    (tmp_path / "train.py").write_text(after[start:after.index("\n```", start)])
    result = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--worker", "2", "--timeout", "150", "--",
                             sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=200, env=alone_env())
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"task:\d (\S+)", result.stdout)]
    assert len(losses) == 2 and max(losses) < 1e-3, result.stdout     # it learned y = 3 x0 + 1
