"""``stratagem bench`` end to end on tiny configurations: real clusters of processes, the JSON checked.
Every default strategy runs over zmq, grpc and mpi (where they can run here); over mpi, mirrored's
all-reduce is MPI's own, booked at what a ring moves.

Bytes per step are checked exactly against what the model's size implies for each strategy (the
linear model: 8 bytes of parameters W and b; P below), with 2 replicas and 1 ps task:

- mirrored: a ring (or recursive-doubling) all-reduce: each replica sends 2(N-1)/N P: 2(N-1) P in all;
- between_graph and parameter_server: each replica pushes P and pulls P: 2 N P;
- in_graph: the client sends P of values to and gets P of gradients from each remote replica, plus
  their shards of the global batch (N x batch rows): 2 (N-1) P + (N-1) x batch rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.bench import measure, plan
from stratagem.core.errors import ConfigurationError

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.timeout(240)


def bench(tmp_path, *args, timeout=200):
    """Run ``stratagem bench ARGS --json``; (exit code, JSON document, stdout, stderr)."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
               BENCH_TEST_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "stratagem", "bench", *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    document = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, document, proc.stdout, proc.stderr


def by_label(document) -> dict:
    return {r["label"]: r for r in document["results"]}


def expected_bytes(doc, transport: str) -> dict:
    """Bytes per global step of each default strategy, from the model's size (see the module doc)."""
    p, n, batch = doc["config"]["param_bytes"], doc["config"]["workers"], doc["config"]["batch_size"]
    assert p == 8 and n == 2 and batch == 100
    return {
        f"mirrored x {transport}": 2 * (n - 1) * p,
        # + the remote replicas' shards of the global batch: (N-1) x batch rows of x and y (float32)
        f"in_graph x {transport}": 2 * (n - 1) * p + (n - 1) * batch * 8,
        f"between_graph:sync x {transport}": 2 * n * p,
        f"between_graph:async x {transport}": 2 * n * p,
        f"parameter_server:async x {transport}": 2 * n * p,
    }


def check_ran(doc, expected: dict) -> None:
    results = by_label(doc)
    for label, bytes_per_step in expected.items():
        r = results[label]
        assert r["status"] == "ok", (label, r)
        assert r["samples_per_s"] > 0 and r["step_ms"] > 0 and 0 <= r["compute_ms"] <= r["step_ms"]
        assert r["bytes_per_step"] == pytest.approx(bytes_per_step), label
        assert r["final_loss"] < r["first_loss"], label                # it trained


@pytest.mark.parametrize("transport", ["grpc", "mpi"])
def test_every_default_strategy_runs_over_the_other_transports(tmp_path, transport):
    from stratagem.bench.availability import check_transport

    why = check_transport(transport).skip
    if why:
        pytest.skip(why)
    code, doc, _, stderr = bench(tmp_path, "--model", "linear", "--steps", "10", "--warmup", "2",
                                 "--transports", transport)
    assert code == 0, stderr
    check_ran(doc, expected_bytes(doc, transport))


def test_every_default_strategy_runs_and_its_figures_make_sense(tmp_path):
    code, doc, stdout, stderr = bench(tmp_path, "--model", "linear", "--steps", "14", "--warmup", "2",
                                      "--transports", "zmq,local")
    assert code == 0, stderr
    results = by_label(doc)
    expected = expected_bytes(doc, "zmq")
    check_ran(doc, expected)
    for label in expected:
        r = results[label]
        assert r["loss_curve"] and all(t >= 0 for t, _ in r["loss_curve"])
        assert r["cluster"]["ps"] == (1 if "graph:" in label or "server" in label else 0)
    assert results["parameter_server:async x zmq"]["cluster"]["chief"] == 1   # the coordinator
    # local runs inside one process: listed as skipped, with the reason
    skipped = results["mirrored x local"]
    assert skipped["status"] == "skipped" and "in-process only" in skipped["reason"]
    assert doc["fastest"] in expected
    assert doc["environment"]["cores"] and doc["environment"]["versions"]
    # the busiest replica's own CPU over its timed steps, in cores (the replicas' rows carry it)
    assert 0 < results["mirrored x zmq"]["task_cores_max"] <= doc["environment"]["cores"]["logical"]
    # the table names every combination that ran, and the skipped ones with their reason
    for label in expected:
        strategy, transport = label.split(" x ")
        assert any(line.split()[:2] == [strategy, transport] for line in stdout.splitlines()), stdout
    assert "skipped (5):" in stdout and "in-process only" in stdout
    assert "[5/10]" in stderr   # progress, combination n of m


