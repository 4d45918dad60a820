"""Kubernetes manifests for a stratagem job: a Kubeflow TFJob (or MPIJob) and the Secret it reads.

``stratagem k8s manifest`` writes what ``kubectl apply -f`` needs to run the job under the Kubeflow
training operator (``kubeflow.org/v1``)::

    stratagem k8s manifest --worker 4 --ps 2 --image registry.example/train:1 -o job.yaml -- python3 train.py
    kubectl apply -f job.yaml

- A **TFJob** (the default): one replica set per job of the cluster (``Chief`` with ``--chief``,
  ``Worker``, ``PS``), one pod per task, every pod running the command. The operator gives each pod
  a ``TF_CONFIG`` naming every task by its service, ``NAME-worker-1.NAMESPACE.svc:2222``, which
  ``ClusterResolver.from_env()`` reads as it reads ``STRATAGEM_CONFIG``: the script needs no change.
  Tasks listen on every interface of their pod (a service name is no address a pod can bind).
- An **MPIJob** (``--mpi``): the operator starts ``ceil((workers + ps) / slots)`` worker pods and one
  launcher pod that runs ``mpirun -np WORKERS+PS`` over them with the operator's hostfile; rank 0 is
  the chief and ``STRATAGEM_NUM_PS`` makes the last ranks ``ps`` tasks, as under ``mpiexec``.
  ``STRATAGEM_TRANSPORT`` defaults to ``mpi`` there.
- A **Secret** (``NAME-secret``) holding the cluster secret, ``STRATAGEM_SECRET`` (this shell's, else
  a fresh random one): the pods read it through ``secretKeyRef``, so it is in no pod spec, command
  line or job object. ``--secret-name`` uses a Secret you made instead and writes none. The file
  written holds the secret: it is created readable by its owner only.

The output is YAML (``--format json``: a ``v1`` ``List``, also for ``kubectl apply -f``). Nothing here
talks to a cluster or needs a Kubernetes library.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any, Mapping, Sequence

from stratagem.core.errors import ConfigurationError
from stratagem.launch.job import job_secret

API_VERSION = "kubeflow.org/v1"
#: The port every TFJob task listens on: the operator's default, named as it expects.
TF_PORT = 2222
TF_PORT_NAME = "tfjob-port"
#: The container the TFJob operator reads the port from and MPIJob's launcher runs in.
TF_CONTAINER = "tensorflow"
MPI_CONTAINER = "mpi"
#: Where the MPIJob operator mounts the hostfile it writes for the launcher.
MPI_HOSTFILE = "/etc/mpi/hostfile"
SECRET_KEY = "STRATAGEM_SECRET"
RESTART_POLICIES = ("Never", "OnFailure", "Always", "ExitCode")
FORMATS = ("yaml", "json")

#: TFJob replica type of each stratagem job (the operator names hosts by the lowercased type).
_TF_REPLICA_TYPES = {"chief": "Chief", "worker": "Worker", "ps": "PS"}
#: A name the operator can prefix pods and services with (an RFC 1035 label; room left for suffixes).
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_MAX_LABEL = 63


# -- checks ----------------------------------------------------------------------------------------


def _check_transport_name(transport: str | None) -> None:
    """A ``--transport`` must name a registered transport (with a did-you-mean); whether its libraries
    are installed is the image's business, not this machine's."""
    if transport is None:
        return
    from stratagem.core.errors import PluginError
    from stratagem.plugins.manager import plugin_manager

    try:
        plugin_manager().spec("transport", transport)
    except PluginError as exc:
        raise ConfigurationError(f"--transport: {exc}") from None


def _check(command: Sequence[str], name: str, namespace: str, image: str, workers: int, ps: int,
           restart_policy: str, slots_per_worker: int, longest: str) -> None:
    if not command:
        raise ConfigurationError("no command: put the command every pod runs after '--', "
                                 "e.g. stratagem k8s manifest --image IMG -- python3 train.py")
    if not image or any(c.isspace() for c in image):
        raise ConfigurationError(f"--image must name a container image (e.g. registry.example/train:1), got {image!r}")
    if not _NAME.match(name) or len(longest) > _MAX_LABEL:
        raise ConfigurationError(
            f"--name {name!r} cannot name the job's pods and services: use lowercase letters, digits and '-', "
            f"starting with a letter, short enough that {longest!r} fits in {_MAX_LABEL} characters")
    if not _NAMESPACE.match(namespace) or len(namespace) > _MAX_LABEL:
        raise ConfigurationError(f"--namespace {namespace!r} is not a Kubernetes namespace name "
                                 f"(lowercase letters, digits and '-', at most {_MAX_LABEL})")
    for flag, value in (("--worker", workers), ("--ps", ps), ("--slots-per-worker", slots_per_worker)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigurationError(f"{flag} must be an integer >= 0, got {value!r}")
    if workers < 1:
        raise ConfigurationError("nothing would compute: give at least one worker (--worker N)")
    if slots_per_worker < 1:
        raise ConfigurationError("--slots-per-worker must be at least 1")
    if restart_policy not in RESTART_POLICIES:
        raise ConfigurationError(f"--restart-policy must be one of {', '.join(RESTART_POLICIES)}, "
                                 f"got {restart_policy!r}")


# -- the objects -----------------------------------------------------------------------------------


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "stratagem", "app.kubernetes.io/instance": name}


def secret_manifest(name: str, namespace: str, secret: str) -> dict[str, Any]:
    """The Secret ``NAME-secret`` holding the cluster secret under ``STRATAGEM_SECRET``."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-secret", "namespace": namespace, "labels": _labels(name)},
        "type": "Opaque",
        "stringData": {SECRET_KEY: secret},
    }


