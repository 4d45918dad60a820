"""A Slurm job step as a cluster: ranks from ``srun``'s variables, addresses from its node list.

``srun python3 train.py`` starts one process per task and tells each its rank (``SLURM_PROCID``), the
step's size (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``), its index on its node
(``SLURM_LOCALID``), the step's nodes in Slurm's compressed form (``SLURM_STEP_NODELIST``, e.g.
``node[01-04,07],gpu-a[1-2]``) and how many tasks each node runs (``SLURM_STEP_TASKS_PER_NODE``, e.g.
``2(x3),1``). Slurm does not hand out ports, so the job names a base port, ``STRATAGEM_PORT``: the
task with local id ``k`` on node ``h`` listens on ``h:STRATAGEM_PORT+k``. Every task computes the same
addresses for every rank, as long as it knows how Slurm laid the ranks out over the nodes: by
blocks (the default: consecutive ranks share a node) or cyclically (``--distribution=cyclic``).

The node list is parsed here (no ``scontrol`` needed):

    >>> expand_nodelist("node[01-03,07],gpu-a[1-2],login")
    ['node01', 'node02', 'node03', 'node07', 'gpu-a1', 'gpu-a2', 'login']
    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    >>> layout(4, [2, 2], "cyclic")
    [(0, 0), (1, 0), (0, 1), (1, 1)]
"""

from __future__ import annotations

import re
from typing import Mapping

from stratagem.core.errors import ConfigurationError

#: Where a step's nodes and tasks per node are read, in order: the step's own, then the job's.
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
#: The base port: the task with local id k listens on STRATAGEM_PORT + k.
PORT_VAR = "STRATAGEM_PORT"
#: How ranks are laid out over the nodes (``srun --distribution``), as far as addresses go.
DISTRIBUTIONS = ("block", "cyclic")

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*\Z")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?\Z")
#: Refuse node lists that would expand to absurd sizes (a typo like node[1-99999999]).
MAX_NODES = 1 << 16


def _split_top_level(text: str, what: str) -> list[str]:
    """Split on the commas outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ConfigurationError(f"{what}={text!r}: nested '[' at character {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigurationError(f"{what}={text!r}: ']' without '[' at character {i}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigurationError(f"{what}={text!r}: a '[' is not closed")
    parts.append(text[start:])
    return parts


def _expand_range(spec: str, text: str, what: str) -> list[str]:
    """``01-03,7`` -> ``['01', '02', '03', '7']``; a range keeps the zero padding of its first bound."""
    out = []
    for item in spec.split(","):
        match = _RANGE.match(item)
        if not match:
            raise ConfigurationError(f"{what}={text!r}: {item!r} is not a number or a range like 01-04")
        lo, hi = match[1], match[2]
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ConfigurationError(f"{what}={text!r}: the range {item!r} goes downwards")
        if int(hi) - int(lo) >= MAX_NODES:
            raise ConfigurationError(f"{what}={text!r}: the range {item!r} has more than {MAX_NODES} nodes")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(text: str, what: str = "SLURM_STEP_NODELIST") -> list[str]:
    """Slurm's compressed host list as host names, in order (``node[01-02],x`` -> node01, node02, x).

    Several bracket groups in one name expand to every combination, as Slurm does
    (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2). Raises ``ConfigurationError`` naming ``what`` for
    anything else.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigurationError(f"{what} is empty: run the script with srun inside a Slurm allocation")
    hosts: list[str] = []
    for part in _split_top_level(text.strip(), what):
        if not part:
            raise ConfigurationError(f"{what}={text!r}: an empty host name (two commas in a row?)")
        names = [""]
        for literal, spec in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            names = [n + literal for n in names]
            if spec:
                names = [n + v for n in names for v in _expand_range(spec, text, what)]
            elif "[]" in part:
                raise ConfigurationError(f"{what}={text!r}: empty brackets in {part!r}")
        if not all(_HOST.match(n) for n in names):
            raise ConfigurationError(f"{what}={text!r}: {part!r} is not a host name")
        hosts.extend(names)
        if len(hosts) > MAX_NODES:
            raise ConfigurationError(f"{what}={text!r} names more than {MAX_NODES} nodes")
    return hosts