def test_the_sparse_model_moves_rows_on_parameter_servers_and_the_table_on_mirrored(tmp_path):
    code, doc, _, stderr = bench(tmp_path, "--model", "embedding", "--steps", "6", "--warmup", "1",
                                 "--transports", "zmq",
                                 "--strategies", "mirrored,between_graph:async,parameter_server:async")
    assert code == 0, stderr
    results, p = by_label(doc), doc["config"]["param_bytes"]
    assert results["mirrored x zmq"]["bytes_per_step"] == pytest.approx(2 * p)   # the whole table
    # Per worker step (2 workers per global step) the rows it gathers (64 bags of 8 ids: at most 512
    # rows of 64 bytes) and their int64 indices, then their gradient rows and indices, and the dense
    # head and bias: not the 6.4 MB table (24.4 MB per step before the servers moved rows).
    rows_at_most = 2 * (512 * (8 + 64 + 8 + 64) + 1024)
    for label in ("between_graph:async x zmq", "parameter_server:async x zmq"):
        assert 0 < results[label]["bytes_per_step"] <= rows_at_most < p / 40, label


def test_a_failing_and_a_hanging_combination_are_reported_and_the_rest_run(tmp_path):
    code, doc, stdout, _ = bench(tmp_path, "--model", "bench_models:build_failing", "--steps", "6",
                                 "--warmup", "1", "--transports", "zmq",
                                 "--strategies", "mirrored,between_graph:async")
    assert code == 1
    results = by_label(doc)
    assert results["mirrored x zmq"]["status"] == "failed"
    assert any("RuntimeError: boom" in line for line in results["mirrored x zmq"]["errors"])
    assert "RuntimeError: boom" in stdout
    assert results["between_graph:async x zmq"]["status"] == "failed"
    assert "failed (2):" in stdout

    # Each hanging job waits out its whole --timeout: 8 s, several times what a job takes to reach the
    # hang (replica 1's third step, about 1 s after its launch; 2 to 3 s on a loaded machine).
    code, doc, stdout, _ = bench(tmp_path, "--model", "bench_models:build_hanging", "--steps", "6",
                                 "--warmup", "1", "--transports", "zmq", "--strategies", "in_graph,mirrored",
                                 "--timeout", "8")
    assert code == 1
    for label in ("in_graph x zmq", "mirrored x zmq"):
        r = by_label(doc)[label]
        assert r["status"] == "timeout" and "stopped after 8 s" in r["reason"], r
    assert "timeout (2):" in stdout
    hung = [int(p.name.split("-")[1]) for p in tmp_path.glob("hung-*")]
    assert hung
    for pid in hung:   # every hung task was reaped
        assert not Path(f"/proc/{pid}").exists()


def test_plot_writes_a_png_of_throughput_and_loss_curves(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install 'stratagem[bench]')")
    png = tmp_path / "bench.png"
    code, doc, _, stderr = bench(tmp_path, "--model", "linear", "--steps", "6", "--warmup", "1",
                                 "--transports", "zmq", "--strategies", "mirrored,between_graph:sync",
                                 "--plot", str(png))
    assert code == 0, stderr
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 1000 and height > 400


