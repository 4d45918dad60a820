"""Tests of the cluster model (README: "Concepts"; stratagem.core.cluster): TaskId, ClusterSpec and ClusterResolver.

Errors are part of the contract: each one names the job, the index and what to do about it, so the
tests assert on message contents, not only on exception types.
"""

from __future__ import annotations

import json

import pytest

from stratagem.core.cluster import (
    ClusterResolver,
    ClusterSpec,
    ResolvedCluster,
    TaskId,
)
from stratagem.core.errors import ConfigurationError, StratagemError


def raises(call, *fragments, exc=ConfigurationError) -> str:
    """Assert that ``call()`` raises ``exc`` whose message contains every fragment; return the message."""
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def tf_config(cluster, task_type=None, index=None, **extra) -> str:
    config = {"cluster": cluster, **extra}
    if task_type is not None:
        config["task"] = {"type": task_type} if index is None else {"type": task_type, "index": index}
    return json.dumps(config)


# -- TaskId -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, job, index", [
    ("/job:worker/task:1", "worker", 1),
    ("/job:ps/task:0", "ps", 0),
    ("/job:chief/task:0", "chief", 0),
    ("/job:worker/replica:0/task:3", "worker", 3),
    ("/job:worker/replica:12/task:0", "worker", 0),
    ("/job:my_job-2/task:10", "my_job-2", 10),
    ("worker:1", "worker", 1),
    ("ps:0", "ps", 0),
    ("_private:7", "_private", 7),
    ("/job:master/task:0", "chief", 0),  # the alias applies when parsing too
    ("master:0", "chief", 0),
])
def test_taskid_parse(text, job, index):
    task = TaskId.parse(text)
    assert (task.job, task.index) == (job, index)
    assert task == TaskId(job, index)


def test_taskid_formats():
    task = TaskId("worker", 1)
    assert str(task) == "/job:worker/task:1"
    assert task.short == "worker:1"
    assert repr(task) == "TaskId('/job:worker/task:1')"
    assert TaskId.parse(str(task)) == task == TaskId.parse(task.short)
    assert TaskId.parse(task) is task
    assert str(TaskId.parse("/job:worker/replica:0/task:2")) == "/job:worker/task:2"  # replica is dropped


def test_taskid_is_hashable_ordered_and_frozen():
    tasks = {TaskId("worker", 1), TaskId.parse("worker:1"), TaskId("ps", 0)}
    assert len(tasks) == 2
    assert sorted([TaskId("worker", 1), TaskId("ps", 0), TaskId("worker", 0)]) == [
        TaskId("ps", 0), TaskId("worker", 0), TaskId("worker", 1)]
    with pytest.raises(AttributeError):
        TaskId("worker", 0).index = 2  # type: ignore[misc]


def test_taskid_master_alias():
    assert TaskId("master", 0) == TaskId("chief", 0)
    assert TaskId("master", 0).job == "chief"


@pytest.mark.parametrize("text", [
    "", "worker", "worker:", ":1", "worker:-1", "worker:1.5", "worker:x", "/job:worker", "/job:worker/task:",
    "/job:worker/task:-1", "/job:/task:0", "job:worker/task:0", "/job:worker/task:1/extra",
    "/job:worker/replica:x/task:0", "/job:worker/replica:/task:0", "worker:1:2", " worker:1", "worker:1 ",
    "worker :1", "1worker:0", "/job:1bad/task:0", "/job:wor ker/task:0", "/job:a.b/task:0",
    "worker:1\n", "/job:worker/task:1\n", "worker\n:1", "worker:\u0661",  # ARABIC-INDIC DIGIT ONE
], ids=repr)
def test_taskid_parse_refuses_bad_forms_naming_the_input(text):
    message = raises(lambda: TaskId.parse(text))
    assert repr(text) in message, message
    assert "/job:worker/task:1" in message or "job name" in message


@pytest.mark.parametrize("value", [None, 1, b"worker:1", ("worker", 1), ["worker", 1]], ids=repr)
def test_taskid_parse_refuses_non_strings(value):
    raises(lambda: TaskId.parse(value), "/job:NAME/task:INDEX", repr(value))


