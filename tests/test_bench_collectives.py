"""``stratagem bench collectives`` end to end (real processes, a tiny config), and its size parsing.

The end-to-end runs use 2 processes, sizes 4K and 64K and a few iterations: zmq, the in-process
``local`` transport (which must be listed as skipped, with the reason) and one baseline when one
can run here (mpi4py starts faster than torch, so it is preferred).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from stratagem.bench import collectives
from stratagem.bench.units import SizeError, human_bytes, human_rate, parse_size, parse_sizes

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the launcher uses POSIX process groups")


def _command() -> list[str]:
    """``stratagem bench collectives`` once the CLI has it, else the module (the same code)."""
    from stratagem.cli import SUBCOMMANDS

    if "bench" in SUBCOMMANDS:
        return [sys.executable, "-m", "stratagem", "bench", "collectives"]
    return [sys.executable, "-m", "stratagem.bench.collectives"]


def _bench(tmp_path, *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    proc = subprocess.run([*_command(), *args, "--json", str(out)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert out.exists(), f"no JSON written (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


def _fast_baseline() -> str | None:
    for name in ("mpi4py", "gloo"):
        if collectives.baseline_contender(name).skip is None:
            return name
    return None


# -- end to end ------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_bench_reports_every_size_with_consistent_bandwidth(tmp_path):
    baseline = _fast_baseline()
    proc, doc = _bench(tmp_path, "--np", "2", "--sizes", "4K,64K", "--iters", "5", "--warmup", "1",
                       "--transports", "zmq,local", "--baselines", baseline or "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = {j["label"]: j for j in doc["jobs"]}
    ran = ["zmq"] + ([baseline] if baseline else [])
    assert set(jobs) == {"local", *ran}

    # The in-process transport cannot run a rank per process: listed as skipped, with the reason.
    assert jobs["local"]["status"] == "skipped" and "in-process" in jobs["local"]["reason"]
    assert "skipped local" in proc.stdout and "in-process" in proc.stdout

    for label in ran:
        job = jobs[label]
        assert job["status"] == "ok" and job["np"] == 2, job
        assert [s["bytes"] for s in job["sizes"]] == [4096, 65536]
        for s in job["sizes"]:
            assert s["correct"] is True
            assert len(s["times_s"]) == 5 and all(t > 0 for t in s["times_s"])
            assert 0 < s["min_s"] <= s["median_s"]
            assert s["algbw_GBps"] == pytest.approx(s["data_bytes"] / s["median_s"] / 1e9)
            assert s["busbw_GBps"] == pytest.approx(s["algbw_GBps"] * 2 * (2 - 1) / 2)
        assert label in proc.stdout
    assert doc["collective"] == "allreduce" and doc["plan"][0] == {"bytes": 4096, "warmup": 1, "iters": 5}
    assert set(doc["fastest"]["2"]) == {"4096", "65536"} and doc["fastest"]["2"]["4096"] in ran

    env = doc["environment"]
    assert env["cores"]["logical"] >= 1 and env["versions"]["numpy"] and env["python"]
    assert env["cluster"]["np"] == [2] and env["date"]
    # The table is on stdout, the progress on stderr.
    assert "busbw" in proc.stdout and "4K" in proc.stdout and "64K" in proc.stdout
    assert "[1/" in proc.stderr


@pytest.mark.timeout(90)
def test_a_failing_job_is_reported_and_the_rest_still_run(tmp_path):
    baseline = _fast_baseline()
    # chunk_bytes=-1 is refused by the communicator in every rank: the zmq job fails.
    proc, doc = _bench(tmp_path, "--np", "2", "--sizes", "4K", "--iters", "3", "--warmup", "1",
                       "--transports", "zmq", "--baselines", baseline or "none", "--set", "chunk_bytes=-1")
    assert proc.returncode == 1
    jobs = {j["label"]: j for j in doc["jobs"]}
    assert jobs["zmq"]["status"] == "failed" and "exited with code" in jobs["zmq"]["reason"]
    assert any("chunk_bytes" in line for line in jobs["zmq"]["output_tail"])
    assert "failed zmq" in proc.stdout
    if baseline:
        assert jobs[baseline]["status"] == "ok" and jobs[baseline]["sizes"][0]["correct"]


@pytest.mark.timeout(60)
def test_a_job_that_runs_too_long_is_stopped_at_the_timeout(tmp_path):
    started = time.monotonic()
    proc, doc = _bench(tmp_path, "--np", "2", "--sizes", "4K", "--iters", "1000000", "--warmup", "1",
                       "--transports", "zmq", "--baselines", "none", "--timeout", "3")
    assert time.monotonic() - started < 30
    assert proc.returncode == 1
    (job,) = doc["jobs"]
    assert job["status"] == "timed out" and "timed out" in job["reason"], job
    assert "timed out zmq" in proc.stdout


def test_usage_errors_name_the_problem(tmp_path):
    for args, words in ((["--transports", "zmqq"], "did you mean 'zmq'"),
                        (["--baselines", "nccl-tests"], "unknown baseline"),
                        (["--np", "1"], "2 or more"),
                        (["--sizes", "6"], "multiples of 4")):
        proc = subprocess.run([*_command(), *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr)


# -- units -----------------------------------------------------------------------------------------


def test_parse_sizes_ranges_and_lists():
    assert parse_sizes("4K-256M") == [4 << 10 << 2 * k for k in range(9)]
    assert parse_sizes("4K-32Kx2") == [4096, 8192, 16384, 32768]
    assert parse_sizes("4K-128M")[-3:] == [16 << 20, 64 << 20, 128 << 20]  # the end is always included
    assert parse_sizes("64M, 4K,1M,4K") == [4096, 1 << 20, 64 << 20]
    assert parse_sizes("4K-16K,1G") == [4096, 16384, 1 << 30]
    assert parse_sizes("4096") == [4096]
    assert parse_size("1GiB") == parse_size("1g") == 1 << 30


@pytest.mark.parametrize("text, message", [
    ("", "no sizes"),
    (" , ", "no sizes"),
    ("64K-4K", "goes down: write the smaller size first (4K-64K)"),
    ("4K-64Kx1", "step x1 must be 2 or more"),
    ("4Q", "not a size: '4Q'"),
    ("1.5M", "write 1536K"),
    ("-4K", "not a size"),
    ("4K-", "not a size"),
    ("0", "at least 1 byte"),
])
def test_parse_sizes_errors_say_what_is_wrong(text, message):
    with pytest.raises(SizeError) as info:
        parse_sizes(text)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)  # callers may catch ValueError


def test_human_units():
    assert [human_bytes(n) for n in (100, 4096, 1536, 64 << 20, 1 << 30)] == ["100B", "4K", "1.5K", "64M", "1G"]
    assert [human_rate(r) for r in (2.5e9, 850e6, 12.34e9)] == ["2.50 GB/s", "850 MB/s", "12.3 GB/s"]
