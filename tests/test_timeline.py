"""Timelines with real processes: `stratagem launch --timeline`, `STRATAGEM_TIMELINE`, and
`stratagem timeline merge|summary` on what the tasks wrote.

The tasks run tests/scripts/timeline_train.py, the plain script a user writes (no close(), no
shutdown(), no `with`, no main guard), under mirrored over zmq and under between_graph with a ps
task. Every process is started with a timeout, and the launcher reaps its tasks (each dies with it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.launch.launcher import launch
from stratagem.timeline.merge import load

SCRIPT = Path(__file__).parent / "scripts" / "timeline_train.py"
STRATAGEM = [sys.executable, "-m", "stratagem"]
#: Seconds a launched job may take, start-up included (2 shared cores).
LIMIT = 90

pytestmark = [pytest.mark.skipif(os.name != "posix", reason="the launcher uses POSIX process groups"),
              pytest.mark.timeout(150)]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
    return env


def _run(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=LIMIT + 30)


def _launch_cli(tmp_path: Path, trace: str, workers: int, ps: int, *script_args: str) -> subprocess.CompletedProcess:
    return _run([*STRATAGEM, "launch", "--timeline", trace, "--worker", str(workers), "--ps", str(ps),
                 "--transport", "zmq", "--timeout", str(LIMIT), "--", sys.executable, str(SCRIPT), *script_args],
                tmp_path)


def _events(doc: dict) -> dict[str, list[dict]]:
    """The complete events of a merged trace, by task (checked: one named process track per task)."""
    tasks = {entry["pid"]: entry["task"] for entry in doc["otherData"]["stratagem_timeline"]["tasks"]}
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == tasks
    by_task: dict[str, list[dict]] = {task: [] for task in tasks.values()}
    for event in doc["traceEvents"]:
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0, event
            by_task[tasks[event["pid"]]].append(event)
    return by_task


def _of(events: list[dict], category: str, name: str | None = None) -> list[dict]:
    return [e for e in events if e["cat"] == category and (name is None or e["name"] == name)]


def _report(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


def _check_clocks(doc: dict) -> None:
    """Every task measured its offset to the chief; on one host the true offset is ~0, and the NTP
    bound says it lies within the uncertainty (the rest: the anchors' reads, NTP slewing)."""
    for entry in doc["otherData"]["stratagem_timeline"]["tasks"]:
        assert entry["clock"] in ("reference", "measured"), entry
        assert abs(entry["offset_ns"]) <= entry["uncertainty_ns"] + 1_000_000, entry


# -- recording and merging -------------------------------------------------------------------------


def test_launch_timeline_mirrored_records_every_phase_of_every_task(tmp_path):
    proc = _launch_cli(tmp_path, "trace.json", 3, 0, "mirrored")
    assert proc.returncode == 0, _report(proc)
    assert "timeline of 3 task(s) in" in proc.stderr, _report(proc)
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]        # the tasks' own files are merged, then removed
    doc = load(str(tmp_path / "trace.json"), "merged")
    by_task = _events(doc)
    assert list(by_task) == [f"/job:worker/task:{i}" for i in range(3)]
    _check_clocks(doc)
    for task, events in by_task.items():
        others = sorted(t for t in by_task if t != task)
        assert len(_of(events, "step", "step")) == 6
        assert len(_of(events, "sync", "apply_gradients")) == 6
        assert len(_of(events, "optimizer")) == 6
        packs = _of(events, "pack")
        assert len(packs) == 6 and all(p["args"]["bytes"] == 4 * 50_010 for p in packs)
        allreduces = [e for e in _of(events, "collective", "allreduce") if e["args"]["bytes"] == 4 * 50_010]
        assert len(allreduces) == 6, _of(events, "collective")
        assert all(sorted(e["args"]["peers"]) == others and e["args"]["op"] == "sum" for e in allreduces)
        assert _of(events, "collective", "broadcast")                # the chief's initial values
        waits = _of(events, "wait")
        assert waits and {w["args"]["peer"] for w in waits} <= set(others)
        step = _of(events, "step")[-1]                               # phases nest inside their step
        inside = [e for e in events if step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3]
        assert {"sync", "pack", "collective", "optimizer"} <= {e["cat"] for e in inside}