@pytest.mark.parametrize("job", ["", "1worker", "wor ker", "a/b", "a:b", "worker\n", None, 5, ["w"]], ids=repr)
def test_taskid_refuses_bad_job_names(job):
    raises(lambda: TaskId(job, 0), "invalid job name", repr(job), "e.g. 'worker'")


@pytest.mark.parametrize("index", [-1, 1.0, "1", None, True, False], ids=repr)
def test_taskid_refuses_bad_indices_naming_the_job(index):
    raises(lambda: TaskId("worker", index), "invalid task index", repr(index), "'worker'", ">= 0")


def test_configuration_errors_are_value_errors_and_stratagem_errors():
    with pytest.raises(ValueError):
        TaskId.parse("nope")
    with pytest.raises(StratagemError):
        TaskId.parse("nope")


# -- ClusterSpec ------------------------------------------------------------------------------------

THREE_JOBS = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1", "p1:1"]}


def test_cluster_basic_queries():
    spec = ClusterSpec(THREE_JOBS)
    assert spec.job_names == ["chief", "worker", "ps"]
    assert spec.num_tasks("worker") == 2 and spec.num_tasks("ps") == 2 and spec.num_tasks("chief") == 1
    assert spec.num_tasks("master") == 1 and spec.num_tasks("evaluator") == 0
    assert len(spec) == 5
    assert spec.address("/job:worker/task:1") == "w1:1"
    assert spec.address(TaskId("ps", 0)) == "p0:1"
    assert spec.address("master:0") == "c:1"
    assert "worker:1" in spec and TaskId("ps", 1) in spec
    assert "worker:2" not in spec and "evaluator:0" not in spec and "not a task" not in spec


@pytest.mark.parametrize("address", ["[::1]:2222", "localhost:0", "10.0.0.1:65535", "worker-1.svc.cluster.local:2222",
                                     "h:1"])
def test_cluster_accepts_host_port_addresses(address):
    assert ClusterSpec({"worker": [address]}).address("worker:0") == address


@pytest.mark.parametrize("address", ["nohostport", "host:", ":2222", "host:port", "host:65536", "host:-1",
                                     "host:22 ", "host: 22", "", "host:\u00b2", "host:\u0661\u0662"], ids=repr)
def test_cluster_bad_address_names_job_index_and_address(address):
    raises(lambda: ClusterSpec({"worker": ["ok:1", address]}), "job 'worker' task 1", repr(address), "host:port",
           "127.0.0.1:2222")


@pytest.mark.parametrize("address", [2222, b"h:1", ("h", 1)], ids=repr)
def test_cluster_non_string_address(address):
    raises(lambda: ClusterSpec({"ps": [address]}), "job 'ps' task 0", "'host:port' string", repr(address))


def test_cluster_duplicate_address_names_both_tasks():
    message = raises(lambda: ClusterSpec({"worker": ["h:1", "h:2"], "ps": ["h:2"]}), "h:2", "its own port")
    assert "/job:worker/task:1" in message and "/job:ps/task:0" in message
    raises(lambda: ClusterSpec({"worker": ["h:1", "h:1"]}), "/job:worker/task:0", "/job:worker/task:1")


def test_cluster_port_zero_may_repeat():
    # Port 0 means "pick a free port": many tasks on one host may ask for it.
    spec = ClusterSpec({"worker": ["127.0.0.1:0", "127.0.0.1:0"], "ps": ["127.0.0.1:0"]})
    assert len(spec) == 3


def test_cluster_chief_must_have_one_task():
    raises(lambda: ClusterSpec({"chief": ["a:1", "b:1"], "worker": ["c:1"]}), "'chief'", "exactly one task",
           "it has 2")
    raises(lambda: ClusterSpec({"master": ["a:1", "b:1"]}), "'chief'", "exactly one task")


def test_cluster_empty_job():
    raises(lambda: ClusterSpec({"worker": ["a:1"], "ps": []}), "job 'ps' has no tasks", "remove it")
    raises(lambda: ClusterSpec({"ps": {}}), "job 'ps' has no tasks")