def test_compression_adds_rows_with_their_bytes_and_time_to_loss(tmp_path):
    code, doc, stdout, stderr = bench(tmp_path, "--strategies", "mirrored,in_graph,between_graph:sync",
                                      "--transports", "zmq", "--compression", "none,fp16,topk", "--model", "linear",
                                      "--steps", "20", "--warmup", "2")
    assert code == 0, stdout + stderr
    assert doc["config"]["compression"] == ["none", "fp16", "topk"]
    results = by_label(doc)
    # linear: W and b, 4 bytes each (P = 8). fp16 halves every gradient; topk keeps k = 1 entry of each
    # variable as an int32 index and a float32 value (8 bytes), all-gathered under mirrored; the ps
    # strategies compress the pushes only (the pulls stay P per replica).
    check_ran(doc, {"mirrored x zmq": 16, "mirrored x zmq + fp16": 8, "mirrored x zmq + topk": 32,
                    "between_graph:sync x zmq": 32, "between_graph:sync x zmq + fp16": 24,
                    "between_graph:sync x zmq + topk": 48, "in_graph x zmq": 816})
    assert results["mirrored x zmq + topk"]["compression"] == "topk"
    assert results["mirrored x zmq"]["compression"] is None
    assert results["in_graph x zmq + topk"]["status"] == "skipped"
    assert "in_graph cannot compress gradients" in results["in_graph x zmq + topk"]["reason"]
    header = next(line for line in stdout.splitlines() if "samples/s" in line)
    assert header.split()[:3] == ["strategy", "transport", "compression"] and "bytes/step" in header
    assert "to loss" in header


def test_a_classifier_reports_its_test_accuracy_for_every_compressor(tmp_path):
    code, doc, stdout, stderr = bench(tmp_path, "--model", "bench_models:build_tiny_mlp", "--strategies", "mirrored",
                                      "--transports", "zmq", "--compression", "none,fp16", "--steps", "40")
    assert code == 0, stdout + stderr
    results = by_label(doc)
    plain, fp16 = results["mirrored x zmq"]["test_accuracy"], results["mirrored x zmq + fp16"]["test_accuracy"]
    # 4 classes: 25% by chance at the start; 40 steps of the same data take both far above it, fp16's
    # rounding (2^-11 relative) changes a few of the 1024 points at most
    assert plain > 0.6 and fp16 > 0.6 and abs(plain - fp16) <= 0.02, (plain, fp16)
    header = next(line for line in stdout.splitlines() if "samples/s" in line)
    assert "test acc" in header and f"{100 * plain:.1f}%" in stdout


def test_a_misspelt_compressor_is_a_usage_error_naming_the_known_ones(tmp_path):
    code, document, stdout, stderr = bench(tmp_path, "--compression", "none,topkk", timeout=60)
    assert code == 2 and document is None
    assert "--compression: unknown compressor 'topkk'; known: bf16, fp16, powersgd, topk (did you mean 'topk'?)" in stderr


def test_bad_options_are_refused_with_the_fix(tmp_path):
    code, _, _, stderr = bench(tmp_path, "--strategies", "between_graph:eventually")
    assert code == 2 and "use async, sync or bounded" in stderr
    code, _, _, stderr = bench(tmp_path, "--model", "nosuchmodel")
    assert code == 2 and "linear, mlp, wide, embedding" in stderr
    code, _, _, stderr = bench(tmp_path, "--model", "bench_models:build_incomplete")
    assert code == 2 and "lacks name, batch_size" in stderr
    code, _, _, stderr = bench(tmp_path, "--steps", "3", "--warmup", "3")
    assert code == 2 and "--warmup (3) must be less than --steps (3)" in stderr


@pytest.mark.parametrize("args, message", [
    (["--strategies", "mirored"], "--strategies: unknown strategy 'mirored'; known: "),
    (["--strategies", "mirrored,parameter_server:sync,in_grpah"], "unknown strategy 'in_grpah'"),
    (["--transports", "zqm"], "--transports: unknown transport 'zqm'; known: "),
])
def test_a_misspelt_strategy_or_transport_is_a_usage_error_with_a_did_you_mean(tmp_path, args, message):
    code, document, stdout, stderr = bench(tmp_path, *args, timeout=60)
    assert code == 2, stdout + stderr
    assert message in stderr and "(did you mean '" in stderr, stderr
    assert document is None and "samples/s" not in stdout        # no (empty) table, nothing run


