"""``stratagem launch --hostfile FILE``: start the launcher of every node from one machine, as ``horovodrun -hostfile``.

``FILE`` lists the hosts in Open MPI / Horovod form, one per line: ``host slots=K`` (or ``host:K``, or
``host`` alone for one slot); ``#`` starts a comment. Each host runs ``K`` workers (and ``--ps-per-node``
ps tasks); the first host is node 0 and holds the rendezvous on ``--rdzv-port`` (default 29400)::

    $ cat hosts
    node-a slots=4
    node-b slots=4
    $ stratagem launch --hostfile hosts -- python train.py

For each host this runs ``REMOTE_COMMAND HOST 'cd DIR && exec PYTHON -m stratagem launch --nnodes N
--node-rank I --rdzv FIRST_HOST:PORT --worker-per-node K --secret-file - -- COMMAND'`` (``--remote-command``,
default ``ssh -o BatchMode=yes``: it is called as ssh is, with the host and one shell command), in
this directory with this Python, so the hosts need the same paths (as with ``horovodrun``). The
cluster secret (``STRATAGEM_SECRET``, ``--secret-file``, else a fresh random one) goes to each remote
launcher through its standard input, never on a command line; ``--env NAME`` passes other variables
along. Each remote launcher's output comes back prefixed by its host; every node ends the job as
one (:mod:`.multinode`), and this command exits with node 0's status.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from typing import Sequence, TextIO

from stratagem.core.cluster import TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.transport_kit.ports import format_address
from stratagem.launch.job import DEFAULT_GRACE, DEFAULT_PS_GRACE
from stratagem.launch.rendezvous import DEFAULT_NODE_TIMEOUT, DEFAULT_RDZV_TIMEOUT
from stratagem.launch.supervisor import (
    EXIT_SIGNALLED,
    POLL_INTERVAL,
    RunningTask,
    SignalTrap,
    die_with_launcher,
    kill_and_reap,
    stop,
)
from stratagem.launch.task_output import OutputPump, PipeReader, Sink

DEFAULT_REMOTE_COMMAND = "ssh -o BatchMode=yes"
#: torchrun's default rendezvous port.
DEFAULT_RDZV_PORT = 29400
#: Seconds the other nodes' launchers get to end on their own once one has ended (they end together:
#: every node gets the job's summary at once), before they are stopped (SIGTERM, SIGKILL after --grace).
END_SLACK = 5.0

_SLOTS = re.compile(r"slots=(\d+)\Z")


def parse_hostfile(text: str, source: str = "hostfile") -> list[tuple[str, int]]:
    """``[(host, slots), ...]`` from Open MPI / Horovod hostfile text; a ``ConfigurationError`` naming
    the line for anything else.

        >>> parse_hostfile("# two nodes\\nnode-a slots=2\\n\\nnode-b:4\\nnode-c  # one slot\\n")
        [('node-a', 2), ('node-b', 4), ('node-c', 1)]
    """
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        host, slots = words[0], 1
        if ":" in host and host.count(":") == 1:  # Horovod's host:slots (an IPv6 address has several colons)
            host, _, count = host.partition(":")
            if not count.isdigit():
                raise ConfigurationError(f"{source} line {number}: {raw.strip()!r}: the slots after ':' must be a number")
            slots = int(count)
        for word in words[1:]:
            match = _SLOTS.match(word)
            if match:
                slots = int(match.group(1))
            elif not word.startswith(("max_slots=", "max-slots=")):  # Open MPI's cap: nothing to do with it here
                raise ConfigurationError(f"{source} line {number}: {raw.strip()!r}: unknown field {word!r}; "
                                         f"write 'HOST slots=K' or 'HOST:K'")
        if slots < 1:
            raise ConfigurationError(f"{source} line {number}: {host} has {slots} slots; give slots=K with K >= 1")
        if any(host == h for h, _ in hosts):
            raise ConfigurationError(f"{source} line {number}: {host} is listed twice; list each host once "
                                     f"with all its slots")
        hosts.append((host, slots))
    if not hosts:
        raise ConfigurationError(f"{source} lists no host: write one 'HOST slots=K' line per node")
    return hosts


def node_command(command: Sequence[str], *, nnodes: int, rank: int, rdzv: str, workers: int, ps: int,
                 options: Sequence[str], env: dict[str, str]) -> str:
    """The shell command that starts node ``rank``'s launcher on its host (the secret comes on stdin)."""
    argv = [sys.executable, "-m", "stratagem", "launch", "--secret-file", "-", "--nnodes", str(nnodes),
            "--node-rank", str(rank), "--rdzv", rdzv, "--worker-per-node", str(workers), *options]
    if ps:
        argv += ["--ps-per-node", str(ps)]
    argv += ["--", *command]
    assignments = [f"{name}={value}" for name, value in env.items()]
    launch = shlex.join((["env", *assignments] if assignments else []) + argv)
    return f"cd {shlex.quote(os.getcwd())} && exec {launch}"