@pytest.mark.parametrize("tasks", ["a:1", b"a:1", 5, None], ids=repr)
def test_cluster_tasks_must_be_a_list(tasks):
    raises(lambda: ClusterSpec({"worker": tasks}), "job 'worker'", "list of 'host:port'")


@pytest.mark.parametrize("jobs", [["worker"], "worker", None, 5], ids=repr)
def test_cluster_must_be_a_mapping(jobs):
    raises(lambda: ClusterSpec(jobs), "mapping of job name", type(jobs).__name__)


def test_cluster_bad_job_name():
    raises(lambda: ClusterSpec({"bad job": ["a:1"]}), "invalid job name", "'bad job'")


def test_cluster_sparse_dict_form():
    spec = ClusterSpec({"worker": {1: "b:1", 0: "a:1"}, "ps": {"0": "p:1"}})  # JSON gives string keys
    assert spec.address("worker:0") == "a:1" and spec.address("worker:1") == "b:1"
    assert spec.address("ps:0") == "p:1"
    assert spec == ClusterSpec({"worker": ["a:1", "b:1"], "ps": ["p:1"]})


def test_cluster_sparse_dict_from_json():
    spec = ClusterSpec.from_json('{"worker": {"1": "b:1", "0": "a:1"}}')
    assert spec.tasks("worker") == [TaskId("worker", 0), TaskId("worker", 1)]
    assert spec.address("worker:1") == "b:1"


def test_cluster_sparse_dict_with_gaps():
    raises(lambda: ClusterSpec({"worker": {0: "a:1", 2: "c:1"}}), "job 'worker'", "[0, 2]", "0..N-1", "no gaps")
    raises(lambda: ClusterSpec({"worker": {1: "a:1"}}), "job 'worker'", "[1]")
    raises(lambda: ClusterSpec({"worker": {-1: "a:1", 0: "b:1"}}), "job 'worker'", "[-1, 0]")
    raises(lambda: ClusterSpec({"worker": {0: "a:1", "0": "b:1"}}), "job 'worker'", "[0, 0]")


@pytest.mark.parametrize("key", ["a", "1.5", None, 1.5, "01"], ids=repr)
def test_cluster_sparse_dict_with_bad_indices_names_the_job(key):
    raises(lambda: ClusterSpec({"worker": {0: "a:1", key: "b:1"}}), "job 'worker'", repr(key))


def test_cluster_master_alias():
    spec = ClusterSpec({"master": ["m:1"], "worker": ["w:1"]})
    assert spec.job_names == ["chief", "worker"]
    assert spec.chief == TaskId("chief", 0)
    assert spec == ClusterSpec({"chief": ["m:1"], "worker": ["w:1"]})
    raises(lambda: ClusterSpec({"master": ["m:1"], "chief": ["c:1"]}), "given twice", "alias of 'chief'")


def test_cluster_equality_and_hash():
    a = ClusterSpec({"worker": ["w0:1", "w1:1"], "ps": ["p:1"]})
    b = ClusterSpec({"ps": ["p:1"], "worker": ["w0:1", "w1:1"]})  # job order does not matter
    c = ClusterSpec({"worker": ["w1:1", "w0:1"], "ps": ["p:1"]})  # task order does
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a != {"worker": ["w0:1", "w1:1"], "ps": ["p:1"]}
    assert len({a, b, c}) == 2
    assert ClusterSpec(a) == a  # copy construction
    assert a.cluster_id == b.cluster_id != c.cluster_id
    assert len(a.cluster_id) == 16 and int(a.cluster_id, 16) >= 0


def test_cluster_is_immutable():
    spec = ClusterSpec({"worker": ["a:1"]})
    with pytest.raises(AttributeError):
        spec.jobs = {}  # type: ignore[misc]
    with pytest.raises(AttributeError):
        spec.other = 1  # type: ignore[attr-defined]


