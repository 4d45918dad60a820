"""Equivalence for the PyTorch MLP of examples/mlp_torch.py.

N mirrored replicas (N = 2, 3), real processes under ``stratagem.launch.launcher.launch`` over zmq, train
the example's torch module (parameters are views of stratagem Variables; gradients from
``loss.backward()`` go through ``opt.apply_gradients``) with stratagem's SGD on their shards of each
global batch. They must end with the parameters that one process gets by training the same module on
whole global batches with plain ``torch.optim.SGD`` (no stratagem at all), to float32 tolerance, and
be bitwise identical to each other after every step. The global batch (25 rows) divides by neither 2
nor 3, so the shards are unequal and the gradient average must weigh them by their rows.

Each process writes its parameters to files (tests/scripts/torch_mlp_train.py); the test compares them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch): the torch example is not tested")

from stratagem.launch.launcher import launch  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "torch_mlp_train.py"
STEPS, BATCH = 15, 25
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")

pytestmark = pytest.mark.timeout(240)


#: One math thread per process: the replicas share the machine's cores.
THREADS = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def child_env() -> dict:
    """The environment of a process that is alone (no cluster from the environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    return {**env, **THREADS}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_reference")
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(STEPS),
                             "--batch", str(BATCH), "--reference"],
                            capture_output=True, text=True, timeout=180, env=child_env())
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(np.load(out / "reference.npz")), dict(np.load(out / "initial.npz"))


@pytest.mark.parametrize("n", [2, 3])
def test_mirrored_torch_replicas_match_one_plain_torch_process(n, reference, tmp_path):
    expected, initial = reference
    # Training moved the parameters well beyond the tolerance, so matching them means something.
    assert max(float(np.abs(expected[k] - initial[k]).max()) for k in NAMES) > 1e-2

    result = launch([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", str(STEPS),
                     "--batch", str(BATCH)], workers=n, timeout=180, env=THREADS)
    assert result.ok, result.summary()

    params = [dict(np.load(tmp_path / f"worker_{i}.npz")) for i in range(n)]
    logs = [json.loads((tmp_path / f"worker_{i}.json").read_text()) for i in range(n)]
    for log in logs:
        assert log["replicas"] == n and log["iterations"] == STEPS
    # Every replica saw its shard: rows split like np.array_split (25 = 13 + 12, 9 + 8 + 8).
    assert [log["rows"][0] for log in logs] == [len(part) for part in np.array_split(np.arange(BATCH), n)]
    # The replicas hold the same bits after every step (the chief's initial values won at the start).
    for log in logs[1:]:
        assert log["fingerprints"] == logs[0]["fingerprints"]
    for other in params[1:]:
        for name in NAMES:
            np.testing.assert_array_equal(other[name], params[0][name], err_msg=name)
    # ... and they match one plain PyTorch process trained on the whole batches.
    assert sorted(params[0]) == sorted(NAMES)
    for name in NAMES:
        np.testing.assert_allclose(params[0][name], expected[name], err_msg=name, **TOLERANCE)
