"""``stratagem k8s manifest``: Kubeflow TFJob / MPIJob manifests and the Secret beside them.

Three kinds of check, on the manifests the command writes (run as a user runs it, a subprocess):

- **schema**: every object is read through the OpenAPI models of the Kubeflow training SDK
  (``kubeflow-training``: ``KubeflowOrgV1TFJob``, ``KubeflowOrgV1MPIJob``, ``KubeflowOrgV1ReplicaSpec``,
  generated from the operator's API) and of the Kubernetes client (``V1PodTemplateSpec``,
  ``V1Container``, ``V1Secret``, ...), strictly: a field the model does not have, a value of the wrong
  type or a missing required field fails. The enumerations the models leave as plain strings
  (replica types, restart and clean-pod policies) are checked against the operator's documented values.
- **what the operator injects**: each TFJob pod's ``TF_CONFIG`` is made as the training operator
  makes it (its cluster lists every replica of every type by service, ``NAME-TYPE-INDEX.NAMESPACE.svc``
  with the port of the ``tfjob-port`` port of the ``tensorflow`` container, type lowercased; the task is
  the pod's type and index), the secret is read from the Secret through the pod's ``secretKeyRef``, and
  ``ClusterResolver.from_env()`` must resolve the job's cluster, the pod's task and the secret. For an
  MPIJob: the operator's hostfile (``NAME-worker-I slots=S``) must hold the ranks ``mpirun -np`` starts,
  and every rank (``OMPI_COMM_WORLD_RANK``, plus what ``-x`` forwards) must resolve its task; the
  launcher's ``mpirun`` options also run for real, with this machine's MPI (skipped without one).
- the command line: files written 0600, YAML and JSON alike, usage errors that say what to fix.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem import ClusterResolver, ClusterSpec, TaskId
from stratagem.transport_kit.ports import bind_host

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-" + "ab" * 16

#: Values the operator accepts where the generated models only say "str" (from its API reference).
TF_REPLICA_TYPES = {"Chief", "Master", "Worker", "PS", "Evaluator"}
MPI_REPLICA_TYPES = {"Launcher", "Worker"}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
CLEAN_POD_POLICIES = {"All", "Running", "None"}


def manifest(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
                "STRATAGEM_SECRET": SECRET, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "stratagem", "k8s", "manifest", *args], capture_output=True,
                          text=True, timeout=60, env=full_env, stdin=subprocess.DEVNULL)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def documents(*args: str, **kwargs) -> list[dict]:
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifests (pip install pyyaml)")
    return [d for d in yaml.safe_load_all(manifest(*args, **kwargs).stdout) if d is not None]


# -- strict reading through the OpenAPI models -----------------------------------------------------


def _model_class(name: str):
    training = pytest.importorskip("kubeflow.training.models",
                                   reason="the Kubeflow training SDK holds the CRDs' models (pip install kubeflow-training)")
    client = pytest.importorskip("kubernetes.client", reason="pip install kubernetes")
    for module in (training, client.models):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"no OpenAPI model named {name}")


def read_as(value, type_name: str, path: str = "$"):
    """``value`` (parsed JSON/YAML) read as the OpenAPI type ``type_name``; fails on anything the
    schema does not allow. Returns the model instance (constructing it runs the model's own checks:
    required fields, enumerations it knows)."""
    if type_name.startswith("list[") and type_name.endswith("]"):
        assert isinstance(value, list), f"{path}: expected a list, got {value!r}"
        return [read_as(v, type_name[5:-1], f"{path}[{i}]") for i, v in enumerate(value)]
    if type_name.startswith("dict(") and type_name.endswith(")"):
        inner = type_name[5:-1].split(",", 1)[1].strip()
        assert isinstance(value, dict), f"{path}: expected a mapping, got {value!r}"
        return {k: read_as(v, inner, f"{path}.{k}") for k, v in value.items()}
    scalars = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    if type_name in scalars:
        assert isinstance(value, scalars[type_name]) and not (type_name == "int" and isinstance(value, bool)), \
            f"{path}: expected {type_name}, got {value!r}"
        return value
    if type_name == "object":
        return value
    model = _model_class(type_name)
    assert isinstance(value, dict), f"{path}: expected a {type_name} mapping, got {value!r}"
    by_json_key = {json_key: attr for attr, json_key in model.attribute_map.items()}
    unknown = sorted(set(value) - set(by_json_key))
    assert not unknown, f"{path}: {type_name} has no field(s) {unknown}"
    kwargs = {by_json_key[k]: read_as(v, model.openapi_types[by_json_key[k]], f"{path}.{k}") for k, v in value.items()}
    try:
        return model(**kwargs)
    except ValueError as exc:  # a required field missing, a value out of the model's enumeration
        raise AssertionError(f"{path}: not a valid {type_name}: {exc}") from None


MODELS = {("v1", "Secret"): "V1Secret", ("kubeflow.org/v1", "TFJob"): "KubeflowOrgV1TFJob",
          ("kubeflow.org/v1", "MPIJob"): "KubeflowOrgV1MPIJob"}


def validate(doc: dict):
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in MODELS, f"unexpected object {key}"
    obj = read_as(doc, MODELS[key])
    if doc["kind"] in ("TFJob", "MPIJob"):
        specs = doc["spec"]["tfReplicaSpecs" if doc["kind"] == "TFJob" else "mpiReplicaSpecs"]
        allowed = TF_REPLICA_TYPES if doc["kind"] == "TFJob" else MPI_REPLICA_TYPES
        assert set(specs) <= allowed, f"replica types {sorted(specs)} not among {sorted(allowed)}"
        assert doc["spec"]["runPolicy"].get("cleanPodPolicy", "None") in CLEAN_POD_POLICIES
        for rtype, spec in specs.items():
            assert spec["restartPolicy"] in RESTART_POLICIES, rtype
            assert spec["replicas"] >= 1, rtype
            names = [c["name"] for c in spec["template"]["spec"]["containers"]]
            if doc["kind"] == "TFJob":
                assert "tensorflow" in names, f"{rtype}: the operator looks for a container named tensorflow"
    return obj


def test_validation_is_strict():
    """The reader refuses what the operator's schema refuses (it can fail)."""
    pytest.importorskip("kubeflow.training")
    job = documents("--image", "img:1", "--", "python3", "train.py")[1]
    validate(job)
    replica = job["spec"]["tfReplicaSpecs"]["Worker"]
    for mutate, message in [
        (lambda j: j["spec"]["tfReplicaSpecs"]["Worker"].update(replica_count=2), "has no field(s) ['replica_count']"),
        (lambda j: j["spec"]["tfReplicaSpecs"]["Worker"].update(replicas="2"), "expected int"),
        (lambda j: j["spec"].pop("tfReplicaSpecs"), "tf_replica_specs"),
        (lambda j: j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("name"), "name"),
        (lambda j: j["spec"]["tfReplicaSpecs"].update(Workers=replica), "replica types"),
        (lambda j: j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"][0]
         ["valueFrom"]["secretKeyRef"].update(keys="x"), "has no field(s) ['keys']"),
    ]:
        broken = json.loads(json.dumps(job))
        mutate(broken)
        with pytest.raises(AssertionError, match=re.escape(message)):
            validate(broken)