def test_cluster_json_round_trip():
    spec = ClusterSpec(THREE_JOBS)
    text = spec.to_json()
    assert json.loads(text) == THREE_JOBS
    assert ClusterSpec.from_json(text) == spec
    assert ClusterSpec.from_json(text).to_json() == text
    assert spec.as_dict() == THREE_JOBS
    assert eval(repr(spec), {"ClusterSpec": ClusterSpec}) == spec
    mpi = ClusterSpec({"worker": [None, None]})  # an MPI world has no addresses
    assert ClusterSpec.from_json(mpi.to_json()) == mpi and mpi.address("worker:1") is None


def test_cluster_from_bad_json():
    raises(lambda: ClusterSpec.from_json("{not json"), "not valid JSON")
    raises(lambda: ClusterSpec.from_json("[1, 2]"), "mapping of job name")
    raises(lambda: ClusterSpec.from_json('{"worker": ["nope"]}'), "job 'worker' task 0", "'nope'")


def test_cluster_tasks_ordering():
    spec = ClusterSpec({"ps": ["p0:1", "p1:1"], "evaluator": ["e:1"], "worker": ["w0:1", "w1:1"], "chief": ["c:1"]})
    assert [t.short for t in spec.tasks()] == ["chief:0", "worker:0", "worker:1", "evaluator:0", "ps:0", "ps:1"]
    assert list(spec) == spec.tasks()
    assert spec.tasks("ps") == [TaskId("ps", 0), TaskId("ps", 1)]
    assert spec.tasks("master") == [TaskId("chief", 0)]
    assert spec.tasks("missing") == []


def test_cluster_replicas():
    spec = ClusterSpec({"ps": ["p:1"], "worker": ["w0:1", "w1:1"], "chief": ["c:1"]})
    assert [t.short for t in spec.replicas()] == ["chief:0", "worker:0", "worker:1"]
    assert ClusterSpec({"ps": ["p:1"]}).replicas() == []
    assert ClusterSpec({"worker": ["a:1", "b:1"]}).replicas() == [TaskId("worker", 0), TaskId("worker", 1)]


def test_cluster_chief():
    assert ClusterSpec({"chief": ["c:1"], "worker": ["w:1"]}).chief == TaskId("chief", 0)
    assert ClusterSpec({"worker": ["w0:1", "w1:1"], "ps": ["p:1"]}).chief == TaskId("worker", 0)
    raises(lambda: ClusterSpec({"ps": ["p:1"]}).chief, "neither a 'chief' nor a 'worker'")
    assert ClusterSpec({}).tasks() == [] and len(ClusterSpec({})) == 0


def test_cluster_check_names_the_job_and_index():
    spec = ClusterSpec({"worker": ["a:1", "b:1"], "ps": ["p:1"]})
    assert spec.check("worker:1") == TaskId("worker", 1)
    message = raises(lambda: spec.check("trainer:0"), "job 'trainer' is not in the cluster", "worker, ps",
                     "add the job")
    assert "task type" in message
    raises(lambda: spec.check("worker:2"), "task index 2", "'worker'", "has 2 task(s)", "0..1")
    raises(lambda: spec.address("ps:3"), "task index 3", "'ps'", "has 1 task(s)")


# -- ClusterResolver --------------------------------------------------------------------------------

CLUSTER = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}


def test_resolver_stratagem_config():
    found = ClusterResolver.from_env({"STRATAGEM_CONFIG": tf_config(CLUSTER, "worker", 1)})
    assert isinstance(found, ResolvedCluster)
    assert found.cluster == ClusterSpec(CLUSTER)
    assert found.task == TaskId("worker", 1)
    assert found.source == "STRATAGEM_CONFIG"
    assert found.secret is None and found.rpc_layer is None
    assert not found.is_chief


def test_resolver_stratagem_config_beats_tf_config_beats_mpi():
    env = {
        "STRATAGEM_CONFIG": tf_config(CLUSTER, "ps", 0),
        "TF_CONFIG": tf_config(CLUSTER, "worker", 1),
        "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
    }
    assert ClusterResolver.from_env(env).task == TaskId("ps", 0)
    del env["STRATAGEM_CONFIG"]
    found = ClusterResolver.from_env(env)
    assert (found.task, found.source) == (TaskId("worker", 1), "TF_CONFIG")
    del env["TF_CONFIG"]
    found = ClusterResolver.from_env(env)
    assert found.task == TaskId("worker", 2) and "OMPI_COMM_WORLD_RANK" in found.source


