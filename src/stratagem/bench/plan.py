"""Which strategy x transport (x compression) combinations a bench runs, the cluster each needs, and
why any is skipped.

A combination is a strategy (with its consistency mode for the parameter-server strategies, written
``parameter_server:sync``) on a transport, with the gradients compressed by a compressor plugin or not
(``--compression none,fp16,topk``). Every combination asked for is either run or listed as
skipped with the reason: a transport that is not usable here (with the install hint), one that only
works inside one process, a strategy the bench has no driver for, a parameter-server strategy
without ps tasks, a compressor given to a strategy that takes none (``in_graph``).

    >>> [c.label for c in parse_strategies("mirrored,parameter_server:sync")]
    ['mirrored', 'parameter_server:sync']
    >>> parse_strategies("between_graph:eventually")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: between_graph has no mode 'eventually': use async, sync or bounded
"""

from __future__ import annotations

from dataclasses import dataclass

from stratagem.core.errors import ConfigurationError
from stratagem.bench.availability import TransportCheck

#: Strategies the bench knows how to drive (see train_task.py), with their modes.
MODES = {"mirrored": (), "in_graph": (), "between_graph": ("async", "sync", "bounded"),
         "parameter_server": ("async", "sync", "bounded")}
#: Strategies whose variables live on ps tasks.
NEEDS_PS = ("between_graph", "parameter_server")
#: What ``stratagem bench`` runs when ``--strategies`` is not given.
DEFAULT_STRATEGIES = "mirrored,in_graph,between_graph:sync,between_graph:async,parameter_server:async"
#: Staleness for ``bounded`` runs.
BOUNDED_STALENESS = 2
#: What ``--compression`` says for uncompressed gradients.
NO_COMPRESSION = "none"


@dataclass(frozen=True)
class StrategyChoice:
    name: str
    mode: str | None = None

    @property
    def label(self) -> str:
        return f"{self.name}:{self.mode}" if self.mode else self.name

    def options(self) -> dict:
        """Strategy options beyond ``mode``."""
        return {"staleness": BOUNDED_STALENESS} if self.mode == "bounded" else {}


@dataclass(frozen=True)
class Cluster:
    """The tasks one combination launches (``chief``: a separate coordinator task)."""

    workers: int
    ps: int = 0
    chief: bool = False

    def as_dict(self) -> dict:
        return {"worker": self.workers, "ps": self.ps, "chief": int(self.chief)}


@dataclass(frozen=True)
class Combination:
    strategy: StrategyChoice
    transport: str
    cluster: Cluster | None = None
    skipped: str | None = None
    mpi_job: bool = False      # launched as one mpiexec job (the transport's ``launcher``)
    compression: str | None = None   # a compressor's registered name; None: uncompressed

    @property
    def label(self) -> str:
        suffix = f" + {self.compression}" if self.compression else ""
        return f"{self.strategy.label} x {self.transport}{suffix}"