def test_launch_timeline_between_graph_records_pushes_and_the_ps_task(tmp_path):
    proc = _launch_cli(tmp_path, "trace.json", 2, 1, "between_graph:sync")
    assert proc.returncode == 0, _report(proc)
    doc = load(str(tmp_path / "trace.json"), "merged")
    by_task = _events(doc)
    assert list(by_task) == ["/job:worker/task:0", "/job:worker/task:1", "/job:ps/task:0"]
    _check_clocks(doc)
    for task in ("/job:worker/task:0", "/job:worker/task:1"):
        events = by_task[task]
        assert len(_of(events, "step")) == 6 and len(_of(events, "pack")) == 6
        pushes = _of(events, "ps", "push")
        assert len(pushes) == 6
        for push in pushes:
            assert push["args"]["peers"] == ["/job:ps/task:0"]
            assert push["args"]["bytes_sent"] == 4 * 50_010          # the gradients
            assert push["args"]["bytes_received"] == 4 * 50_010      # the values, back with the acknowledgement
        assert {w["args"]["peer"] for w in _of(events, "wait")} == {"/job:ps/task:0"}
    ps = by_task["/job:ps/task:0"]
    assert len(_of(ps, "serve", "push")) == 12
    assert len(_of(ps, "optimizer")) == 6                             # sync: one update per round of 2
    assert {w["args"]["peer"] for w in _of(ps, "wait")} == {"/job:worker/task:0", "/job:worker/task:1"}


def test_timeline_files_written_under_any_launcher_merge_from_the_command_line(tmp_path):
    """``STRATAGEM_TIMELINE=DIR/{task}.json`` (no ``--timeline``), then ``stratagem timeline merge``."""
    (tmp_path / "run").mkdir()
    result = launch([sys.executable, str(SCRIPT), "mirrored"], workers=2, transport="zmq", timeout=LIMIT,
                    env={"STRATAGEM_TIMELINE": str(tmp_path / "run" / "{task}.json"), "OMP_NUM_THREADS": "1"},
                    output=open(os.devnull, "w"), error_output=open(os.devnull, "w"))
    assert result.ok, result.summary()
    files = sorted(str(p) for p in (tmp_path / "run").iterdir())
    assert [os.path.basename(f) for f in files] == ["worker-0.json", "worker-1.json"]
    for path in files:                                               # each task's file is a trace of its own
        assert load(path, "task")["otherData"]["stratagem_timeline"]["ended"] is None
    proc = _run([*STRATAGEM, "timeline", "merge", "merged.json", *files], tmp_path)
    assert proc.returncode == 0, _report(proc)
    assert list(_events(load(str(tmp_path / "merged.json"), "merged"))) == ["/job:worker/task:0", "/job:worker/task:1"]


# -- the summary -----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, ps", [("mirrored", 0), ("between_graph:sync", 1)])
def test_summary_names_the_worker_that_sleeps_in_its_step_as_the_straggler(tmp_path, strategy, ps):
    proc = _launch_cli(tmp_path, "trace.json", 3, ps, strategy, "worker:1", "0.15")
    assert proc.returncode == 0, _report(proc)
    summary = _run([*STRATAGEM, "timeline", "summary", "trace.json"], tmp_path)
    assert summary.returncode == 0, _report(summary)
    assert "straggler: /job:worker/task:1: the other tasks spent" in summary.stdout, summary.stdout
    for task in ("/job:worker/task:0", "/job:worker/task:1", "/job:worker/task:2"):
        assert any(line.startswith(task) and "waited on:" in line for line in summary.stdout.splitlines()), \
            summary.stdout
    report = json.loads(_run([*STRATAGEM, "timeline", "summary", "--json", "trace.json"], tmp_path).stdout)
    assert report["straggler"]["task"] == "/job:worker/task:1"
    assert set(report["straggler"]["by"]) == {"/job:worker/task:0", "/job:worker/task:2"}
    slow, fast = report["tasks"]["/job:worker/task:1"], report["tasks"]["/job:worker/task:0"]
    assert slow["steps"] == fast["steps"] == 6
    # The sleeper computes (sleeps) while the others wait on it: their waits are charged to it.
    assert max(slow["breakdown_s"], key=slow["breakdown_s"].get) == "compute"
    assert max(fast["breakdown_s"], key=fast["breakdown_s"].get) == "wait"
    assert max(fast["waits_by_cause_s"], key=fast["waits_by_cause_s"].get) == "/job:worker/task:1"


# -- how a script ends -----------------------------------------------------------------------------