def test_resolver_empty_variables_are_skipped():
    env = {"STRATAGEM_CONFIG": "", "TF_CONFIG": tf_config(CLUSTER, "worker", 0)}
    assert ClusterResolver.from_env(env).source == "TF_CONFIG"
    assert ClusterResolver.from_env({"STRATAGEM_CONFIG": "", "TF_CONFIG": ""}).source.startswith("default")


def test_resolver_tf_config_with_master():
    env = {"TF_CONFIG": tf_config({"master": ["m:1"], "worker": ["w:1"]}, "master", 0)}
    found = ClusterResolver.from_env(env)
    assert found.task == TaskId("chief", 0)
    assert found.is_chief
    assert found.cluster.job_names == ["chief", "worker"]
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config({"master": ["m:1"], "worker": ["w:1"]}, "worker", 0)})
    assert found.task == TaskId("worker", 0) and not found.is_chief


def test_resolver_chief_is_worker_0_without_a_chief_job():
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config({"worker": ["a:1", "b:1"]}, "worker", 0)})
    assert found.is_chief
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config({"worker": ["a:1", "b:1"]}, "worker", 1)})
    assert not found.is_chief


def test_resolver_task_index_as_string_and_default_index():
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config(CLUSTER, "worker", "1")})
    assert found.task == TaskId("worker", 1)
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config(CLUSTER, "ps")})  # no index: 0
    assert found.task == TaskId("ps", 0)


@pytest.mark.parametrize("index", ["x", "-1", " 1", "1.0", -1, 1.5, True, "\u0661"], ids=repr)
def test_resolver_bad_task_index(index):
    raises(lambda: ClusterResolver.from_env({"TF_CONFIG": tf_config(CLUSTER, "worker", index)}),
           "task index", repr(index), "'worker'")


def test_resolver_null_task_index():
    config = json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": None}})
    raises(lambda: ClusterResolver.from_env({"TF_CONFIG": config}), "task index None", "'worker'")


def test_resolver_rpc_layer_and_extra_keys():
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config(CLUSTER, "chief", 0, rpc_layer="grpc",
                                                             environment="cloud")})
    assert found.rpc_layer == "grpc" and found.is_chief


def test_resolver_task_type_not_in_cluster():
    env = {"TF_CONFIG": tf_config(CLUSTER, "trainer", 0)}
    raises(lambda: ClusterResolver.from_env(env), "TF_CONFIG", "'trainer'", "not a job of the cluster",
           "chief, worker, ps", "fix 'task.type'")
    env = {"STRATAGEM_CONFIG": tf_config({"worker": ["a:1"]}, "ps", 0)}
    raises(lambda: ClusterResolver.from_env(env), "STRATAGEM_CONFIG", "'ps'", "fix 'task.type'")


def test_resolver_index_out_of_range():
    env = {"TF_CONFIG": tf_config(CLUSTER, "worker", 5)}
    raises(lambda: ClusterResolver.from_env(env), "task index 5", "'worker'", "has 2 task(s)", "0..1",
           "fix the task index")
    raises(lambda: ClusterResolver.from_env({"TF_CONFIG": tf_config(CLUSTER, "chief", 1)}),
           "task index 1", "'chief'", "has 1 task(s)")


@pytest.mark.parametrize("var", ["STRATAGEM_CONFIG", "TF_CONFIG"])
def test_resolver_invalid_json(var):
    raises(lambda: ClusterResolver.from_env({var: "{cluster: nope"}), var, "not valid JSON",
           '"cluster": {"worker": ["host:port"]}')