def _split(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigurationError(f"expected a comma-separated list, got {text!r}")
    return items


def parse_strategies(text: str) -> list[StrategyChoice]:
    """``"mirrored,parameter_server:sync"`` -> choices; an unknown mode is an error naming the valid ones
    (*names* are checked against the plugins by :func:`plan`, so third-party ones count)."""
    choices = []
    for item in _split(text):
        name, _, mode = item.partition(":")
        name, mode = name.strip(), mode.strip() or None
        if name in MODES:
            if mode and mode not in MODES[name]:
                valid = ", ".join(MODES[name][:-1]) + " or " + MODES[name][-1] if MODES[name] else ""
                raise ConfigurationError(f"{name} has no mode {mode!r}: " +
                                         (f"use {valid}" if valid else f"{name} takes no mode"))
            if mode is None and MODES[name]:
                mode = MODES[name][0]
        choices.append(StrategyChoice(name, mode))
    return list(dict.fromkeys(choices))


def parse_transports(text: str) -> list[str]:
    return list(dict.fromkeys(_split(text)))


def parse_compressions(text: str) -> list[str | None]:
    """``"none,fp16,topk"`` -> ``[None, "fp16", "topk"]`` (names are checked against the plugins by
    :func:`plan`, so third-party compressors count).

    >>> parse_compressions("none, topk,powersgd")
    [None, 'topk', 'powersgd']
    """
    return [None if name == NO_COMPRESSION else name for name in dict.fromkeys(_split(text))]


def cluster_for(strategy: StrategyChoice, mpi_job: bool, workers: int, ps: int) -> Cluster:
    """The launch shape: ``workers`` replicas train; ps tasks only for the strategies that use them; the
    parameter_server coordinator is a task of its own (in an MPI job, rank 0: one more worker)."""
    ps = ps if strategy.name in NEEDS_PS else 0
    if strategy.name == "parameter_server":
        if mpi_job:
            return Cluster(workers + 1, ps)
        return Cluster(workers, ps, chief=True)
    return Cluster(workers, ps)


def check_names(strategies: list[StrategyChoice], transports: list[str], manager,
                compressions: list[str | None] = ()) -> None:
    """Refuse a strategy, transport or compressor name no plugin registers (a typo, most likely:
    ``mirored``), with the known ones and a did-you-mean: a usage error, not a bench of nothing."""
    from stratagem.core.errors import PluginError

    for option, kind, names in (("--strategies", "strategy", [s.name for s in strategies]),
                                ("--transports", "transport", transports),
                                ("--compression", "compressor", [c for c in compressions if c])):
        for name in names:
            try:
                manager.spec(kind, name)
            except PluginError as exc:
                raise ConfigurationError(f"{option}: {exc}") from None


def plan(strategies: list[StrategyChoice], transports: list[str], *, workers: int, ps: int,
         manager, compressions: list[str | None] = (None,), hosts=None) -> list[Combination]:
    """Every combination, in strategy-major order (then transport, then compression), each with its
    cluster or the reason it is skipped.

    ``manager`` is the plugin manager: it says which strategies, transports and compressors exist (an
    unknown name raises ``ConfigurationError``: :func:`check_names`); each transport is checked once
    (:func:`~stratagem.bench.availability.check_transport`, importing it), each compressor's usability
    too, and a strategy without a ``compression`` option is skipped with the reason it gives. With
    ``hosts`` (emulated hosts), a transport launched by its own launcher (``mpi``) is skipped: the
    emulated hosts are the local launcher's."""
    from stratagem.core.errors import PluginError
    from stratagem.bench.availability import check_transport

    check_names(strategies, transports, manager, compressions)
    unusable = {name: manager.usable("compressor", name, check=True) for name in compressions if name}
    checks: dict[str, TransportCheck] = {}
    for transport in transports:
        try:
            checks[transport] = check_transport(transport)
        except PluginError as exc:
            checks[transport] = TransportCheck(transport, str(exc))

    combinations = []
    for strategy in strategies:
        if strategy.name not in MODES:
            problem = (f"the bench has no driver for the third-party strategy {strategy.name!r} "
                       f"(it drives {', '.join(MODES)})")
        elif strategy.name in NEEDS_PS and ps < 1:
            problem = f"{strategy.name} keeps its variables on ps tasks: run with --ps 1 or more"
        elif strategy.name == "in_graph" and workers < 1:
            problem = "in_graph needs at least one worker"
        else:
            problem = None
        refusal = _compression_refusal(strategy.name, manager) if strategy.name in MODES else None
        for transport in transports:
            check = checks[transport]
            reason = problem or check.skip
            if reason is None and hosts is not None and check.mpi_job:
                reason = (f"{transport} jobs start under their own launcher (mpiexec), which does not run on "
                          f"emulated hosts: leave out --hosts, or use zmq, grpc or shm")
            if reason is None and check.max_np is not None and workers + ps + 1 > check.max_np:
                reason = f"needs one GPU per task: up to {workers + ps + 1} tasks, {check.max_np} GPU(s) visible"
            for compression in compressions:
                why = reason or (compression and (unusable[compression] or refusal))
                cluster = None if why else cluster_for(strategy, check.mpi_job, workers, ps)
                combinations.append(Combination(strategy, transport, cluster, why or None, check.mpi_job,
                                                compression))
    return combinations


def _compression_refusal(strategy: str, manager) -> str | None:
    """Why ``strategy`` cannot compress gradients (it has no ``compression`` option), or None."""
    cls = manager.strategy_class(strategy)
    if "compression" in cls.option_defaults():
        return None
    return f"{strategy} cannot compress gradients: {cls.compression_refusal}"