def test_a_script_that_raises_still_writes_its_timeline(tmp_path):
    """A world of one (no launcher, no cluster): the uncaught exception ends the script mid-training."""
    path = tmp_path / "mine.json"
    proc = _run([sys.executable, str(SCRIPT), "mirrored", "-", "0", "worker:0"], tmp_path,
                STRATAGEM_TIMELINE=str(path), STRATAGEM_TRANSPORT="zmq")
    assert proc.returncode == 1 and "worker:0 failed on purpose" in proc.stderr, _report(proc)
    doc = load(str(path), "task")
    meta = doc["otherData"]["stratagem_timeline"]
    assert meta["task"] == "/job:worker/task:0" and meta["strategy"] == "mirrored"
    assert meta["ended"] == "RuntimeError: worker:0 failed on purpose"
    assert len([e for e in doc["traceEvents"] if e.get("cat") == "step"]) == 3


def test_a_job_where_one_task_raises_still_merges_every_task(tmp_path):
    proc = _launch_cli(tmp_path, "trace.json", 3, 0, "mirrored", "-", "0", "worker:2")
    assert proc.returncode == 1, _report(proc)
    doc = load(str(tmp_path / "trace.json"), "merged")
    ended = {t["task"]: t["ended"] for t in doc["otherData"]["stratagem_timeline"]["tasks"]}
    assert ended["/job:worker/task:2"] == "RuntimeError: worker:2 failed on purpose", ended
    assert set(ended) == {f"/job:worker/task:{i}" for i in range(3)}          # the others wrote theirs too
    assert all(ended[f"/job:worker/task:{i}"] for i in range(2)), ended       # ... ending by the lost peer


# -- bad input -------------------------------------------------------------------------------------


def test_an_unwritable_timeline_path_fails_at_once_naming_the_variable(tmp_path):
    missing = tmp_path / "no-such-dir" / "t.json"
    proc = _run([sys.executable, str(SCRIPT), "mirrored"], tmp_path, STRATAGEM_TIMELINE=str(missing),
                STRATAGEM_TRANSPORT="zmq")
    assert proc.returncode == 1, _report(proc)
    assert "TimelineError" in proc.stderr and f"STRATAGEM_TIMELINE={missing}" in proc.stderr, proc.stderr
    assert "does not exist" in proc.stderr and "trained" not in proc.stdout

    launched = _launch_cli(tmp_path, str(missing), 2, 0, "mirrored")
    assert launched.returncode == 2, _report(launched)
    assert "--timeline" in launched.stderr and "does not exist" in launched.stderr, launched.stderr


def test_summary_and_merge_refuse_bad_files_with_the_reason(tmp_path):
    (tmp_path / "broken.json").write_text('{"traceEvents": [')
    (tmp_path / "other.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "folder.json").mkdir()
    cases = {
        "missing.json": "does not exist",
        "broken.json": "is not valid JSON",
        "other.json": "is not a Stratagem timeline",
        "folder.json": "is a directory",
    }
    for name, reason in cases.items():
        for command in (["timeline", "summary", name], ["timeline", "merge", "out.json", name]):
            proc = _run([*STRATAGEM, *command], tmp_path)
            assert proc.returncode == 1, _report(proc)
            assert f"stratagem timeline: error: " in proc.stderr and reason in proc.stderr and name in proc.stderr, \
                proc.stderr
    assert not (tmp_path / "out.json").exists()


def test_merge_refuses_an_unwritable_output_and_the_same_task_twice(tmp_path):
    path = tmp_path / "w.json"
    proc = _run([sys.executable, str(SCRIPT), "mirrored"], tmp_path, STRATAGEM_TIMELINE=str(path),
                STRATAGEM_TRANSPORT="zmq")
    assert proc.returncode == 0, _report(proc)
    unwritable = _run([*STRATAGEM, "timeline", "merge", str(tmp_path / "nowhere" / "out.json"), str(path)], tmp_path)
    assert unwritable.returncode == 1 and "cannot write the merged timeline" in unwritable.stderr, _report(unwritable)
    twice = _run([*STRATAGEM, "timeline", "merge", "out.json", str(path), str(path)], tmp_path)
    assert twice.returncode == 1 and "two timeline files for /job:worker/task:0" in twice.stderr, _report(twice)
    usage = _run([*STRATAGEM, "timeline", "merge", "out.json"], tmp_path)
    assert usage.returncode == 2 and "TASK.json" in usage.stderr, _report(usage)


def test_the_cli_documents_the_timeline():
    def help_of(*command: str) -> str:
        proc = subprocess.run([*STRATAGEM, *command, "--help"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "--timeline TRACE.json" in help_of("launch")
    assert "merge" in help_of("timeline") and "summary" in help_of("timeline")
    assert "clock" in help_of("timeline", "merge")
    assert "straggler" in help_of("timeline", "summary")