@pytest.mark.parametrize("config, fragments", [
    ({"task": {"type": "worker", "index": 0}}, ["no 'cluster' entry"]),
    ([1, 2], ["no 'cluster' entry"]),
    ({"cluster": {"worker": ["a:1"]}}, ["no 'task' entry", "'type'"]),
    ({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}, ["no 'task' entry", "'type'"]),
    ({"cluster": {"worker": ["a:1"]}, "task": "worker:0"}, ["no 'task' entry"]),
    ({"cluster": {"worker": ["bad"]}, "task": {"type": "worker", "index": 0}}, ["job 'worker' task 0", "'bad'"]),
    ({"cluster": ["a:1"], "task": {"type": "worker", "index": 0}}, ["mapping of job name"]),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "bad job", "index": 0}}, ["invalid job name", "'bad job'"]),
], ids=["no-cluster", "not-a-map", "no-task", "no-type", "task-string", "bad-address", "cluster-list", "bad-type"])
def test_resolver_malformed_configs(config, fragments):
    raises(lambda: ClusterResolver.from_env({"TF_CONFIG": json.dumps(config)}), *fragments)


def test_resolver_ompi_variables():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3"}
    found = ClusterResolver.from_env(env)
    assert found.task == TaskId("worker", 0) and found.is_chief
    assert found.cluster.tasks() == [TaskId("worker", i) for i in range(3)]
    assert found.cluster.address("worker:2") is None  # MPI moves the data; no sockets
    assert found.source == "mpi (OMPI_COMM_WORLD_RANK)"


def test_resolver_mpi_with_parameter_servers():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "STRATAGEM_NUM_PS": "1"}
    found = ClusterResolver.from_env(env)
    assert found.task == TaskId("ps", 0)
    assert found.cluster.num_tasks("worker") == 3 and found.cluster.num_tasks("ps") == 1
    env["OMPI_COMM_WORLD_RANK"] = "2"
    assert ClusterResolver.from_env(env).task == TaskId("worker", 2)
    env.update(OMPI_COMM_WORLD_RANK="2", STRATAGEM_NUM_PS="2")
    assert ClusterResolver.from_env(env).task == TaskId("ps", 0)
    env["STRATAGEM_NUM_PS"] = ""
    assert ClusterResolver.from_env(env).cluster.job_names == ["worker"]


def test_resolver_pmi_variables():
    found = ClusterResolver.from_env({"PMI_RANK": "1", "PMI_SIZE": "2", "STRATAGEM_NUM_PS": "1"})
    assert found.task == TaskId("ps", 0) and found.source == "mpi (PMI_RANK)"
    found = ClusterResolver.from_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert found.task == TaskId("worker", 1)


def test_resolver_mpi_needs_both_rank_and_size():
    found = ClusterResolver.from_env({"OMPI_COMM_WORLD_RANK": "1", "PMI_RANK": "0", "PMI_SIZE": "1"})
    assert found.source == "mpi (PMI_RANK)" and found.task == TaskId("worker", 0)
    assert ClusterResolver.from_env({"PMI_RANK": "1"}).source.startswith("default")


@pytest.mark.parametrize("env, fragments", [
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_RANK", "'x'", "not an integer"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": ""}, ["OMPI_COMM_WORLD_SIZE", "not set"]),
    ({"PMI_RANK": "2", "PMI_SIZE": "2"}, ["MPI rank 2", "size 2"]),
    ({"PMI_RANK": "-1", "PMI_SIZE": "2"}, ["MPI rank -1"]),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "STRATAGEM_NUM_PS": "2"}, ["STRATAGEM_NUM_PS=2", "no worker", "2 ranks"]),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "STRATAGEM_NUM_PS": "one"}, ["STRATAGEM_NUM_PS", "'one'", "not an integer"]),
], ids=["rank-not-int", "size-empty", "rank-too-big", "rank-negative", "all-ps", "ps-not-int"])
def test_resolver_bad_mpi_variables(env, fragments):
    raises(lambda: ClusterResolver.from_env(env), *fragments)


def test_resolver_no_environment_is_a_single_task():
    found = ClusterResolver.from_env({})
    assert found.task == TaskId("worker", 0)
    assert found.cluster == ClusterSpec({"worker": ["127.0.0.1:0"]})
    assert found.is_chief
    assert found.secret is None
    assert found.source.startswith("default")
    assert ClusterResolver.from_env({"UNRELATED": "1", "PATH": "/bin"}).task == TaskId("worker", 0)


