"""Compressors: the contract suite over every registered compressor, the registry, and what the suite
and the built-ins must catch (a compressor that drops its residual, hostile payloads, bad options)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import stratagem
from stratagem.compression.base import Compressed
from stratagem.compression.casts import from_bfloat16_bits, from_float16, to_bfloat16_bits, to_float16
from stratagem.compression.powersgd import PowerSGDCompressor, orthogonalize
from stratagem.compression.topk import TopKCompressor
from stratagem.core.errors import ConfigurationError, PluginError, ProtocolError
from stratagem.plugins.manager import PluginManager
from stratagem.testing.compressor_contract import CompressorContract, run_compressor_contract

BUILTIN = ["bf16", "fp16", "powersgd", "topk"]
#: Options the contract runs each built-in with (the quadratic has 48 entries: topk keeps 5).
CONTRACT_OPTIONS = {"topk": {"ratio": 0.1}, "powersgd": {"rank": 1}}

for _name in PluginManager(autoload=False).names("compressor"):
    globals()[f"TestCompressorContract_{_name}"] = run_compressor_contract(
        _name, options=CONTRACT_OPTIONS.get(_name, {}))


# -- the suite fails a compressor that breaks the contract --------------------------------------------

class ForgetfulTopK(TopKCompressor):
    """Top-k that says it has error feedback but drops what it does not send."""

    def compress(self, array, state):
        return self.encode(self.check_array(array), state)


class TestTheSuiteCatchesADroppedResidual(CompressorContract):
    options = {"ratio": 0.1}

    def make(self, **extra):
        return ForgetfulTopK(**{**self.options, **extra})

    def test_error_feedback_loses_nothing(self):
        with pytest.raises(AssertionError):
            super().test_error_feedback_loses_nothing(np.float32)

    def test_error_feedback_sgd_reaches_the_optimum(self):
        with pytest.raises(AssertionError, match="'topk' with error feedback ended .* from the optimum"):
            super().test_error_feedback_sgd_reaches_the_optimum()

    def test_allreduce_error_feedback_sgd_reaches_the_optimum(self):
        with pytest.raises(AssertionError, match="from the optimum"):
            super().test_allreduce_error_feedback_sgd_reaches_the_optimum()


def test_without_error_feedback_topk_and_powersgd_miss_the_optimum():
    # what error feedback is for, on the contract's quadratic: the iterates settle far from the optimum
    for name, options in (("topk", {"ratio": 0.1}), ("powersgd", {"rank": 1})):
        suite = run_compressor_contract(name, options={**options, "error_feedback": False})()
        suite.make = lambda suite=suite, **extra: stratagem.compressor(suite.compressor, **suite.options)
        with pytest.raises(AssertionError, match="from the optimum"):
            suite.test_error_feedback_sgd_reaches_the_optimum()


# -- the registry ----------------------------------------------------------------------------------------

def test_builtins_are_registered_through_the_hook_and_listed():
    manager = PluginManager(autoload=False)
    assert manager.names("compressor") == BUILTIN
    assert all(manager.source("compressor", name) == "builtin" for name in BUILTIN)
    rows = {(r.kind, r.name): r for r in manager.describe()}
    assert rows[("compressor", "topk")].usable and "error feedback" in rows[("compressor", "topk")].description
    assert manager.compressor_class("powersgd") is PowerSGDCompressor


def test_unknown_compressor_lists_the_known_ones():
    with pytest.raises(PluginError, match=r"unknown compressor 'powersdg'; known: bf16, fp16, powersgd, topk "
                                          r"\(did you mean 'powersgd'\?\)"):
        stratagem.compressor("powersdg")
    with pytest.raises(PluginError, match=r"'zmq' is a transport, not a compressor"):
        stratagem.compressor("zmq")


@pytest.mark.parametrize("name, options, message", [
    ("topk", {"ratio": 0}, r"ratio must be a number in \(0, 1\], got 0"),
    ("topk", {"ratio": 1.5}, r"ratio must be a number in \(0, 1\], got 1.5"),
    ("powersgd", {"rank": 0}, r"rank must be an integer >= 1, got 0"),
    ("powersgd", {"rank": 2.5}, r"rank must be an integer >= 1, got 2.5"),
    ("fp16", {"scale": -1.0}, r"scale must be a number > 0, got -1.0"),
    ("bf16", {"error_feedback": "yes"}, r"error_feedback must be True or False"),
    ("topk", {"rank": 4}, r"does not accept option\(s\) 'rank'; it accepts: error_feedback, ratio"),
])
def test_bad_options_are_refused_by_name(name, options, message):
    with pytest.raises(ConfigurationError, match=message):
        stratagem.compressor(name, **options)


def test_a_registered_third_party_compressor_is_created_and_checked():
    from stratagem.plugins import PluginSpec, hookimpl

    class Extra:
        @hookimpl
        def stratagem_add_compressors(self):
            return [PluginSpec("forgetful", ForgetfulTopK, "compressor", description="test"),
                    PluginSpec("needs-lib", "no_such_pkg.mod:C", "compressor", install_hint="pip install no-such")]

    manager = PluginManager(autoload=False)
    manager.register(Extra(), "extra", source="tests")
    assert isinstance(manager.create_compressor("forgetful", ratio=0.5), ForgetfulTopK)
    assert manager.source("compressor", "forgetful") == "tests"
    row = next(r for r in manager.describe() if r.name == "needs-lib")
    assert row.kind == "compressor" and not row.usable and row.install_hint == "pip install no-such"
    with pytest.raises(PluginError, match="not usable here: No module named 'no_such_pkg'. Install it with: "
                                          "pip install no-such"):
        manager.create_compressor("needs-lib")


# -- the built-ins ---------------------------------------------------------------------------------------

def test_bf16_rounds_to_nearest_even_like_ml_dtypes():
    bits = np.random.default_rng(0).integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x7F800000, 0x80000000],
                     np.uint32)   # ties (to even both ways), the largest finite values, a subnormal, inf, -0
    x = np.concatenate([bits, edges]).view(np.float32)
    with np.errstate(invalid="ignore"):
        reference = x.astype(ml_dtypes.bfloat16)
    mine = to_bfloat16_bits(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(mine[finite], reference.view(np.uint16)[finite])
    assert np.isnan(from_bfloat16_bits(mine[~finite])).all()          # NaN stays NaN, never inf
    np.testing.assert_array_equal(from_bfloat16_bits(mine[finite]), reference[finite].astype(np.float32))


@pytest.mark.parametrize("scale", [1e-9, 1e-7, 1e-5, 1.0, 7e4])     # all, some, few or no small values
def test_fp16_conversion_is_numpys_bit_for_bit(scale):
    rng = np.random.default_rng(5)
    random_bits = rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, 65504, 65519.99, 65520, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, np.inf, -np.inf],
                     np.float32)
    x = np.concatenate([(rng.normal(size=200_000) * scale).astype(np.float32), random_bits[:1000 if scale < 1 else None], edges])
    with np.errstate(all="ignore"):
        reference = x.astype(np.float16)
    mine = to_float16(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(mine.view(np.uint16)[finite], reference.view(np.uint16)[finite])
    assert np.isnan(mine[~finite]).all()
    assert to_float16(np.float32(3e-6)).shape == () and to_float16(np.float32(3e-6)) == np.float16(3e-6)


def test_fp16_widening_is_numpys_bit_for_bit_and_casts_write_into_out():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)   # every bit pattern
    for dtype in (np.float32, np.float16):     # every bit, NaN payloads too
        np.testing.assert_array_equal(from_float16(every, dtype).view(f"u{np.dtype(dtype).itemsize}"),
                                      every.astype(dtype).view(f"u{np.dtype(dtype).itemsize}"))
    wide, number = from_float16(every, np.float64), ~np.isnan(every)    # (NaNs stay NaN, maybe quieted)
    np.testing.assert_array_equal(wide[number].view(np.uint64), every[number].astype(np.float64).view(np.uint64))
    assert np.isnan(wide[~number]).all()
    x = (np.random.default_rng(6).normal(size=(40, 25)) * 1e-5).astype(np.float32)
    buffer = np.zeros(1100, np.float16)
    to_float16(x, out=buffer[50:1050])
    np.testing.assert_array_equal(buffer[50:1050].view(np.uint16), x.astype(np.float16).reshape(-1).view(np.uint16))
    assert not buffer[:50].any() and not buffer[1050:].any()
    wide = np.zeros(1000, np.float32)
    from_float16(buffer[50:1050], out=wide)
    np.testing.assert_array_equal(wide, x.astype(np.float16).astype(np.float32).reshape(-1))


def test_bf16_payload_is_half_the_bytes_and_summed_as_bfloat16():
    bf16 = stratagem.compressor("bf16")
    x = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    packed = bf16.compress(x, {})
    assert packed.payload[0].dtype == np.uint16 and packed.nbytes == x.nbytes // 2
    assert bf16.reduction == "sum" and np.dtype(bf16.sum_dtype) == np.dtype(ml_dtypes.bfloat16)


def test_fp16_overflows_to_inf_and_scale_brings_small_values_back():
    fp16 = stratagem.compressor("fp16")
    out = fp16.decompress(fp16.compress(np.array([1e5, 1e-9], np.float32), {}))
    assert np.isinf(out[0]) and out[1] == 0.0
    scaled = stratagem.compressor("fp16", scale=1e6)
    assert abs(scaled.decompress(scaled.compress(np.array([1e-9], np.float32), {}))[0] - 1e-9) < 1e-12


def test_topk_sends_k_sorted_int32_indices_and_refuses_bad_ones():
    topk = stratagem.compressor("topk", ratio=0.01)
    x = np.random.default_rng(2).normal(size=(100, 50)).astype(np.float32)
    packed = topk.compress(x, topk.init_state(x.shape, x.dtype))
    indices, values = packed.payload
    assert packed.meta == {"k": 50} and indices.dtype == np.int32 and values.dtype == np.float32
    assert np.all(np.diff(indices) > 0)
    assert np.abs(values).min() >= np.sort(np.abs(x).ravel())[-50]
    for bad in (indices[::-1].copy(), np.where(indices == indices[-1], 5000, indices).astype(np.int32),
                np.concatenate([indices[:-1], indices[-2:-1]])):
        with pytest.raises(ProtocolError, match="indices must be increasing"):
            topk.decompress(Compressed((bad, values), x.shape, x.dtype, packed.meta))
    with pytest.raises(ProtocolError, match="bad meta"):      # a peer claiming more entries than exist
        topk.decompress(Compressed((indices, values), x.shape, x.dtype, {"k": 10 ** 9}))


def test_powersgd_sends_factors_of_matrices_and_vectors_as_they_are():
    powersgd = stratagem.compressor("powersgd", rank=4)
    assert powersgd.plan((256, 3, 3)) == (256, 9, 4)
    assert powersgd.plan((10,)) is None and powersgd.plan(()) is None
    assert powersgd.plan((3, 4)) is None          # (3 + 4) * 3 >= 12: the factors would not save bytes
    g = np.random.default_rng(3).normal(size=(256, 3, 3)).astype(np.float32)
    packed = powersgd.compress(g, powersgd.init_state(g.shape, g.dtype))
    assert [a.shape for a in packed.payload] == [(256, 4), (9, 4)] and packed.meta == {"rank": 4}
    bias = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(powersgd.decompress(powersgd.compress(bias, powersgd.init_state((5,), np.float32))), bias)


def test_powersgd_warm_start_converges_to_the_best_low_rank_approximation():
    rng = np.random.default_rng(4)
    u, _ = np.linalg.qr(rng.normal(size=(60, 60)))
    v, _ = np.linalg.qr(rng.normal(size=(40, 40)))
    s = np.zeros(40)
    s[:6] = [10, 8, 6, 0.5, 0.4, 0.3]
    m = (u[:, :40] * s) @ v.T                                  # singular values known
    powersgd = PowerSGDCompressor(rank=3, error_feedback=False)
    state = powersgd.init_state(m.shape, m.dtype)
    for _ in range(30):                                        # the same gradient: power iteration
        approx = powersgd.decompress(powersgd.compress(m, state))
    best = (u[:, :3] * s[:3]) @ v[:, :3].T
    assert np.abs(approx - best).max() < 1e-6


def test_orthogonalize_replaces_a_zero_column_so_q_never_collapses():
    p = np.zeros((5, 2))
    orthogonalize(p, seed=0)
    np.testing.assert_allclose(p.T @ p, np.eye(2), atol=1e-12)


def test_state_is_per_variable_and_the_compressor_holds_none():
    topk = stratagem.compressor("topk", ratio=0.5)
    a, b = topk.init_state((4,), np.float32), topk.init_state((4,), np.float32)
    topk.compress(np.array([1.0, 2.0, 3.0, 4.0], np.float32), a)
    assert np.any(a["residual"]) and not np.any(b["residual"])
    with pytest.raises(ConfigurationError, match=r"state was made for shape \(4,\), the array has shape \(5,\)"):
        topk.compress(np.ones(5, np.float32), a)


def test_cupy_arrays_are_refused_by_host_only_compressors(fake_cupy):
    x = fake_cupy.ones(4, dtype=np.float32)
    with pytest.raises(ConfigurationError, match="compresses numpy \\(host\\) arrays, not cupy arrays"):
        stratagem.compressor("topk").compress(x, {})


def test_a_compressor_that_cannot_use_the_transport_is_one_clear_error():
    from stratagem.core.cluster import ClusterSpec
    from stratagem.core.errors import IncompatibleError
    from stratagem.transports.local import LocalFabric

    class NeedsNativeAllreduce(TopKCompressor):
        @classmethod
        def supports(cls, transport_class):
            return "it needs a transport with a native all-reduce (mpi, nccl)" if transport_class.in_process else None

    fabric = LocalFabric()
    with pytest.raises(IncompatibleError, match=r"strategy 'mirrored' cannot use compression 'topk' over transport "
                                                r"'local': it needs a transport with a native all-reduce"):
        stratagem.strategy("mirrored", transport="local", cluster=ClusterSpec({"worker": ["local:0"]}),
                           task="worker:0", transport_options={"fabric": fabric}, compression=NeedsNativeAllreduce())
    from stratagem.core.cluster import TaskId
    assert fabric.gone(TaskId("worker", 0)) is not None        # the transport it had started was closed