def expand_tasks_per_node(text: str, what: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks-per-node list as one count per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigurationError(f"{what} is empty: run the script with srun inside a Slurm allocation")
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASKS.match(item)
        if not match:
            raise ConfigurationError(f"{what}={text!r}: {item!r} is not a count like 2 or 2(x3)")
        repeat = int(match[2]) if match[2] is not None else 1
        if repeat < 1 or repeat > MAX_NODES or len(counts) + repeat > MAX_NODES:
            raise ConfigurationError(f"{what}={text!r}: {item!r} repeats a count {repeat} times")
        counts.extend([int(match[1])] * repeat)
    return counts


def layout(size: int, counts: list[int], distribution: str = "block") -> list[tuple[int, int]]:
    """``(node index, local id)`` of every rank ``0..size-1``, for ``counts`` tasks per node.

    ``block``: ranks fill the first node, then the next; ``cyclic``: one rank per node in turn,
    skipping the nodes that are full (what ``srun --distribution=cyclic`` does).
    """
    if distribution == "block":
        return [(node, local) for node, count in enumerate(counts) for local in range(count)][:size]
    placed, used = [], [0] * len(counts)
    while len(placed) < size and any(u < c for u, c in zip(used, counts)):
        for node, count in enumerate(counts):
            if used[node] < count and len(placed) < size:
                placed.append((node, used[node]))
                used[node] += 1
    return placed


def distribution(env: Mapping[str, str]) -> str:
    """How srun laid the ranks out over the nodes (``SLURM_DISTRIBUTION``'s node level; default block)."""
    value = env.get("SLURM_DISTRIBUTION") or ""
    level = re.split(r"[:,]", value, maxsplit=1)[0].strip().lower()
    if level in ("", "*", "block"):
        return "block"
    if level == "cyclic":
        return "cyclic"
    raise ConfigurationError(
        f"SLURM_DISTRIBUTION={value!r}: stratagem can tell where each rank listens when srun lays the "
        f"ranks out by block (the default) or cyclically; run srun --distribution=block, or give the "
        f"addresses yourself in STRATAGEM_CONFIG/TF_CONFIG"
    )


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if env.get(name):
            return name, env[name]
    return None


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    if not (value.isascii() and value.isdigit()):
        raise ConfigurationError(f"environment variable {name}={value!r} is not an integer >= 0")
    return int(value)


def step_world(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(rank, size)`` of this process in its Slurm step, or ``None`` outside one.

    The size is ``SLURM_STEP_NUM_TASKS`` when srun set it, else ``SLURM_NTASKS``.
    """
    if "SLURM_PROCID" not in env:
        return None
    size_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    if not env.get(size_var):
        return None
    rank, size = _int(env, "SLURM_PROCID"), _int(env, size_var)
    if not rank < size:
        raise ConfigurationError(f"SLURM_PROCID={rank} is outside the step of {size} tasks ({size_var})")
    return rank, size


def is_step(env: Mapping[str, str]) -> bool:
    """True inside a task srun started (a job step), not in a batch script or salloc's shell."""
    return bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))


def addresses(env: Mapping[str, str], rank: int, size: int) -> list[str]:
    """The ``host:port`` of every rank of the step, from the node list, the tasks per node and
    ``STRATAGEM_PORT`` (see the module doc). Raises ``ConfigurationError`` naming what is missing,
    or when this process's own place (``SLURMD_NODENAME``, ``SLURM_LOCALID``) contradicts the layout."""
    port_text = env.get(PORT_VAR, "")
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ConfigurationError(f"{PORT_VAR}={port_text!r} is not a port (an integer 1..65535)")
    base = int(port_text)
    found = _first(env, NODELIST_VARS)
    if found is None:
        raise ConfigurationError(
            f"{PORT_VAR} is set but none of {', '.join(NODELIST_VARS)} is: the addresses come from the step's "
            f"node list, which srun sets; start the script with srun inside an allocation"
        )
    nodelist_var, nodelist = found
    # The step's counts go with the step's node list, the job's with the job's.
    per_node_vars = TASKS_PER_NODE_VARS if nodelist_var == "SLURM_STEP_NODELIST" else TASKS_PER_NODE_VARS[1:]
    found = _first(env, per_node_vars)
    if found is None:
        raise ConfigurationError(
            f"{nodelist_var} is set but {' / '.join(per_node_vars)} is not: the tasks per node say which "
            f"node each rank runs on; start the script with srun, which sets them"
        )
    counts_var, counts_text = found
    hosts = expand_nodelist(nodelist, nodelist_var)
    counts = expand_tasks_per_node(counts_text, counts_var)
    if len(counts) != len(hosts) or sum(counts) != size:
        raise ConfigurationError(
            f"{nodelist_var}={nodelist!r} ({len(hosts)} node(s)) and {counts_var}={counts_text!r} "
            f"({len(counts)} node(s), {sum(counts)} task(s)) do not describe a step of {size} tasks"
        )
    if base + max(counts) - 1 > 65535:
        raise ConfigurationError(f"{PORT_VAR}={base} leaves no room for {max(counts)} tasks per node "
                                 f"(ports {base}..{base + max(counts) - 1}); choose a lower base port")
    placed = layout(size, counts, distribution(env))
    node, local = placed[rank]
    where = {"SLURMD_NODENAME": hosts[node], "SLURM_LOCALID": str(local)}
    wrong = [f"{name}={env[name]!r} (the layout says {value!r})" for name, value in where.items()
             if env.get(name) not in (None, "", value)]
    if wrong:
        raise ConfigurationError(
            f"SLURM_PROCID={rank} should run on {hosts[node]} as local task {local} by {nodelist_var} and "
            f"{counts_var}, but {'; '.join(wrong)}: the ranks are laid out in a way stratagem cannot "
            f"follow; run srun --distribution=block, or give the addresses in STRATAGEM_CONFIG/TF_CONFIG"
        )
    return [f"{hosts[n]}:{base + k}" for n, k in placed]