def _env(secret_name: str, secret_key: str, transport: str | None, extra: Mapping[str, str]) -> list[dict]:
    env = [{"name": "STRATAGEM_SECRET", "valueFrom": {"secretKeyRef": {"name": secret_name, "key": secret_key}}}]
    if transport:
        env.append({"name": "STRATAGEM_TRANSPORT", "value": transport})
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    env.extend({"name": k, "value": str(v)} for k, v in extra.items())
    return env


def _resources(cpu: str | None, memory: str | None, gpus: int) -> dict[str, Any] | None:
    limits: dict[str, str] = {}
    if cpu:
        limits["cpu"] = str(cpu)
    if memory:
        limits["memory"] = str(memory)
    requests = dict(limits)
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)  # extended resources: limits only (requests follow)
    return {"limits": limits, "requests": requests} if limits else None


def _replica(replicas: int, restart_policy: str, container: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "replicas": replicas,
        "restartPolicy": restart_policy,
        "template": {"metadata": {"labels": _labels(name)}, "spec": {"containers": [container]}},
    }


def tfjob_manifest(command: Sequence[str], *, image: str, name: str = "stratagem-train",
                   namespace: str = "default", workers: int = 1, ps: int = 0, chief: bool = False,
                   transport: str | None = None, secret_name: str | None = None, secret_key: str = SECRET_KEY,
                   restart_policy: str = "Never", cpu: str | None = None, memory: str | None = None,
                   gpus: int = 0, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The TFJob running ``command`` in every task's pod (see the module doc). ps pods get no GPUs."""
    _check(command, name, namespace, image, workers, ps, restart_policy, 1,
           f"{name}-{'worker' if workers >= ps else 'ps'}-{max(workers, ps) - 1}")
    specs = {}
    for job, count in (("chief", 1 if chief else 0), ("worker", workers), ("ps", ps)):
        if not count:
            continue
        container = {
            "name": TF_CONTAINER,
            "image": image,
            "command": list(command),
            "env": _env(secret_name or f"{name}-secret", secret_key, transport, env or {}),
            "ports": [{"name": TF_PORT_NAME, "containerPort": TF_PORT, "protocol": "TCP"}],
        }
        resources = _resources(cpu, memory, 0 if job == "ps" else gpus)
        if resources:
            container["resources"] = resources
        specs[_TF_REPLICA_TYPES[job]] = _replica(count, restart_policy, container, name)
    return {
        "apiVersion": API_VERSION,
        "kind": "TFJob",
        "metadata": {"name": name, "namespace": namespace, "labels": _labels(name)},
        # Running pods (ps tasks still serving) are removed once the job has succeeded or failed.
        "spec": {"runPolicy": {"cleanPodPolicy": "Running"}, "tfReplicaSpecs": specs},
    }


def mpirun_command(command: Sequence[str], ranks: int, transport_set: bool,
                   mpirun_args: Sequence[str] = (), env_names: Sequence[str] = ()) -> list[str]:
    """The launcher's command: ``mpirun`` over the operator's hostfile, passing stratagem's variables
    (and ``env_names``) on to every rank: ranks start in the worker pods, whose environment has none."""
    forwarded = ["STRATAGEM_SECRET", "STRATAGEM_NUM_PS", "PYTHONUNBUFFERED"]
    if transport_set:
        forwarded.append("STRATAGEM_TRANSPORT")
    forwarded.extend(env_names)
    exported = [arg for var in forwarded for arg in ("-x", var)]
    return ["mpirun", "--hostfile", MPI_HOSTFILE, "-np", str(ranks), "--bind-to", "none", *exported,
            *mpirun_args, *command]


def mpijob_manifest(command: Sequence[str], *, image: str, name: str = "stratagem-train",
                    namespace: str = "default", workers: int = 1, ps: int = 0,
                    transport: str | None = "mpi", secret_name: str | None = None,
                    secret_key: str = SECRET_KEY, restart_policy: str = "Never", slots_per_worker: int = 1,
                    cpu: str | None = None, memory: str | None = None, gpus: int = 0,
                    mpirun_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The MPIJob running ``command`` as ``workers + ps`` MPI ranks (see the module doc)."""
    pods = math.ceil((workers + ps) / max(slots_per_worker, 1)) if isinstance(slots_per_worker, int) else 1
    _check(command, name, namespace, image, workers, ps, restart_policy, slots_per_worker,
           max(f"{name}-launcher", f"{name}-worker-{pods - 1}", key=len))
    ranks = workers + ps
    launcher_env = _env(secret_name or f"{name}-secret", secret_key, transport, env or {})
    launcher_env.insert(1, {"name": "STRATAGEM_NUM_PS", "value": str(ps)})
    launcher = {"name": MPI_CONTAINER, "image": image, "env": launcher_env,
                "command": mpirun_command(command, ranks, bool(transport), mpirun_args, list(env or {}))}
    worker = {"name": MPI_CONTAINER, "image": image}  # no command: the operator keeps the pod up for mpirun
    resources = _resources(cpu, memory, gpus)
    if resources:
        worker["resources"] = resources
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": {"name": name, "namespace": namespace, "labels": _labels(name)},
        "spec": {
            "slotsPerWorker": slots_per_worker,
            "runPolicy": {"cleanPodPolicy": "Running"},
            "mpiReplicaSpecs": {
                "Launcher": _replica(1, restart_policy, launcher, name),
                "Worker": _replica(pods, restart_policy, worker, name),
            },
        },
    }


# -- output ----------------------------------------------------------------------------------------

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.\-/]+\Z")
#: Strings written unquoted: a letter first, then no space, quote, '#', ',' or brackets ...
_PLAIN_VALUE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-/:=+@]*\Z")
#: ... and not a word YAML 1.1 reads as a boolean or null.
_YAML_WORDS = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, dict) and not value:
        return "{}"
    if isinstance(value, list) and not value:
        return "[]"
    text = str(value)
    if _PLAIN_VALUE.match(text) and text.lower() not in _YAML_WORDS:
        return text
    # Anything else as a JSON string, which is a YAML double-quoted scalar: nothing can be misread
    # (0755, "null", "a: b", a leading '-' or '*', ...).
    return json.dumps(text)


def _key(key: str) -> str:
    return key if _PLAIN_KEY.match(key) else json.dumps(key)


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{_key(key)}:")
                lines.extend(_yaml_lines(item, indent + 2))
            else:
                lines.append(f"{pad}{_key(key)}: {_scalar(item)}")
    else:
        for item in value:
            if isinstance(item, (dict, list)) and item:
                inner = _yaml_lines(item, indent + 2)
                lines.append(f"{pad}- {inner[0][indent + 2:]}")
                lines.extend(inner[1:])
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    return lines


def render(documents: Sequence[Mapping[str, Any]], fmt: str = "yaml") -> str:
    """The documents as YAML (``---`` between them) or as one JSON ``List``; both for ``kubectl apply -f``."""
    if fmt == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(documents)}, indent=2) + "\n"
    if fmt != "yaml":
        raise ConfigurationError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return "".join("---\n" + "\n".join(_yaml_lines(doc, 0)) + "\n" for doc in documents)


def manifests(command: Sequence[str], *, image: str, name: str = "stratagem-train", namespace: str = "default",
              workers: int = 1, ps: int = 0, chief: bool = False, mpi: bool = False, transport: str | None = None,
              secret: str | None = None, secret_name: str | None = None, **options) -> list[dict[str, Any]]:
    """The job's objects: the Secret (unless ``secret_name`` names one you made), then the TFJob or,
    with ``mpi``, the MPIJob. The secret is ``secret``, else ``STRATAGEM_SECRET``, else a fresh one."""
    _check_transport_name(transport)
    if mpi:
        if chief:
            raise ConfigurationError("--chief does not apply to --mpi: MPI rank 0 is worker:0, the chief")
        job = mpijob_manifest(command, image=image, name=name, namespace=namespace, workers=workers, ps=ps,
                              transport=transport or "mpi", secret_name=secret_name, **options)
    else:
        for option in ("slots_per_worker", "mpirun_args"):
            if options.pop(option, None) not in (None, 1, (), []):
                raise ConfigurationError(f"--{option.replace('_', '-')} applies only with --mpi")
        job = tfjob_manifest(command, image=image, name=name, namespace=namespace, workers=workers, ps=ps,
                             chief=chief, transport=transport, secret_name=secret_name, **options)
    if secret_name:
        return [job]
    return [secret_manifest(name, namespace, job_secret(secret, os.environ)), job]


# -- command line ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``stratagem k8s``'s subcommand ``manifest`` and its options."""
    parser.description = __doc__.splitlines()[0]
    sub = parser.add_subparsers(dest="k8s_command", metavar="manifest")
    m = sub.add_parser("manifest", help="write a Kubeflow TFJob (or MPIJob) and its Secret for a job",
                       description=__doc__.splitlines()[0], epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="%(prog)s --image IMG [--worker N] [--ps M] [--mpi] [options] -- COMMAND [ARG ...]")
    m.set_defaults(subcommand_parser=m)
    m.add_argument("--image", required=True, help="the container image every pod runs (with stratagem installed)")
    m.add_argument("--worker", "--workers", dest="worker", type=int, default=1, metavar="N",
                   help="number of worker tasks (default: 1)")
    m.add_argument("--ps", type=int, default=0, metavar="M", help="number of ps tasks (default: 0)")
    m.add_argument("--chief", action="store_true", help="also a chief task (TFJob replica type Chief)")
    m.add_argument("--mpi", action="store_true", help="an MPIJob: every task an MPI rank of one mpirun")
    m.add_argument("--name", default="stratagem-train", help="the job's name (default: stratagem-train)")
    m.add_argument("--namespace", "-n", default="default", help="its namespace (default: default)")
    m.add_argument("--transport", metavar="T", help="STRATAGEM_TRANSPORT for every task (default: the script's "
                   "choice, zmq; with --mpi: mpi)")
    m.add_argument("--secret-name", metavar="SECRET", help="use this existing Secret for STRATAGEM_SECRET "
                   "(key --secret-key) instead of writing one")
    m.add_argument("--secret-key", default=SECRET_KEY, metavar="KEY",
                   help=f"the key of --secret-name holding the secret (default: {SECRET_KEY})")
    m.add_argument("--restart-policy", default="Never", choices=RESTART_POLICIES,
                   help="what the operator does when a pod fails (default: Never, the job fails)")
    m.add_argument("--cpu", help="CPU limit and request of each pod (e.g. 4)")
    m.add_argument("--memory", help="memory limit and request of each pod (e.g. 8Gi)")
    m.add_argument("--gpus", type=int, default=0, metavar="G", help="nvidia.com/gpu of each chief/worker pod")
    m.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="another environment variable of every task (repeatable)")
    m.add_argument("--slots-per-worker", type=int, default=None, metavar="S",
                   help="with --mpi: ranks per worker pod (default: 1)")
    m.add_argument("--mpirun-arg", action="append", default=[], dest="mpirun_args", metavar="ARG",
                   help="with --mpi: an extra argument for mpirun (repeatable)")
    m.add_argument("--format", default="yaml", choices=FORMATS, help="yaml (default) or json (a v1 List)")
    m.add_argument("--output", "-o", metavar="FILE", help="write here (created mode 0600) instead of stdout")
    m.add_argument("command", nargs=argparse.REMAINDER, help="the command every pod runs, after '--'")


_EPILOG = """\
example:
  stratagem k8s manifest --worker 4 --ps 2 --image registry.example/train:1 -o job.yaml -- python3 train.py
  kubectl apply -f job.yaml

The TFJob's pods get TF_CONFIG from the Kubeflow training operator; STRATAGEM_SECRET comes from the
Secret written beside it (or --secret-name). --mpi writes an MPIJob instead.
"""


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not re.match(r"[A-Za-z_][A-Za-z0-9_]*\Z", key):
            raise ConfigurationError(f"--env takes NAME=VALUE, got {pair!r}")
        env[key] = value
    return env


def run(args: argparse.Namespace) -> int:
    """Run ``stratagem k8s ...``; return the exit status."""
    if getattr(args, "k8s_command", None) != "manifest":
        args.subcommand_parser.print_help(sys.stderr)
        return 2
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    options: dict[str, Any] = {"restart_policy": args.restart_policy, "cpu": args.cpu, "memory": args.memory,
                               "gpus": args.gpus, "secret_key": args.secret_key}
    try:
        options["env"] = _parse_env(args.env)
        if args.gpus < 0:
            raise ConfigurationError(f"--gpus must be >= 0, got {args.gpus}")
        if args.mpi or args.slots_per_worker is not None or args.mpirun_args:
            options["slots_per_worker"] = 1 if args.slots_per_worker is None else args.slots_per_worker
            options["mpirun_args"] = args.mpirun_args
        docs = manifests(command, image=args.image, name=args.name, namespace=args.namespace,
                         workers=args.worker, ps=args.ps, chief=args.chief, mpi=args.mpi,
                         transport=args.transport, secret_name=args.secret_name, **options)
        text = render(docs, args.format)
    except ConfigurationError as exc:
        args.subcommand_parser.error(str(exc))  # usage line, exit 2
    if args.output:
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # also when the file was there before, with other permissions
        with os.fdopen(fd, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    job = docs[-1]
    what = ", ".join(f"{spec['replicas']} {kind}" for kind, spec in
                     (job["spec"].get("tfReplicaSpecs") or job["spec"]["mpiReplicaSpecs"]).items())
    secret = (f"the Secret {args.secret_name!r} (key {args.secret_key})" if args.secret_name
              else f"a new Secret {docs[0]['metadata']['name']!r} holding the cluster secret")
    print(f"stratagem k8s: {job['kind']} {args.name!r} ({what}) reading {secret}"
          + (f"; written to {args.output} (kubectl apply -f {args.output})" if args.output else ""),
          file=sys.stderr)
    return 0
