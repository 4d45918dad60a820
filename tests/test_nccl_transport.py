"""The ``nccl`` transport: GPU collectives through cupy's NCCL, messages over a ZeroMQ control channel.

Without cupy or a visible CUDA device the GPU tests skip with the reason; the tests that the plugin
is reported unusable (with its reason and install hint) run everywhere.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import stratagem
from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.collectives.communicator import Communicator
from stratagem.core.errors import PluginError
from stratagem.transport_kit.ports import reserve_ports
from stratagem.core.transport import Message
from stratagem.plugins.manager import plugin_manager
from stratagem.testing import run_contract


def _why_unusable() -> str | None:
    return plugin_manager().usable("transport", "nccl", check=True)


REASON = _why_unusable()
needs_gpu = pytest.mark.skipif(REASON is not None, reason=f"nccl transport unusable here: {REASON}")


# -- everywhere ---------------------------------------------------------------------------------------

def test_nccl_is_registered_lazily_with_its_install_hint():
    (info,) = [i for i in plugin_manager().describe(check=True) if i.kind == "transport" and i.name == "nccl"]
    assert info.source == "builtin"
    assert info.target == "stratagem.transports.nccl:NcclTransport"
    if REASON is None:
        assert info.usable
    else:
        assert not info.usable
        assert info.reason == REASON and ("cupy" in info.reason or "CUDA" in info.reason)
        assert info.install_hint == "pip install 'stratagem[gpu]'"


def test_listing_plugins_and_importing_the_module_do_not_import_cupy():
    code = ("import sys, stratagem; from stratagem.plugins.manager import plugin_manager; "
            "plugin_manager().describe(check=False); import stratagem.transports.nccl; "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_stratagem_info_lists_nccl_with_the_reason():
    out = subprocess.run([sys.executable, "-m", "stratagem", "info"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "nccl" in out.stdout
    if REASON is not None:
        assert "stratagem[gpu]" in out.stdout.replace("\n", " ").replace(" ", "") or "gpu" in out.stdout


@pytest.mark.skipif(REASON is None, reason="nccl is usable here")
def test_creating_an_unusable_nccl_transport_is_a_clear_plugin_error():
    cluster = ClusterSpec({"worker": ["127.0.0.1:1"]})
    with pytest.raises(PluginError) as err:
        stratagem.transport("nccl", cluster, "worker:0")
    text = str(err.value)
    assert "nccl" in text and ("cupy" in text or "CUDA" in text)
    assert "pip install 'stratagem[gpu]'" in text


def test_check_usable_explains_missing_cupy_or_gpu():
    from stratagem.transports.nccl import NcclTransport

    if REASON is None:
        NcclTransport.check_usable()
    else:
        with pytest.raises(PluginError, match="nccl"):
            NcclTransport.check_usable()


def test_bad_device_option_is_refused():
    from stratagem.core.errors import ConfigurationError
    from stratagem.transports.nccl import NcclTransport

    with pytest.raises(ConfigurationError, match="device"):
        NcclTransport(ClusterSpec({"worker": ["127.0.0.1:1"]}), "worker:0", device=-1)


# -- on a GPU machine -----------------------------------------------------------------------------------

@pytest.fixture
def world1():
    """A started one-task nccl transport and its communicator."""
    host, held = reserve_ports("127.0.0.1", 1)
    port = held[0].getsockname()[1]
    held[0].close()
    cluster = ClusterSpec({"worker": [f"{host}:{port}"]})
    transport = stratagem.transport("nccl", cluster, "worker:0", timeout=60)
    transport.start()
    comm = Communicator(transport, [TaskId("worker", 0)], timeout=60)
    try:
        yield transport, comm
    finally:
        comm.close()
        transport.close()


@needs_gpu
def test_device_buffers_and_native_collectives(world1):
    transport, _ = world1
    assert transport.device_buffers
    assert {"allreduce", "broadcast", "allgather", "reduce_scatter"} <= set(transport.native_collectives())
    assert transport.device == 0


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int16", "float16", "complex64"])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_allreduce_world_of_one(world1, dtype, op):
    import cupy

    _, comm = world1
    if np.dtype(dtype).kind == "c" and op in ("max", "min", "prod"):
        pytest.skip("complex min/max/prod go to core's algorithm; covered by the core tests")
    host = (np.arange(12).reshape(3, 4) - 5).astype(dtype)
    x = cupy.asarray(host)
    result = comm.allreduce(x, op=op)
    assert type(result).__module__.startswith("cupy")
    expected = host.astype(np.float64) if (op == "mean" and host.dtype.kind in "iub") else host
    np.testing.assert_array_equal(result.get(), expected)
    out = cupy.empty_like(x) if not (op == "mean" and host.dtype.kind in "iub") else cupy.empty(x.shape, np.float64)
    assert comm.allreduce(x, op=op, out=out) is out
    np.testing.assert_array_equal(out.get(), expected)


@needs_gpu
def test_allreduce_numpy_input_comes_back_numpy(world1):
    _, comm = world1
    result = comm.allreduce(np.ones(5, np.float32))
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, np.ones(5, np.float32))


@needs_gpu
def test_broadcast_allgather_reduce_scatter_world_of_one(world1):
    import cupy

    _, comm = world1
    host = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    x = cupy.asarray(host)
    np.testing.assert_array_equal(comm.broadcast(x, root=0).get(), host)
    gathered = comm.allgather(x)
    assert gathered.shape == (1, 4, 3)
    np.testing.assert_array_equal(gathered.get(), host[None])
    np.testing.assert_array_equal(comm.reduce_scatter(x).get(), host.reshape(-1))
    np.testing.assert_array_equal(comm.reduce_scatter(cupy.arange(7, dtype=cupy.int64), op="max").get(),
                                  np.arange(7))
    comm.barrier()


@needs_gpu
def test_point_to_point_keeps_cupy_buffers_on_the_device(world1):
    import cupy

    transport, _ = world1
    me = TaskId("worker", 0)
    transport.send(me, "t", Message({"k": 1}, [cupy.arange(4), np.arange(3)]))
    msg = transport.recv(me, "t", timeout=30)
    assert msg.meta == {"k": 1}
    assert type(msg.buffers[0]).__module__.startswith("cupy")
    assert isinstance(msg.buffers[1], np.ndarray)
    np.testing.assert_array_equal(msg.buffers[0].get(), np.arange(4))


if REASON is None:
    TestContract_nccl = run_contract("nccl")
else:
    @pytest.mark.skip(reason=f"nccl transport unusable here: {REASON}")
    def test_contract_suite_over_nccl():
        """Placeholder: the contract suite runs over nccl where cupy and a GPU are present."""
