"""The examples run as a user runs them: under `stratagem launch`, as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("workers", [1, 3])
def test_allreduce_demo_under_launch(workers):
    # The README's all-reduce example, on a smaller tensor; the launcher gives the job a fresh secret, so
    # this also runs the authenticated handshake between real processes.
    result = subprocess.run(
        [sys.executable, "-m", "stratagem", "launch", "--worker", str(workers), "--timeout", "90", "--",
         sys.executable, str(ROOT / "examples" / "allreduce_demo.py"), "--length", "1000003", "--iters", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"over {workers} ranks via zmq: result check PASSED" in result.stdout
    assert result.stdout.count("local check ok") == workers
    assert "bus bandwidth" in result.stdout


def test_allreduce_demo_alone_is_a_world_of_one():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "allreduce_demo.py"), "--length", "17"],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "over 1 ranks via zmq: result check PASSED" in result.stdout