def test_plan_lists_what_cannot_run_and_why():
    from stratagem.plugins.manager import plugin_manager

    combos = plan.plan(plan.parse_strategies("mirrored,between_graph:sync,parameter_server"),
                       ["zmq", "local"], workers=2, ps=0, manager=plugin_manager())
    reasons = {c.label: c.skipped for c in combos}
    assert reasons["mirrored x zmq"] is None
    assert "--ps 1 or more" in reasons["between_graph:sync x zmq"]
    assert "--ps 1 or more" in reasons["parameter_server:async x zmq"]
    assert "in-process only" in reasons["mirrored x local"]
    with pytest.raises(ConfigurationError, match=r"unknown transport 'nosuch'; known: .*zmq"):
        plan.plan(plan.parse_strategies("mirrored"), ["zmq", "nosuch"], workers=2, ps=0, manager=plugin_manager())
    with pytest.raises(ConfigurationError, match="mirrored takes no mode"):
        plan.parse_strategies("mirrored:sync")


def _step(task, t0, t1, loss, rows=10, compute=0.001, nbytes=100):
    return {"task": task, "t0": t0, "t1": t1, "loss": loss, "rows": rows, "compute_s": compute,
            "step_s": t1 - t0, "bytes": nbytes}


def test_summarize_gives_the_busiest_replicas_cores_over_its_timed_steps():
    # worker:0 uses 0.05 s of CPU per 0.1 s step (half a core), worker:1 0.02 s; warm-up steps
    # (the first 2) burn a whole second of CPU each and must not count.
    records = []
    for task, per_step in (("worker:0", 0.05), ("worker:1", 0.02)):
        cpu = 0.0
        for i in range(12):
            cpu += 1.0 if i < 2 else per_step
            records.append({**_step(task, i * 0.1, i * 0.1 + 0.1, 1.0), "cpu": cpu})
    figures = measure.summarize(records, replicas=2, batch_size=10, warmup=2, target_loss=None)
    assert figures["task_cores_max"] == pytest.approx(0.5)
    assert measure.summarize([{k: v for k, v in r.items() if k != "cpu"} for r in records], replicas=2,
                             batch_size=10, warmup=2, target_loss=None)["task_cores_max"] is None


def test_summarize_counts_only_the_shared_window_and_finds_the_target():
    # worker:1 starts 1 s late; from then on both run 10 rows per 0.1 s: 200 rows/s together.
    records = [_step("worker:0", i * 0.1, i * 0.1 + 0.1, 1.0 / (i + 1)) for i in range(30)]
    records += [_step("worker:1", 1 + i * 0.1, 1 + i * 0.1 + 0.1, 1.0 / (i + 1)) for i in range(20)]
    figures = measure.summarize(records, replicas=2, batch_size=10, warmup=2, target_loss=0.2, smooth=1)
    assert figures["samples_per_s"] == pytest.approx(200.0)
    assert figures["bytes_per_step"] == pytest.approx(200.0)   # 100 per replica step, 2 per global step
    assert figures["time_to_target_s"] == pytest.approx(0.5)   # worker:0's 5th step ends at 0.5 s: loss 0.2
    assert figures["step_ms"] == pytest.approx(100.0)
    figures = measure.summarize(records, replicas=2, batch_size=10, warmup=2, target_loss=1e-9)
    assert figures["time_to_target_s"] is None


def _running_tasks(mark: str) -> list[int]:
    """The bench's training tasks that carry ``mark`` in their environment (this test's, none other)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"train_task" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"BENCH_STOP_MARK={mark}".encode() in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_whole_bench_not_only_its_current_job(tmp_path, sig):
    """SIGTERM (or Ctrl-C) to ``stratagem bench`` stops the running job and the bench with it, exiting
    143 (130): the combinations after it do not run (before, the launcher took the signal as the job's
    and the bench went on with the next one)."""
    import signal
    import time
    import uuid

    mark = uuid.uuid4().hex
    env = dict(os.environ, BENCH_STOP_MARK=mark)
    proc = subprocess.Popen([sys.executable, "-m", "stratagem", "bench", "--strategies", "mirrored",
                             "--transports", "zmq,grpc", "--steps", "1000000", "--timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not _running_tasks(mark) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running_tasks(mark), "the first combination's tasks never started"
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + getattr(signal, sig), err
    assert f"stopped by {sig}: 2 not finished" in err
    assert "mirrored x grpc" not in err         # the second combination never started
    assert not _running_tasks(mark)              # and the first one's tasks were reaped
