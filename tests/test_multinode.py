"""Multi-node launch (``stratagem launch --nnodes N --node-rank I --rdzv HOST:PORT``, ``--hostfile``) on
emulated hosts: two network namespaces joined by a veth pair, each a "node" with its own address
(10.213.x.1 and 10.213.x.2). Every node's launcher runs inside its namespace (``ip netns exec``), as
``stratagem launch`` would on a machine of its own; for ``--hostfile`` a small script that enters the
namespace of the host it is given stands in for ssh (no sshd here), called as ssh is and with as bare
an environment.

The namespaces exist only for this module: nothing is created in the machine's own network namespace,
and the namespaces are deleted and every process reaped at teardown, whatever happens. Skipped where
namespaces cannot be made (not root, no ``ip``). In a namespace of our own every port is free, so the
rendezvous ports are fixed per test.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from stratagem.core.errors import ConfigurationError
from stratagem.launch.hostfile import parse_hostfile

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tests" / "scripts" / "multinode_train.py"
PLAIN = [sys.executable, "-m", "stratagem.testing.plain_training"]
LAUNCH = [sys.executable, "-m", "stratagem", "launch"]
WAIT = 60  # seconds any one launcher may take
CMD_TIMEOUT = 20

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces need Linux"),
              pytest.mark.timeout(120)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT, check=check)


def _why_no_netns() -> str | None:
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"nodesprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


class Nodes:
    """Two namespaces joined by one veth pair (created inside them: the machine's namespace gets nothing)."""

    def __init__(self):
        pid = os.getpid()
        self.names = [f"nodes{pid}n{i}" for i in range(2)]
        self.subnet = f"10.213.{pid % 250 + 1}"
        self.procs: list[subprocess.Popen] = []

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def create(self) -> None:
        for ns in self.names:
            _ip("netns", "add", ns)
        _ip("-n", self.names[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", self.names[1])
        for i, ns in enumerate(self.names):
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def spawn(self, node: int | None, argv: list[str], env: dict, log: Path, **kwargs) -> subprocess.Popen:
        """``argv`` inside node ``node``'s namespace (None: here), output to ``log``."""
        prefix = ["ip", "netns", "exec", self.names[node]] if node is not None else []
        with open(log, "w") as out:
            proc = subprocess.Popen([*prefix, *argv], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                    start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def destroy(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.names:
            _ip("netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def nodes():
    reason = _why_no_netns()
    if reason:
        pytest.skip(reason)
    n = Nodes()
    try:
        try:
            n.create()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot build the two-node network: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
        yield n
    finally:
        n.destroy()


@pytest.fixture
def secret() -> str:
    return "sg-" + secrets.token_hex(16)


def _env(secret: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    if secret is not None:
        env["STRATAGEM_SECRET"] = secret
    return env


def _node_args(nodes: Nodes, rank: int, port: int, *extra: str) -> list[str]:
    return [*LAUNCH, "--nnodes", "2", "--node-rank", str(rank), "--rdzv", f"{nodes.address(0)}:{port}",
            "--rdzv-timeout", "30", "--timeout", str(WAIT), *extra]


def _finish(proc: subprocess.Popen, log: Path, seconds: float = WAIT) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        pytest.fail(f"launcher still running after {seconds}s:\n{log.read_text()[-3000:]}")
    return code, log.read_text()


def _run_two(nodes: Nodes, tmp: Path, port: int, command: list[str], env: dict, *extra: str) -> list[tuple[int, str]]:
    procs = [nodes.spawn(rank, [*_node_args(nodes, rank, port, *extra), "--", *command], env, tmp / f"node{rank}.log")
             for rank in range(2)]
    return [_finish(proc, tmp / f"node{rank}.log") for rank, proc in enumerate(procs)]


def _summary(output: str) -> str:
    """The launcher's closing summary: its last 'stratagem launch: ...' line and the table under it."""
    lines = output.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("stratagem launch: ") and "(" in line
                and line.rstrip().endswith("s)"))
    return "\n".join(line for line in lines[start:] if not line.startswith("["))


def _wait_for(log: Path, text: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while text not in log.read_text():
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} never appeared:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _procs_with(marker: str) -> list[int]:
    """Pids whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


# -- training across nodes ----------------------------------------------------------------------------


def test_two_nodes_train_bitwise_the_same_weights_as_one_node(nodes, secret, tmp_path):
    env = _env(secret)
    one = subprocess.run([*LAUNCH, "--worker", "2", "--timeout", str(WAIT), "--", sys.executable, str(TRAIN)],
                         env=env, capture_output=True, text=True, timeout=WAIT + 10, cwd=str(ROOT))
    assert one.returncode == 0, one.stdout + one.stderr
    reference = re.findall(r"^\[worker:\d\] weights (\w+)", one.stdout, re.M)
    assert len(reference) == 2 and len(set(reference)) == 1, one.stdout

    results = _run_two(nodes, tmp_path, 29401, [sys.executable, str(TRAIN)], env, "--worker-per-node", "1")
    for rank, (code, output) in enumerate(results):
        assert code == 0, output
        assert re.findall(r"^\[worker:(\d)\] weights (\w+)", output, re.M) == [(str(rank), reference[0])], output
        # every task of the job listened on its node's own address
        assert f"node {rank} of 2: running worker:{rank}" in output, output
    assert f"node 1 joined from {nodes.address(1)}" in results[0][1]
    assert _summary(results[0][1]) == _summary(results[1][1])
    assert "all 2 tasks on 2 nodes finished successfully" in _summary(results[0][1])


def test_a_task_failing_on_node_1_ends_node_0_naming_it(nodes, secret, tmp_path):
    results = _run_two(nodes, tmp_path, 29402, [*PLAIN, "mirrored", "zmq", "worker:1", "raise"], _env(secret))
    (code0, out0), (code1, out1) = results
    assert code0 == 1 and code1 == 1, out0 + out1
    assert "[worker:1] RuntimeError: worker:1 failed on purpose" in out1
    summary = _summary(out0)
    assert summary == _summary(out1), f"node 0:\n{out0}\nnode 1:\n{out1}"  # the same summary on every node
    # worker:1 exits 1, unless node 0's stop reaches it while its interpreter is still ending (worker:0
    # lost it at once): it was failing already (its traceback), so it is named all the same.
    assert re.match(r"stratagem launch: FAILED: worker:1 \(node 1\) (exited with code 1|failed \(its traceback "
                    r"is above\); it was stopped by the launcher \([^)]+\) while ending); stopped every task on 2 "
                    r"nodes", summary), summary
    assert re.search(r"^  worker:1\s+1\s+\d+\s+(exit 1|stopped by launcher \([^)]+\))  <- first failure$",
                     summary, re.M), summary
    assert re.search(r"^  worker:0\s+0\s+\d+\s+", summary, re.M), summary


def test_a_stalled_task_on_node_1_is_named_not_the_peer_that_gave_up_on_it(nodes, secret, tmp_path):
    """worker:1 is SIGSTOPped mid-training: worker:0 (node 0) gives up on it (PeerLostError after the peer
    timeout, or under load a TransportTimeout naming it) and exits first, yet both launchers name worker:1."""
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, str(ROOT / "tests" / "scripts" / "mirrored_train.py"), "--out", str(out),
               "--steps", "1000000", "--peer-timeout", "3", "--timeout", "6"]
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    procs = [nodes.spawn(rank, [*_node_args(nodes, rank, 29407, "--grace", "1"), "--", *command], _env(secret),
                         logs[rank]) for rank in range(2)]
    for log in logs:
        _wait_for(log, "running worker:")
    deadline = time.monotonic() + 30
    while not (worker1 := [pid for pid in _procs_with(str(out)) if _task_of(pid) == 1]):
        assert time.monotonic() < deadline, "worker:1 never started"
        time.sleep(0.05)
    time.sleep(1.0)  # well into training
    os.kill(worker1[0], signal.SIGSTOP)
    (code0, out0), (code1, out1) = (_finish(p, log) for p, log in zip(procs, logs))
    assert code0 == 1 and code1 == 1, out0 + out1
    summary = _summary(out0)
    assert summary == _summary(out1), f"node 0:\n{out0}\nnode 1:\n{out1}"
    assert summary.startswith("stratagem launch: FAILED: worker:1 (node 1) stopped answering: worker:0 lost it"), out0
    assert re.search(r"^  worker:1\s+1\s+\d+\s+stopped by launcher \(SIGKILL\)  <- first failure$", summary, re.M), summary
    assert re.search(r"^  worker:0\s+0\s+\d+\s+exit [13]$", summary, re.M), summary


def _task_of(pid: int) -> int | None:
    """The task index in a process's STRATAGEM_CONFIG, if it has one."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            match = re.search(rb'"task": \{"type": "worker", "index": (\d+)\}', f.read())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def test_a_node_launcher_killed_ends_the_job_naming_that_node(nodes, secret, tmp_path):
    marker = f"nodes-marker-{uuid.uuid4().hex}"
    command = [sys.executable, "-c", "import time, sys; time.sleep(60)", marker]
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    procs = [nodes.spawn(rank, [*_node_args(nodes, rank, 29403), "--", *command], _env(secret), logs[rank])
             for rank in range(2)]
    for log in logs:
        _wait_for(log, "running worker:")
    os.kill(procs[1].pid, signal.SIGKILL)  # ip netns exec has exec'd the launcher: this is its pid
    code, output = _finish(procs[0], logs[0], 30)
    assert code == 1, output
    assert "FAILED: node 1's launcher was lost (connection closed)" in _summary(output), output
    assert re.search(r"^  worker:1\s+1\s+\?\s+unknown: node 1 lost", _summary(output), re.M), output
    deadline = time.monotonic() + 10  # node 1's task died with its launcher
    while _procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _procs_with(marker)


def test_a_briefly_stalled_node_launcher_is_not_taken_for_dead(nodes, secret, tmp_path):
    command = [sys.executable, "-c", "import time; time.sleep(4); print('done')"]
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    procs = [nodes.spawn(rank, [*_node_args(nodes, rank, 29404, "--node-timeout", "3"), "--", *command],
                         _env(secret), logs[rank]) for rank in range(2)]
    for log in logs:
        _wait_for(log, "running worker:")
    os.kill(procs[1].pid, signal.SIGSTOP)
    time.sleep(1.5)  # half the node timeout: slow, not dead
    os.kill(procs[1].pid, signal.SIGCONT)
    for proc, log in zip(procs, logs):
        code, output = _finish(proc, log)
        assert code == 0, output
        assert "all 2 tasks on 2 nodes finished successfully" in _summary(output), output


def test_a_node_launcher_stalled_past_the_node_timeout_ends_the_job_naming_it(nodes, secret, tmp_path):
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    procs = [nodes.spawn(rank, [*_node_args(nodes, rank, 29409, "--node-timeout", "2", "--grace", "1"), "--",
                                *command], _env(secret), logs[rank]) for rank in range(2)]
    for log in logs:
        _wait_for(log, "running worker:")
    os.kill(procs[1].pid, signal.SIGSTOP)
    code, output = _finish(procs[0], logs[0], 30)
    assert code == 1, output
    assert "FAILED: node 1's launcher was lost (silent for 2s, --node-timeout)" in _summary(output), output
    os.kill(procs[1].pid, signal.SIGCONT)  # woken after the end: it finds node 0 gone and stops its task
    code1, output1 = _finish(procs[1], logs[1], 30)
    assert code1 == 1 and "lost node 0" in _summary(output1), output1


# -- the secret ---------------------------------------------------------------------------------------


def test_a_wrong_secret_is_refused_naming_the_fix_and_the_rendezvous_goes_on(nodes, secret, tmp_path):
    """Node 0 refuses a stranger speaking garbage and a node with another secret (which exits naming the
    fix), keeps waiting, and runs the job once the right node 1 joins. No secret is ever printed."""
    wrong = "sg-" + secrets.token_hex(16)
    port = 29405
    logs = {name: tmp_path / f"{name}.log" for name in ("node0", "stranger", "wrong", "node1")}
    node0 = nodes.spawn(0, [*_node_args(nodes, 0, port), "--", "true"], _env(secret), logs["node0"])
    stranger = nodes.spawn(1, [sys.executable, "-c",
                               "import socket, sys, time\n"
                               "for _ in range(600):\n"
                               "    try:\n"
                               f"        s = socket.create_connection(('{nodes.address(0)}', {port}), timeout=5); break\n"
                               "    except OSError: time.sleep(0.05)\n"
                               "s.sendall(b'GET / HTTP/1.0\\r\\nHost: node0\\r\\n\\r\\n'); s.settimeout(5)\n"
                               "try: print('answer', s.recv(100))\n"
                               "except OSError as exc: print('closed', exc)\n"],
                           _env(None), logs["stranger"])
    assert _finish(stranger, logs["stranger"], 30)[0] == 0
    # Strangers that connect and say nothing hold up no one (each would take node 0's whole handshake
    # time, longer than node 1 waits for its challenge, were connections admitted one by one).
    silent = nodes.spawn(1, [sys.executable, "-c",
                             "import socket, time\n"
                             f"held = [socket.create_connection(('{nodes.address(0)}', {port}), timeout=5) "
                             "for _ in range(3)]\n"
                             "print('holding', flush=True); time.sleep(60)\n"], _env(None), tmp_path / "silent.log")
    _wait_for(tmp_path / "silent.log", "holding")
    code, out_wrong = _finish(nodes.spawn(1, [*_node_args(nodes, 1, port), "--", "true"], _env(wrong), logs["wrong"]),
                              logs["wrong"])
    assert code == 1, out_wrong
    assert "node 0 failed the cluster-secret challenge: the secrets differ" in out_wrong, out_wrong
    assert "STRATAGEM_SECRET" in out_wrong
    code1, out1 = _finish(nodes.spawn(1, [*_node_args(nodes, 1, port), "--", "true"], _env(secret), logs["node1"]),
                          logs["node1"])
    code0, out0 = _finish(node0, logs["node0"])
    assert code0 == 0 and code1 == 0, out0 + out1
    silent.kill()
    refusals = "\n".join(line for line in out0.splitlines()
                         if line.startswith(f"stratagem launch: refused a node connecting from {nodes.address(1)}: "))
    assert "bad magic" in refusals and "secrets differ" in refusals, out0
    for text in (out0, out1, out_wrong):
        assert secret not in text and wrong not in text


def _fake_ssh(nodes: Nodes, tmp_path: Path) -> Path:
    """A stand-in for ssh: called as ssh is (HOST 'SHELL COMMAND'), it runs the command in that host's
    namespace with a bare environment, and exits 255 (as ssh does) for a host it cannot reach."""
    path = tmp_path / "fake_ssh"
    path.write_text(
        "#!/bin/sh\n"
        'host="$1"; shift\n'
        'case "$host" in\n'
        f"  {nodes.address(0)}) ns={nodes.names[0]} ;;\n"
        f"  {nodes.address(1)}) ns={nodes.names[1]} ;;\n"
        '  *) echo "fake_ssh: could not resolve hostname $host" >&2; exit 255 ;;\n'
        "esac\n"
        'exec ip netns exec "$ns" env -i PATH="$PATH" HOME="$HOME" sh -c "$*"\n')
    path.chmod(0o755)
    return path


def test_hostfile_starts_every_node_through_the_remote_command(nodes, secret, tmp_path):
    """--hostfile with a stand-in for ssh that enters the host's namespace with a bare environment; the
    secret reaches every node but never a command line or the output."""
    fake_ssh = _fake_ssh(nodes, tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two emulated hosts\n{nodes.address(0)} slots=1\n\n{nodes.address(1)}:1  # Horovod style\n")
    log = tmp_path / "hostfile.log"
    proc = nodes.spawn(None, [*LAUNCH, "--hostfile", str(hostfile), "--remote-command", str(fake_ssh),
                              "--rdzv-port", "29406", "--env", "PYTHONPATH", "--rdzv-timeout", "30",
                              "--timeout", str(WAIT), "--", *PLAIN, "mirrored", "zmq"], _env(secret), log)
    seen_on_a_command_line = []
    while proc.poll() is None:
        seen_on_a_command_line += _procs_with(secret)
        time.sleep(0.02)
    code, output = _finish(proc, log)
    assert code == 0, output
    assert not seen_on_a_command_line
    assert secret not in output
    for rank in range(2):
        assert re.search(rf"^\[{re.escape(nodes.address(rank))}\] \[worker:{rank}\] trained: w = ", output, re.M), output
    assert f"node 0 ({nodes.address(0)}) exit 0, node 1 ({nodes.address(1)}) exit 0" in output


def test_hostfile_with_an_unreachable_host_ends_promptly_naming_it(nodes, secret, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{nodes.address(0)} slots=1\nno-such-host slots=1\n")
    log = tmp_path / "hostfile.log"
    proc = nodes.spawn(None, [*LAUNCH, "--hostfile", str(hostfile), "--remote-command", str(_fake_ssh(nodes, tmp_path)),
                              "--rdzv-port", "29408", "--env", "PYTHONPATH", "--grace", "1", "--", "true"],
                       _env(secret), log)
    code, output = _finish(proc, log, 30)  # not node 0's --rdzv-timeout (300 s)
    assert code == 255, output
    assert "[no-such-host] fake_ssh: could not resolve hostname no-such-host" in output
    assert (f"node 0 ({nodes.address(0)}) stopped, node 1 (no-such-host) exit 255 (the remote command failed: "
            f"is the host reachable?)") in output


# -- options ------------------------------------------------------------------------------------------


def test_parse_hostfile_forms_and_errors():
    assert parse_hostfile("a slots=2 max_slots=4\nb:3\n# c\n\nd\n") == [("a", 2), ("b", 3), ("d", 1)]
    for text, problem in [("a slots=0\n", "slots=K with K >= 1"), ("a cpus=2\n", "unknown field 'cpus=2'"),
                          ("a\na\n", "listed twice"), ("# nothing\n", "lists no host"), ("a:x\n", "must be a number")]:
        with pytest.raises(ConfigurationError, match=re.escape(problem)):
            parse_hostfile(text)


@pytest.mark.parametrize("args, secret, problem", [
    (["--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:29400"], None, "needs a cluster secret"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:29400", "--secret", "x"], None,
     "command lines are visible to every user"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv", "127.0.0.1:29400"], "s", "--node-rank 2 is out of range"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv", "nowhere"], "s", "--rdzv must be HOST:PORT"),
    (["--nnodes", "2", "--rdzv", "127.0.0.1:29400"], "s", "--nnodes needs --node-rank"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:29400", "--worker", "4"], "s",
     "give --worker-per-node K"),
    (["--hostfile", "/nonexistent/hosts"], "s", "--hostfile /nonexistent/hosts: cannot read it"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:29400", "--secret-file", "/dev/null"], None,
     "--secret-file /dev/null: the file holds no secret"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:29400", "--remote-command", "ssh"], "s",
     "--remote-command: only with --hostfile FILE"),
])
def test_bad_multinode_options_are_usage_errors_naming_the_fix(args, secret, problem, monkeypatch, capsys):
    from stratagem.cli import main

    if secret is None:
        monkeypatch.delenv("STRATAGEM_SECRET", raising=False)
    else:
        monkeypatch.setenv("STRATAGEM_SECRET", secret)
    with pytest.raises(SystemExit) as exited:  # the usage error is raised before anything listens or starts
        main(["launch", *args, "--", "true"])
    assert exited.value.code == 2
    assert problem in capsys.readouterr().err
