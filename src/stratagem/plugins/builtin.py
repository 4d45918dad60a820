"""The built-in strategies, transports and compressors, registered through the same hooks as third-party plugins.

Targets are lazy import paths, so listing the built-ins imports none of their modules.

    >>> [spec.name for spec in stratagem_add_transports()]
    ['local', 'zmq', 'grpc', 'mpi', 'nccl', 'shm']
    >>> [spec.name for spec in stratagem_add_strategies()]
    ['mirrored', 'between_graph', 'parameter_server', 'in_graph']
    >>> [spec.name for spec in stratagem_add_compressors()]
    ['fp16', 'bf16', 'topk', 'powersgd']
"""

from __future__ import annotations

from stratagem.plugins.hookspecs import PluginSpec, hookimpl


@hookimpl
def stratagem_add_transports() -> list[PluginSpec]:
    return [
        PluginSpec(
            "local", "stratagem.transports.local:LocalTransport", "transport",
            description="every task of the world in one process (tests, single-process multi-replica)",
        ),
        PluginSpec(
            "zmq", "stratagem.transports.zmq.transport:ZmqTransport", "transport",
            requires=("zmq",), install_hint="pip install 'pyzmq>=25'",
            description="ZeroMQ sockets over TCP: the default transport between processes and machines",
        ),
        PluginSpec(
            "grpc", "stratagem.transports.grpc.transport:GrpcTransport", "transport",
            requires=("grpc",), install_hint="pip install 'stratagem[grpc]'",
            description="gRPC bidirectional streams over HTTP/2, with optional TLS and mutual TLS",
        ),
        PluginSpec(
            "mpi", "stratagem.transports.mpi.transport:MpiTransport", "transport",
            requires=("mpi4py",), install_hint="pip install 'stratagem[mpi]'",
            description="MPI point-to-point and native collectives; every task a rank of one mpiexec job",
        ),
        PluginSpec(
            "nccl", "stratagem.transports.nccl:NcclTransport", "transport",
            requires=("cupy",), install_hint="pip install 'stratagem[gpu]'",
            description="NCCL collectives on the GPU (cupy), one GPU per process; messages over ZeroMQ",
        ),
        PluginSpec(
            "shm", "stratagem.transports.shm.transport:ShmTransport", "transport",
            requires=("zmq",), install_hint="pip install 'pyzmq>=25'",
            description="tasks on one host: messages through shared-memory rings (Linux memfd); control over ZeroMQ",
        ),
    ]


@hookimpl
def stratagem_add_strategies() -> list[PluginSpec]:
    return [
        PluginSpec(
            "mirrored", "stratagem.strategies.mirrored.strategy:MirroredStrategy", "strategy",
            description="a copy of every variable on every replica; gradients all-reduced every step",
        ),
        PluginSpec(
            "between_graph", "stratagem.strategies.ps.between_graph:BetweenGraphStrategy", "strategy",
            description="variables on ps tasks; every worker runs its own loop (async, sync or bounded)",
        ),
        PluginSpec(
            "parameter_server", "stratagem.strategies.ps.parameter_server:ParameterServerStrategy", "strategy",
            description="variables on ps tasks; a coordinator schedules step functions onto the workers",
        ),
        PluginSpec(
            "in_graph", "stratagem.strategies.in_graph.strategy:InGraphStrategy", "strategy",
            description="one client splits each batch over its devices and the worker tasks; synchronous",
        ),
    ]


@hookimpl
def stratagem_add_compressors() -> list[PluginSpec]:
    return [
        PluginSpec(
            "fp16", "stratagem.compression.casts:Fp16Compressor", "compressor",
            description="gradients as float16: half the bytes (values beyond 65504 become inf)",
        ),
        PluginSpec(
            "bf16", "stratagem.compression.casts:Bf16Compressor", "compressor",
            description="gradients as bfloat16 bits (round to nearest even): half the bytes, float32's range",
        ),
        PluginSpec(
            "topk", "stratagem.compression.topk:TopKCompressor", "compressor",
            description="the largest ratio of each gradient's entries (indices + values), with error feedback",
        ),
        PluginSpec(
            "powersgd", "stratagem.compression.powersgd:PowerSGDCompressor", "compressor",
            description="rank-r factors P, Q of each matrix gradient, warm-started, with error feedback",
        ),
    ]
