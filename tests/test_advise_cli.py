"""``stratagem advise`` end to end: real measurement jobs on a local cluster (small, quick settings),
the recommendation and the JSON document, and clear errors for bad options and bad models.

The figures themselves depend on the machine and its load, so the tests check their structure and
their consistency (every setup asked for is predicted, the recommendation is the fastest one, the
ps placement matches the model), never their values; benchmarks/advise_validation.py compares the
predictions with ``stratagem bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
SMALL = "advise_models:build_small"
pytestmark = pytest.mark.timeout(240)


def advise(*args, timeout=200, cwd=None):
    """Run ``python -m stratagem advise ARGS``; the completed process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "stratagem", "advise", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def run_plain_script(directory: Path, measured: str, ending: str) -> subprocess.CompletedProcess:
    """Run PLAIN_SCRIPT (below) with ``measured`` (``measure``, or a ``--measured`` file) and ``ending``."""
    script = directory / "advise_script.py"
    script.write_text(PLAIN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script), measured, ending], capture_output=True, text=True,
                          timeout=200, env=env)


def printed_document(stdout: str) -> tuple[dict, str]:
    """The JSON document PLAIN_SCRIPT printed, and what it printed after it."""
    head, _, tail = stdout.rpartition("}\n")
    return json.loads(head + "}"), tail


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One quick measurement of the small model over zmq, as ``--json`` (reused by the tests below):
    measured by the plain script a user writes, which then raises (checked by
    test_the_plain_script_a_user_writes[raise]); (document, its file, stderr, the completed script)."""
    directory = tmp_path_factory.mktemp("advise")
    proc = run_plain_script(directory, "measure", "raise")
    assert "exit 0" in proc.stdout, proc.stdout + proc.stderr
    doc, _ = printed_document(proc.stdout)
    path = directory / "advice.json"
    path.write_text(json.dumps(doc))
    return doc, path, proc.stderr, proc


def test_a_quick_run_measures_predicts_and_recommends(measured):
    doc, _, stderr, _ = measured
    assert "machine:" in stderr and "link: zmq" in stderr           # progress goes to stderr
    m = doc["measurements"]
    assert set(m["transports"]) == {"zmq"}
    assert "in-process only" in m["skipped"]["local"]               # listed with the reason, not measured
    assert m["host"]["cores"] == len(os.sched_getaffinity(0))
    work = m["workload"]
    assert work["name"] == "small-mlp" and work["batch_size"] == 32
    assert work["param_bytes"] == 4 * (32 * 64 + 64 + 64 * 10 + 10)
    # the strategies' round-robin placement over the sorted names b0, b1, w0, w1: ps:0 gets b0 and w0
    assert work["shards"]["2"] == [4 * (64 + 32 * 64), 4 * (10 + 64 * 10)]
    assert work["compute_s"] > 0 and work["update_s_per_byte"] > 0
    zmq = m["transports"]["zmq"]
    for link in ("allreduce", "p2p", "ps"):
        assert zmq[link]["latency_s"] > 0 and zmq[link]["bandwidth_Bps"] > 0
    # every strategy x ps count asked for, once, fastest first, the first one recommended
    labels = sorted((p["label"], p["ps"]) for p in doc["predictions"])
    assert labels == sorted([("mirrored", 0), ("in_graph", 0)] + [
        (f"{s}:{mode}", ps) for s in ("between_graph", "parameter_server") for mode in ("sync", "async")
        for ps in (1, 2)])
    rates = [p["samples_per_s"] for p in doc["predictions"]]
    assert rates == sorted(rates, reverse=True)
    # the rows to the target loss were measured (sync and async, from 1 replica up), and the
    # recommendation is the setup first to reach it (the fastest in samples/s if none does)
    conv = m["convergence"]
    assert conv["target_loss"] > 0 and conv["sync"][0][0] == 1 and conv["async_"][0][0] == 1
    assert conv["sync"][0][1] == conv["async_"][0][1] > 0          # one replica: no staleness, same run
    to_target = [p["time_to_target_s"] for p in doc["predictions"]]
    reached = [(t, i) for i, t in enumerate(to_target) if t is not None]
    first = doc["predictions"][min(reached)[1] if reached else 0]
    best = doc["recommendation"]
    assert (best["label"], best["ps"]) == (first["label"], first["ps"])
    assert best["reason"].startswith(f"{best['label']} over zmq")
    for p in doc["predictions"]:
        assert p["step_ms"] == pytest.approx(p["workers"] * 32 / p["samples_per_s"] * 1e3)
        assert p["tasks"] == p["workers"] + p["ps"] + (p["strategy"] == "parameter_server")


def test_each_strategys_steps_are_measured_through_the_strategy(measured):
    """The steps probe ran each strategy for real (a ps task, a coordinator, replicas): its step
    less the compute costs time and CPU, and the between_graph step more than the bare exchange."""
    from stratagem.advise import probe

    doc, _, stderr, _ = measured
    assert "steps: between_graph:sync over zmq" in stderr
    m = doc["measurements"]
    raw = m["raw"]["links"]["zmq"]["steps"]
    assert sorted((d["strategy"], d["consistency"] or "", d["workers"], d["ps"]) for d in raw) == [
        ("between_graph", "async", 2, 1), ("between_graph", "sync", 2, 1), ("in_graph", "", 2, 0),
        ("parameter_server", "async", 1, 1), ("parameter_server", "async", 2, 1)]
    for mode in ("sync", "async"):
        job = next(d for d in raw if d["consistency"] == mode)
        assert sorted(job["tasks"]) == ["ps-0", "worker-1"]         # the other tasks' figures, beside the chief's
        assert len(job["tasks"]["worker-1"]["wall_s"]) == len(job["wall_s"])
    alone = next(d for d in raw if d["consistency"] == "async")["alone"]     # the chief's steps before the others'
    assert len(alone["wall_s"]) == len(alone["cpu_s"]) > 0
    crowded = next(d for d in raw if d["strategy"] == "parameter_server" and d["workers"] == 2)
    assert {task.split(":")[0] for task in crowded["workers_of"]} == {"worker"} and len(set(crowded["workers_of"])) == 2
    steps = probe.fit_steps(raw)
    for figure in (steps.ps_sync, steps.ps_async, steps.ps_async_crowded, steps.coordinator,
                   steps.coordinator_crowded, steps.in_graph):
        assert figure.wall_s > 0 and figure.cpu_s > 0
    for figure in (steps.coordinator, steps.coordinator_crowded):
        assert figure.dispatch_s > 0 and figure.dispatch_cpu_s > 0
    for figure in (steps.ps_sync, steps.ps_async, steps.ps_async_crowded, steps.coordinator, steps.coordinator_crowded):
        assert figure.serve_cpu_s > 0                               # the ps task's CPU clock, read around the steps
    # what the model charges: the part the links do not explain, none negative and none above what
    # was measured (whether anything is left depends on this machine's load, so no sign is asserted);
    # refitting the saved raw figures charges the same
    charged = m["transports"]["zmq"]["steps"]
    assert all(0 <= c["cpu_s"] <= c["wall_s"] for c in charged.values())
    for name in ("ps_sync", "ps_async", "ps_async_crowded", "coordinator", "coordinator_crowded"):
        assert charged[name]["wall_s"] <= getattr(steps, name).wall_s
    refit = probe.fit(m["raw"]).transports["zmq"].steps
    assert charged["ps_async"]["wall_s"] == pytest.approx(refit.ps_async.wall_s)
    assert charged["coordinator"]["dispatch_s"] == pytest.approx(refit.coordinator.dispatch_s)
    for p in doc["predictions"]:
        if p["label"] == "between_graph:async" and "ps exchange" in p["parts_ms"]:
            assert p["parts_ms"]["ps exchange"] > charged["ps_async"]["wall_s"] * 1e3
        if p["label"] == "parameter_server:async" and "dispatch" in p["parts_ms"]:
            assert p["parts_ms"]["dispatch"] >= charged["coordinator"]["dispatch_s"] * 1e3 * (1 - 1e-9)


def test_the_table_shows_the_recommendation(measured):
    _, path, _, _ = measured
    proc = advise("--measured", str(path), "--worker", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "predicted for 3 workers here" in out
    recommended = [line for line in out.splitlines() if line.startswith("recommended: ")]
    assert len(recommended) == 1 and " over zmq" in recommended[0]
    assert "not measured: local: in-process only" in out
    assert "convergence (this process" in out and "s to loss" in out
    own = out.splitlines()[out.splitlines().index("a step's own work beyond the links (ms, measured through each strategy):") + 1]
    assert own.startswith("  zmq: async ") and "sync round of 2" in own and "dispatch" in own and "per remote replica" in own


def test_predict_workers_extrapolates_with_stated_assumptions(measured):
    _, path, _, _ = measured
    proc = advise("--measured", str(path), "--predict-workers", "64,256,1024", "--bandwidth", "25Gbit",
                  "--latency", "20us", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    ex = doc["extrapolation"]
    assert set(ex["workers"]) == {"64", "256", "1024"}
    assert ex["network"] == {"bandwidth_Bps": 25e9 / 8, "latency_s": 20e-6}
    assert any("one task per host" in a for a in ex["assumptions"])
    for n, entry in ex["workers"].items():
        assert all(p["workers"] == int(n) and not p["colocated"] for p in entry["predictions"])
    # one ps shard's link carries every worker's push and pull: PS sync slows as workers are added
    fan_in = {n: next(p for p in ex["workers"][n]["predictions"] if p["label"] == "between_graph:sync"
                      and p["ps"] == 1)["parts_ms"]["ps fan-in"] for n in ("64", "1024")}
    assert fan_in["1024"] > 10 * fan_in["64"]
    text = advise("--measured", str(path), "--predict-workers", "64,1024").stdout
    assert "extrapolated to 64, 1024 workers" in text and "assumptions: one task per host" in text


@pytest.mark.parametrize("args, message", [
    (["--predict-workers", "0"], "--predict-workers: every value must be at least 1, got 0"),
    (["--predict-workers", "64,lots"], "--predict-workers: 'lots' is not a whole number"),
    (["--worker", "0"], "--worker must be at least 1, got 0"),
    (["--ps", "0"], "--ps: every value must be at least 1, got 0"),
    (["--strategies", "mirored"], "--strategies: the cost model knows mirrored, in_graph, between_graph, "
                                  "parameter_server, not 'mirored'"),
    (["--bandwidth", "25Gbit"], "--bandwidth and --latency describe the network of --predict-workers"),
    (["--predict-workers", "64", "--bandwidth", "fast"], "--bandwidth: cannot read 'fast'"),
    (["--model", "no_such_module:build"], "cannot import 'no_such_module' for --model no_such_module:build"),
    (["--model", "advise_models:nope"], "--model advise_models:nope: advise_models has no callable 'nope'"),
    (["--model", "advise_models:build_broken_step"], "--model advise_models:build_broken_step: "
                                                     "loss_and_grads(params, batch) raised ValueError: shapes do not match"),
    (["--transports", "zmqq"], "--transports: "),
    (["--measured", "/nonexistent/advice.json"], "--measured: no such file"),
])
def test_bad_options_are_usage_errors_that_say_why(args, message):
    proc = advise(*args, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr


def test_a_model_failing_inside_a_probe_task_fails_the_run_with_its_error():
    proc = advise("--quick", "--model", "advise_models:build_fails_in_task", "--transports", "zmq")
    assert proc.returncode == 1
    assert "the machine probe over zmq failed" in proc.stderr
    assert "boom inside a probe task (on purpose)" in proc.stderr


def test_links_measured_on_a_job_are_used_instead_of_local_ones(measured, tmp_path):
    """--probe-links runs as every task of a job (here a local one: 3 workers and a ps), --links uses it."""
    _, path, _, _ = measured
    links = tmp_path / "links.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    job = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--worker", "3", "--ps", "1", "--timeout", "150",
                          "--", sys.executable, "-m", "stratagem", "advise", "--probe-links", str(links),
                          "--transports", "zmq", "--quick", "--model", SMALL],
                         capture_output=True, text=True, timeout=200, env=env)
    assert job.returncode == 0, job.stderr
    raw = json.loads(links.read_text())
    assert raw["np"] == 3 and len(raw["pairs"]) == 3 and raw["ps_exchange"]
    proc = advise("--measured", str(path), "--links", str(links), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["measurements"]["raw"]["links_from_files"]["zmq"]["np"] == 3
    # the links come from the job; the strategies' own work per step, measured here, stays
    assert doc["measurements"]["transports"]["zmq"]["steps"] == json.loads(path.read_text())["measurements"]["transports"]["zmq"]["steps"]
    text = advise("--measured", str(path), "--links", str(links)).stdout
    assert "zmq's links from --links: 3 tasks, 3 pairs timed" in text


@pytest.mark.parametrize("args, message", [
    (["--probe-links", "x.json", "--transports", "zmq"], "--probe-links runs as every task of a job of at least two"),
    (["--probe-links", "x.json", "--transports", "zmq,grpc"], "--probe-links measures one transport at a time"),
    (["--links", "/nonexistent/links.json"], "--links: no such file"),
])
def test_link_options_say_what_is_wrong(args, message):
    proc = advise(*args, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr


PLAIN_SCRIPT = """
import sys
from stratagem.advise.cli import main