# -- TFJob -----------------------------------------------------------------------------------------


def operator_tf_config(tfjob: dict, rtype: str, index: int) -> str:
    """TF_CONFIG as the training operator writes it into the pod ``rtype``/``index`` of ``tfjob``."""
    name, namespace = tfjob["metadata"]["name"], tfjob["metadata"].get("namespace", "default")
    cluster = {}
    for replica_type, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        if replica_type == "Evaluator":
            continue  # not part of the training cluster
        port = 2222
        for container in spec["template"]["spec"]["containers"]:
            if container["name"] == "tensorflow":
                port = next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == "tfjob-port"), 2222)
        rt = replica_type.lower()
        cluster[rt] = [f"{name}-{rt}-{i}.{namespace}.svc:{port}" for i in range(spec["replicas"])]
    return json.dumps({"cluster": cluster, "task": {"type": rtype.lower(), "index": index}, "environment": "cloud"})


def pod_env(container: dict, secrets: dict[str, dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: values, and secretKeyRefs read from ``secrets``."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
    return env


@pytest.mark.parametrize("chief", [False, True])
def test_tfjob_matches_the_schema_and_every_pod_resolves_the_cluster(chief):
    docs = documents("--worker", "4", "--ps", "2", *(["--chief"] if chief else []), "--image", "registry.example/train:1",
                     "--name", "mnist", "--namespace", "team-a", "--transport", "grpc", "--cpu", "2", "--memory", "4Gi",
                     "--gpus", "1", "--", "python3", "train.py", "--epochs", "3")
    secret, job = docs
    assert [d["kind"] for d in docs] == ["Secret", "TFJob"]
    for doc in docs:
        validate(doc)
    assert secret["metadata"] == {**secret["metadata"], "name": "mnist-secret", "namespace": "team-a"}
    assert secret["stringData"] == {"STRATAGEM_SECRET": SECRET}
    assert SECRET not in json.dumps(job)  # the secret is in the Secret only, never in the job's spec

    expected_jobs = {**({"chief": 1} if chief else {}), "worker": 4, "ps": 2}
    expected = ClusterSpec({job_name: [f"mnist-{job_name}-{i}.team-a.svc:2222" for i in range(n)]
                            for job_name, n in expected_jobs.items()})
    specs = job["spec"]["tfReplicaSpecs"]
    assert {rtype.lower(): s["replicas"] for rtype, s in specs.items()} == expected_jobs
    seen = []
    for rtype, spec in specs.items():
        container = spec["template"]["spec"]["containers"][0]
        assert container["command"] == ["python3", "train.py", "--epochs", "3"]
        assert container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") == (None if rtype == "PS" else "1")
        for index in range(spec["replicas"]):
            env = {**pod_env(container, {"mnist-secret": secret}), "TF_CONFIG": operator_tf_config(job, rtype, index)}
            resolved = ClusterResolver.from_env(env)
            assert resolved.cluster == expected
            assert resolved.task == TaskId(rtype.lower(), index)
            assert resolved.secret == SECRET.encode()
            assert resolved.source == "TF_CONFIG"
            assert env["STRATAGEM_TRANSPORT"] == "grpc"
            # A service name is no address of the pod: the task listens on every interface, port 2222.
            assert bind_host(resolved.cluster.address(resolved.task).rsplit(":", 1)[0]) == "0.0.0.0"
            seen.append(resolved.task)
    assert sorted(seen) == sorted(expected.tasks())
    assert expected.chief == (TaskId("chief", 0) if chief else TaskId("worker", 0))


def test_an_existing_secret_is_referenced_not_written(tmp_path):
    docs = documents("--worker", "2", "--image", "img:1", "--secret-name", "team-secret", "--secret-key", "token",
                     "--", "python3", "train.py")
    assert [d["kind"] for d in docs] == ["TFJob"]
    validate(docs[0])
    container = docs[0]["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["env"][0] == {"name": "STRATAGEM_SECRET",
                                   "valueFrom": {"secretKeyRef": {"name": "team-secret", "key": "token"}}}
    assert SECRET not in json.dumps(docs)


# -- MPIJob ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers,ps,slots", [(4, 2, 1), (3, 0, 2)])
def test_mpijob_matches_the_schema_and_every_rank_resolves_its_task(workers, ps, slots):
    docs = documents("--mpi", "--worker", str(workers), "--ps", str(ps), "--slots-per-worker", str(slots),
                     "--image", "img:1", "--name", "hvd", "--env", "EPOCHS=3", "--", "python3", "train.py")
    secret, job = docs
    assert [d["kind"] for d in docs] == ["Secret", "MPIJob"]
    for doc in docs:
        validate(doc)
    assert SECRET not in json.dumps(job)
    specs = job["spec"]["mpiReplicaSpecs"]
    ranks = workers + ps
    assert specs["Launcher"]["replicas"] == 1
    assert specs["Worker"]["replicas"] == math.ceil(ranks / slots)
    assert job["spec"]["slotsPerWorker"] == slots

    # The hostfile the operator writes for the launcher: one line per worker pod, its slots.
    hostfile = [f"hvd-worker-{i} slots={slots}" for i in range(specs["Worker"]["replicas"])]
    assert sum(int(line.rsplit("=", 1)[1]) for line in hostfile) >= ranks

    launcher = specs["Launcher"]["template"]["spec"]["containers"][0]
    command = launcher["command"]
    assert command[:5] == ["mpirun", "--hostfile", "/etc/mpi/hostfile", "-np", str(ranks)]
    assert command[-2:] == ["python3", "train.py"]
    forwarded = [command[i + 1] for i, arg in enumerate(command) if arg == "-x"]
    assert {"STRATAGEM_SECRET", "STRATAGEM_NUM_PS", "STRATAGEM_TRANSPORT", "EPOCHS"} <= set(forwarded)
    launcher_env = pod_env(launcher, {"hvd-secret": secret})
    assert launcher_env["STRATAGEM_TRANSPORT"] == "mpi"
    tasks = []
    for rank in range(ranks):
        # What a rank sees: what -x forwards from the launcher, and Open MPI's rank variables.
        env = {name: launcher_env[name] for name in forwarded if name in launcher_env}
        env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(ranks))
        resolved = ClusterResolver.from_env(env)
        assert resolved.secret == SECRET.encode() and env["EPOCHS"] == "3"
        assert {j: resolved.cluster.num_tasks(j) for j in resolved.cluster.jobs} == \
            {"worker": workers, **({"ps": ps} if ps else {})}
        tasks.append(resolved.task)
    assert tasks == [TaskId("worker", i) for i in range(workers)] + [TaskId("ps", i) for i in range(ps)]
    # Worker pods run no command of ours: the operator keeps them up for mpirun.
    assert "command" not in specs["Worker"]["template"]["spec"]["containers"][0]


# -- the command line ------------------------------------------------------------------------------


def test_output_file_is_private_and_yaml_equals_json(tmp_path):
    yaml = pytest.importorskip("yaml")
    out = tmp_path / "job.yaml"
    out.write_text("an older file, readable by all\n")
    out.chmod(0o644)
    proc = manifest("--worker", "2", "--ps", "1", "--image", "img:1", "--env", "MODE=yes", "--env", "ODD=0755",
                    "-o", str(out), "--", "python3", "-c", "print('a: b # c')")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert f"written to {out} (kubectl apply -f {out})" in proc.stderr
    as_json = json.loads(manifest("--worker", "2", "--ps", "1", "--image", "img:1", "--env", "MODE=yes", "--env",
                                  "ODD=0755", "--format", "json", "--", "python3", "-c", "print('a: b # c')").stdout)
    assert as_json["kind"] == "List"
    assert list(yaml.safe_load_all(out.read_text())) == as_json["items"]
    env = as_json["items"][1]["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "MODE", "value": "yes"} in env and {"name": "ODD", "value": "0755"} in env


@pytest.mark.parametrize("args,message", [
    (["--image", "img:1", "--name", "Bad_Name", "--", "python3"], "--name 'Bad_Name' cannot name"),
    (["--image", "img:1", "--transport", "zmqq", "--", "python3"], "did you mean 'zmq'"),
    (["--image", "img:1"], "no command"),
    (["--image", "img:1", "--worker", "0", "--", "python3"], "at least one worker"),
    (["--image", "img:1", "--slots-per-worker", "2", "--", "python3"], "--slots-per-worker applies only with --mpi"),
    (["--image", "img:1", "--mpi", "--chief", "--", "python3"], "--chief does not apply to --mpi"),
    (["--image", "img:1", "--env", "NOEQUALS", "--", "python3"], "--env takes NAME=VALUE"),
    (["--", "python3"], "the following arguments are required: --image"),
])
def test_usage_errors_say_what_to_fix(args, message):
    proc = manifest(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "usage: stratagem k8s manifest" in proc.stderr


def _mpi_why_not() -> str | None:
    from stratagem.launch import mpi as mpi_launch

    if mpi_launch.find_mpiexec() is None:
        return mpi_launch.no_mpiexec()
    if mpi_launch.private_netns()[0] is None:
        return f"cannot make a private network namespace for MPI jobs: {mpi_launch.private_netns()[1]}"
    return None


def test_the_launchers_mpirun_arguments_start_ranks_that_resolve_their_tasks(tmp_path):
    """The MPIJob launcher's mpirun options (the hostfile, -np, every -x), run for real with this machine's
    MPI, the hostfile listing this host as the operator lists the worker pods: every rank resolves its task."""
    why = _mpi_why_not()
    if why:
        pytest.skip(why)
    from stratagem.launch.mpi import run_mpi_job

    user_command = [sys.executable, "-c",
                    "import os; from stratagem import ClusterResolver; r = ClusterResolver.from_env(); "
                    "print('rank', r.task.short, r.cluster.num_tasks('worker'), r.secret.decode(), "
                    "os.environ['STRATAGEM_TRANSPORT'], os.environ['EPOCHS'], flush=True)"]
    secret, job = documents("--mpi", "--worker", "3", "--ps", "1", "--slots-per-worker", "2", "--image", "img:1",
                            "--name", "hvd", "--env", "EPOCHS=3", "--", *user_command)
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    command = launcher["command"]
    assert command[-len(user_command):] == user_command
    options = command[1:-len(user_command)]                     # what follows "mpirun"
    np = int(options[options.index("-np") + 1])
    hostfile = tmp_path / "hostfile"                              # the operator's: one line per worker pod
    hostfile.write_text(f"localhost slots={np}\n")
    forwarded = [a for i, a in enumerate(options) if i and options[i - 1] == "-x"]
    extra = ["--hostfile", str(hostfile)] + [a for name in forwarded for a in ("-x", name)]
    env = {**{k: v for k, v in os.environ.items() if k not in ("STRATAGEM_CONFIG", "TF_CONFIG")},
           **pod_env(launcher, {"hvd-secret": secret}),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = run_mpi_job(np, user_command, timeout=120, env=env, extra_args=extra)
    assert result.returncode == 0, result.output
    ranks = sorted(line.split()[1:] for line in result.output.splitlines() if line.startswith("rank "))
    assert ranks == sorted([[f"worker:{i}", "3", SECRET, "mpi", "3"] for i in range(3)] + [["ps:0", "3", SECRET, "mpi", "3"]])