@pytest.mark.parametrize("env", [
    {},
    {"TF_CONFIG": tf_config(CLUSTER, "worker", 0)},
    {"STRATAGEM_CONFIG": tf_config(CLUSTER, "ps", 0)},
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
], ids=["default", "tf_config", "stratagem_config", "mpi"])
def test_resolver_secret_is_bytes_from_every_source(env):
    found = ClusterResolver.from_env({**env, "STRATAGEM_SECRET": "s3cr\u00e9t"})
    assert found.secret == "s3cr\u00e9t".encode() and isinstance(found.secret, bytes)
    assert ClusterResolver.from_env({**env, "STRATAGEM_SECRET": ""}).secret is None
    assert ClusterResolver.from_env(env).secret is None


def test_resolver_reads_os_environ_by_default(monkeypatch):
    for name in ("STRATAGEM_CONFIG", "TF_CONFIG", "STRATAGEM_SECRET", "STRATAGEM_NUM_PS", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_SIZE", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_RANK",
                 "MV2_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_CONFIG", tf_config(CLUSTER, "worker", 1))
    monkeypatch.setenv("STRATAGEM_SECRET", "k")
    found = ClusterResolver.from_env()
    assert found.task == TaskId("worker", 1) and found.secret == b"k"


def test_from_mpi_directly():
    found = ClusterResolver.from_mpi(4, 6, num_ps=2)
    assert found.task == TaskId("ps", 0)
    assert [t.short for t in found.cluster.tasks()] == ["worker:0", "worker:1", "worker:2", "worker:3", "ps:0", "ps:1"]
    raises(lambda: ClusterResolver.from_mpi(0, 2, num_ps=-1), "STRATAGEM_NUM_PS=-1")


# -- TensorFlow's TFConfigClusterResolver semantics (#24) ---------------------------------------------

@pytest.mark.parametrize("text", ["{}", '{"cluster": {}, "task": {}}', '{"cluster": {}}', " { } "])
def test_resolver_empty_tf_config_is_no_tf_config(text):
    # TF reads TF_CONFIG='{}' as no TF_CONFIG: a world of one (or the next source, here MPI).
    found = ClusterResolver.from_env({"TF_CONFIG": text})
    assert found.cluster == ClusterSpec({"worker": ["127.0.0.1:0"]}) and found.task == TaskId("worker", 0)
    found = ClusterResolver.from_env({"TF_CONFIG": text, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert found.task == TaskId("worker", 1) and found.source.startswith("mpi")


def test_cluster_allows_at_most_one_evaluator():
    # TF: "There must be at most one 'evaluator' job."
    assert ClusterSpec({"worker": ["a:1"], "evaluator": ["e:1"]}).num_tasks("evaluator") == 1
    raises(lambda: ClusterSpec({"worker": ["a:1"], "evaluator": ["e:1", "e:2"]}),
           "job 'evaluator' must have at most one task, it has 2")
    config = {"cluster": {"worker": ["a:1"], "evaluator": ["e:1", "e:2"]}, "task": {"type": "evaluator", "index": 1}}
    raises(lambda: ClusterResolver.from_env({"TF_CONFIG": json.dumps(config)}), "at most one task")


def test_resolved_cluster_never_shows_the_secret():
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config(CLUSTER, "worker", 0), "STRATAGEM_SECRET": "hunter2-xyz"})
    assert found.secret == b"hunter2-xyz"
    for text in (repr(found), str(found), f"{found}", repr([found])):
        assert "hunter2" not in text and "secret=<set>" in text
    assert "secret=None" in repr(ClusterResolver.from_env({}))


def test_strategy_and_transport_never_show_the_secret():
    import stratagem
    from stratagem.transports.local import LocalFabric

    with stratagem.strategy("mirrored", transport="local", cluster=ClusterSpec({"worker": ["local:0"]}),
                            task="worker:0", transport_options={"fabric": LocalFabric(), "secret": b"hunter2-xyz"}) as s:
        assert s.transport.secret == b"hunter2-xyz"
        for text in (repr(s), str(s), repr(s.transport), str(s.transport), repr(s.config), repr(s.cluster)):
            assert "hunter2" not in text, text