if sys.argv[1] == "measure":   # measure for real: the probe jobs run, and are over when the script goes on
    code = main(["--quick", "--model", "advise_models:build_small", "--transports", "zmq,local",
                 "--worker", "2", "--ps", "1,2", "--json"])
else:
    code = main(["--measured", sys.argv[1], "--worker", "2", "--json"])
print("exit", code)
if sys.argv[2] == "raise":
    raise RuntimeError("the script fails after advising")
"""


@pytest.mark.parametrize("ending", ["normally", "raise"])
def test_the_plain_script_a_user_writes(measured, tmp_path, ending):
    _, path, _, measuring = measured
    # raise: the module's measurement, which the script made for real and then failed after
    proc = run_plain_script(tmp_path, str(path), ending) if ending == "normally" else measuring
    doc, tail = printed_document(proc.stdout)
    assert doc["recommendation"]["reason"]
    assert tail.strip() == "exit 0"
    if ending == "normally":
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1
        assert "RuntimeError: the script fails after advising" in proc.stderr


def test_help_documents_the_command():
    proc = subprocess.run([sys.executable, "-m", "stratagem", "advise", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    for option in ("--predict-workers", "--model", "--quick", "--json", "--measured", "--bandwidth"):
        assert option in proc.stdout
    top = subprocess.run([sys.executable, "-m", "stratagem", "--help"], capture_output=True, text=True, timeout=60)
    assert "advise" in top.stdout


def test_hosts_predicts_for_the_described_cluster_with_its_links(measured):
    """``--hosts 2 --link RATE``: the costs measured here, the links modelled by placement: a slower
    link predicts every setup that crosses it slower, a faster one nothing slower; the document and
    the table say the cluster."""
    _, path, _, _ = measured
    docs = {}
    for rate in ("1mbit", "10gbit"):
        proc = advise("--measured", str(path), "--worker", "2", "--ps", "1", "--hosts", "2", "--link", rate,
                      "--strategies", "mirrored,between_graph:sync,parameter_server:sync", "--json")
        assert proc.returncode == 0, proc.stderr
        docs[rate] = json.loads(proc.stdout)
    assert docs["1mbit"]["hosts"]["count"] == 2 and docs["1mbit"]["hosts"]["link_bps"] == 10**6
    here = {(p["label"], p["ps"]): p["samples_per_s"] for p in measured[0]["predictions"] if p["transport"] == "zmq"}
    slow, fast = ({(p["label"], p["ps"]): p["samples_per_s"] for p in docs[r]["predictions"]}
                  for r in ("1mbit", "10gbit"))
    assert set(slow) == {("mirrored", 0), ("between_graph:sync", 1), ("parameter_server:sync", 1)}
    # The small model moves ~11 KB a step: at 100mbit most of it passes the emulated link's token bucket
    # (96 KiB) at once; at 1mbit the wire decides plainly.
    for setup in slow:
        assert slow[setup] < fast[setup] <= here[setup] * 1.0001, (setup, slow[setup], fast[setup], here[setup])
    text = advise("--measured", str(path), "--worker", "2", "--ps", "1", "--hosts", "4", "--link", "1gbit",
                  "--cores-per-host", "8").stdout
    assert "predicted for 2 workers on 4 hosts, links 1gbit, 8 cores each" in " ".join(text.split())


@pytest.mark.parametrize("args, message", [
    (["--link", "1gbit"], "--link: only with --hosts N"),
    (["--hosts", "2", "--link", "fast"], "link rate 'fast'"),
    (["--hosts", "2", "--predict-workers", "64"], "give one of them"),
    (["--hosts", "2", "--bandwidth", "1gbit"], "--link RATE"),
    (["--hosts", "2", "--cores-per-host", "0"], "--cores-per-host must be"),
])
def test_hosts_options_say_what_is_wrong(args, message):
    proc = advise(*args, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr
