"""The training examples run as a user runs them: under `stratagem launch` (2 real processes over zmq)
and alone (a world of one), on small configurations; their output is checked.

- examples/linear_regression.py: W and b end near 0.1 and 0.3; a run resumed from its checkpoint
  ends exactly where an uninterrupted run does.
- examples/mlp_digits.py (needs scikit-learn): test accuracy above 90% after 3 epochs.
- examples/mlp_torch.py (needs PyTorch and scikit-learn): the loss goes down, the accuracy goes up.

The examples seed everything and the mirrored replicas apply the update one process would make, so a
2-process run and a run alone print the same figures (to float rounding).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.timeout(240)

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                   reason="scikit-learn is not installed (pip install scikit-learn): no digits data")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="PyTorch is not installed (pip install torch)")

#: One math thread per process: the replicas share the machine's cores (and other tests run beside them).
THREADS = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def run_example(script: str, *args: str, workers: int | None) -> str:
    """Run ``examples/<script>`` under ``stratagem launch --worker N`` or, with ``workers=None``, alone;
    return its stdout (asserting it succeeded)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    env.update(THREADS)
    command = [sys.executable, str(EXAMPLES / script), *args]
    if workers is not None:
        command = [sys.executable, "-m", "stratagem", "launch", "--worker", str(workers), "--timeout", "150",
                   "--", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def chief_lines(stdout: str) -> list[str]:
    """The chief's lines, without the launcher's ``[worker:0] `` prefix. Only the chief prints."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert not [line for line in lines if line.startswith("[worker:") and not line.startswith("[worker:0]")], \
        f"a non-chief replica printed:\n{stdout}"
    return [re.sub(r"^\[worker:0\] ", "", line) for line in lines]


def final_w_b(stdout: str) -> tuple[float, float]:
    match = re.search(r"final W = (\S+), b = (\S+) ", stdout)
    assert match, stdout
    return float(match.group(1)), float(match.group(2))


def accuracies(stdout: str) -> list[float]:
    return [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", stdout)]


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"step +\d+  loss (\d+\.\d+)", stdout)]


# -- linear regression -----------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [2, None], ids=["launch-2", "alone"])
def test_linear_regression_learns_w_and_b(workers):
    out = run_example("linear_regression.py", "--steps", "150", "--log-every", "50", workers=workers)
    lines = chief_lines(out)
    assert lines[0].startswith(f"{workers or 1} replica(s) over zmq")
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["50", "100", "150"]
    w, b = final_w_b(out)
    assert abs(w - 0.1) < 2e-3 and abs(b - 0.3) < 2e-3, (w, b)


def test_linear_regression_resumes_from_its_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    # 3 replicas and a global batch of 10: shards of 4, 3 and 3 rows.
    first = run_example("linear_regression.py", "--steps", "40", "--batch", "10", "--ckpt", str(ckpt),
                        "--save-every", "20", workers=3)
    assert "restored" not in first
    assert (ckpt / "ckpt-00000040.npz").is_file() and (ckpt / "latest").is_file()
    resumed = run_example("linear_regression.py", "--steps", "80", "--batch", "10", "--ckpt", str(ckpt), workers=2)
    assert "restored step 40 from" in resumed
    assert f"saved {ckpt / 'ckpt-00000080.npz'}" in resumed
    # Seeded per step and weighted by rows: the same as 80 uninterrupted steps in one process.
    straight = run_example("linear_regression.py", "--steps", "80", "--batch", "10", workers=None)
    assert final_w_b(resumed) == pytest.approx(final_w_b(straight), abs=2e-6)


# -- the digits MLP in numpy --------------------------------------------------------------------------

@needs_sklearn
@pytest.mark.parametrize("workers", [2, None], ids=["launch-2", "alone"])
def test_mlp_digits_reaches_90_percent(workers):
    out = run_example("mlp_digits.py", "--epochs", "3", "--log-every", "10", workers=workers)
    lines = chief_lines(out)
    assert f"{workers or 1} replica(s) over zmq" in lines[0]
    acc = accuracies(out)
    assert len(acc) == 1 + 3 + 1                    # before training, after each epoch, final
    assert acc[0] < 0.3                             # untrained: about chance
    assert acc[-1] > 0.90, out
    loss = losses(out)
    assert len(loss) >= 5 and loss[-1] < loss[0] / 2, loss


# -- the same MLP in PyTorch --------------------------------------------------------------------------

@needs_sklearn
@needs_torch
@pytest.mark.parametrize("workers", [2, None], ids=["launch-2", "alone"])
def test_mlp_torch_loss_decreases(workers):
    out = run_example("mlp_torch.py", "--epochs", "2", "--log-every", "5", workers=workers)
    lines = chief_lines(out)
    assert f"{workers or 1} replica(s) over zmq" in lines[0]
    loss = losses(out)
    assert len(loss) == 9                           # steps 5, 10, ..., 45 of 2 x 23
    assert loss[-1] < loss[0] / 2, loss
    assert max(loss[-3:]) < min(loss[:3]), loss
    assert accuracies(out)[-1] > 0.85, out