def launch_hostfile(command: Sequence[str], *, hostfile: str, secret: str | None = None,
                    remote_command: str | None = None, rdzv_port: int | None = None,
                    forward_env: Sequence[str] = (), ps_per_node: int = 0, transport: str | None = None,
                    timeout: float | None = None, grace: float = DEFAULT_GRACE, ps_grace: float = DEFAULT_PS_GRACE,
                    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT, node_timeout: float = DEFAULT_NODE_TIMEOUT,
                    output: TextIO | None = None, error_output: TextIO | None = None) -> int:
    """Start every node's launcher of ``hostfile`` (see the module doc); return node 0's exit status."""
    if not command:
        raise ConfigurationError("no command to launch: put it after '--', e.g. stratagem launch --hostfile "
                                 "hosts -- python train.py")
    try:
        with open(hostfile) as f:
            hosts = parse_hostfile(f.read(), hostfile)
    except OSError as exc:
        raise ConfigurationError(f"--hostfile {hostfile}: cannot read it ({exc.strerror})") from None
    remote = shlex.split(remote_command if remote_command is not None else DEFAULT_REMOTE_COMMAND)
    if not remote:
        raise ConfigurationError("--remote-command is empty: give the program that runs a command on a host, "
                                 "e.g. --remote-command 'ssh -o BatchMode=yes'")
    port = DEFAULT_RDZV_PORT if rdzv_port is None else rdzv_port
    if not 0 < port < 65536:
        raise ConfigurationError(f"--rdzv-port must be a port number 1..65535, got {port}")
    env: dict[str, str] = {}
    for name in forward_env:
        if name == "STRATAGEM_SECRET":
            raise ConfigurationError("--env STRATAGEM_SECRET: the secret never goes on a command line; it is "
                                     "passed to every node on its standard input already")
        if name not in os.environ:
            raise ConfigurationError(f"--env {name}: {name} is not set here")
        env[name] = os.environ[name]
    secret = secret or os.environ.get("STRATAGEM_SECRET") or secrets.token_hex(32)
    options = ["--grace", repr(grace), "--ps-grace", repr(ps_grace), "--rdzv-timeout", repr(rdzv_timeout),
               "--node-timeout", repr(node_timeout)]
    if transport:
        options += ["--transport", transport]
    if timeout is not None:
        options += ["--timeout", repr(timeout)]
    rdzv = format_address(hosts[0][0], port)
    out = Sink(output if output is not None else sys.stdout)
    err = Sink(error_output if error_output is not None else sys.stderr)
    nodes: list[RunningTask] = []
    pump = OutputPump()
    try:
        with SignalTrap() as trap:
            for rank, (host, slots) in enumerate(hosts):
                shell = node_command(command, nnodes=len(hosts), rank=rank, rdzv=rdzv, workers=slots,
                                     ps=ps_per_node, options=options, env=env)
                try:
                    process = subprocess.Popen(die_with_launcher([*remote, host, shell]), stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
                except OSError as exc:
                    raise ConfigurationError(f"--remote-command: cannot run {remote[0]!r} ({exc.strerror})") from None
                nodes.append(RunningTask(TaskId("node", rank), process))
                pump.add(process.stdout, PipeReader(f"[{host}] ", out))
                pump.add(process.stderr, PipeReader(f"[{host}] ", err))
                try:
                    process.stdin.write((secret + "\n").encode())
                    process.stdin.close()
                except OSError:
                    pass  # it ended already: its exit status tells
            _wait(nodes, pump, trap, END_SLACK)
            stop(nodes, pump, trap, grace)  # those still running: one node's launcher never started, say
            pump.drain(1.0, POLL_INTERVAL)
    finally:
        kill_and_reap(nodes)
        pump.close()
    codes = [node.process.returncode for node in nodes]
    err.write("stratagem launch: " + ", ".join(f"node {rank} ({host}) {_status(node)}"
                                               for rank, ((host, _), node) in enumerate(zip(hosts, nodes))) + "\n")
    if trap.received:
        return EXIT_SIGNALLED[trap.received[0]]
    first = codes[0]
    return first if first is not None and first >= 0 else next((c for c in codes if c and c > 0), 1)


def _status(node: RunningTask) -> str:
    code = node.process.returncode
    if code is None or code < 0:
        return "stopped" if node.stopped_by_launcher else "killed"
    return f"exit {code}" + (" (the remote command failed: is the host reachable?)" if code == 255 else "")


def _wait(nodes: list[RunningTask], pump: OutputPump, trap: SignalTrap, slack: float) -> None:
    """Until every remote launcher has ended, or ``slack`` seconds after the first did (they end
    together). A signal to us is passed on to them."""
    first_end = None
    passed = 0
    while any(node.poll() is None for node in nodes):
        pump.pump(POLL_INTERVAL)
        if len(trap.received) > passed:
            for node in nodes:
                node.send(trap.received[passed])
            passed = len(trap.received)
        if first_end is None and any(node.poll() is not None for node in nodes):
            first_end = time.monotonic()
        if first_end is not None and time.monotonic() - first_end > slack:
            return
