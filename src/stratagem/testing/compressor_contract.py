"""The compressor contract suite: every compressor plugin passes these tests (the contract is stated in
:mod:`stratagem.compression.base`).

Third-party packages reuse it by subclassing::

    from stratagem.testing.compressor_contract import CompressorContract

    class TestMyCompressor(CompressorContract):
        compressor = "mycompressor"        # the registered name
        options = {"bits": 4}              # options the tests use (default: the compressor's defaults)

or, for every registered compressor, ``run_compressor_contract(name)`` (what this repository's tests do).

What it checks:

- a round trip stays within the compressor's stated tolerance (``error_bound``), and keeps the shape
  and dtype: float32 and float64; scalars, empty, 1-D, 2-D and 3-D arrays;
- a payload that does not match what ``layout`` says (an array missing, cut short, of another dtype)
  is refused with ``ProtocolError``, as a ps task must refuse a faulty or hostile push;
- with ``error_feedback=True`` nothing is lost: what is sent plus the new residual equals the gradient
  plus the old residual, step after step;
- with error feedback, SGD on a quadratic split over two workers whose gradients differ (large and
  opposite at the optimum) reaches the optimum of the uncompressed problem, both through
  ``compress``/``decompress`` (a worker's pushes) and through ``allreduce`` over two replicas (mirrored).
  The iterates are averaged over the second half of the run: error feedback delays what compression
  drops, so the iterates circle the optimum; without it they settle away from it (a compressor that
  drops the residual ends tens of percent off, where the suite allows ``quadratic_tolerance``);
- ``allreduce`` gives every replica the same bits, within the tolerance of the sum;
- the state is plain arrays: saved with :mod:`stratagem.training.checkpoint` and loaded into a new
  compressor, it compresses the next step exactly as the original;
- unknown options are refused naming the accepted ones; integer arrays are refused.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from stratagem.compression.base import Compressed
from stratagem.core.errors import ConfigurationError, ProtocolError
from stratagem.testing.world import local_world

#: Shapes every test of the round trip covers (scalars and empty arrays included).
SHAPES = [(), (0,), (1,), (7,), (1000,), (33, 17), (0, 5), (4, 3, 5)]
DTYPES = [np.float32, np.float64]
#: Seconds a replica's collectives may wait in the two-replica tests.
CALL_TIMEOUT = 30.0


def quadratic(seed: int = 1):
    """Two workers' quadratics ``0.5 a (x - c_i)^2`` on an 8 x 6 matrix: ``(a, optimum, centers)``.

    The centers differ by large opposite offsets on five entries, so at the optimum of the sum each
    worker's gradient there is large (8 to 16 times the curvature) and the two cancel exactly: what a
    compressor drops from one is not dropped from the other, and only error feedback brings it back.
    """
    rng = np.random.default_rng(seed)
    shape = (8, 6)
    a = rng.uniform(0.5, 1.5, shape)
    optimum = rng.normal(size=shape)
    offset = np.zeros(shape)
    where = rng.choice(offset.size, 5, replace=False)
    offset.flat[where] = rng.uniform(8, 16, where.size) * rng.choice([-1, 1], where.size)
    return a, optimum, [optimum + offset, optimum - offset]


class CompressorContract:
    """Subclass and set ``compressor`` to the registered name of the compressor under test."""

    compressor: str = ""
    #: Options for the compressor under test (merged over its defaults).
    options: dict = {}
    #: SGD steps of the quadratic tests, their learning rate, and how far from the optimum (in units of
    #: the largest entry of the optimum) the averaged iterate may end.
    quadratic_steps: int = 1000
    learning_rate: float = 0.3
    quadratic_tolerance: float = 0.1

    # -- helpers -----------------------------------------------------------------------------------
    def make(self, **extra):
        from stratagem.plugins.manager import plugin_manager

        return plugin_manager().create_compressor(self.compressor, **{**self.options, **extra})

    @staticmethod
    def data(shape, dtype, seed: int = 0):
        return np.random.default_rng(seed).normal(size=shape).astype(dtype)

    def allreduce_in_threads(self, compressor, per_rank, steps: int = 1):
        """Run ``per_rank(rank, comm, compressor)`` on both ranks of a two-replica local world; results."""
        comms = local_world(2, timeout=CALL_TIMEOUT)
        out, errors = [None, None], [None, None]

        def body(rank):
            try:
                out[rank] = per_rank(rank, comms[rank], compressor)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors[rank] = exc

        threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(2)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        finally:
            for comm in comms:
                comm.close()
        for error in errors:
            if error is not None:
                raise error
        assert not any(thread.is_alive() for thread in threads), "a replica did not finish"
        return out

    # -- one array ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_round_trip_within_the_stated_tolerance(self, shape, dtype):
        compressor = self.make()
        x = self.data(shape, dtype)
        packed = compressor.compress(x.copy(), compressor.init_state(shape, dtype))
        assert isinstance(packed, Compressed)
        y = compressor.decompress(packed)
        assert y.shape == x.shape and y.dtype == x.dtype
        bound = np.asarray(compressor.error_bound(x), np.float64)
        error = np.abs(y.astype(np.float64) - x.astype(np.float64))
        assert np.all(error <= bound * (1 + 1e-6) + 1e-300), (float(error.max(initial=0)), bound)

    def test_compress_leaves_its_input_alone(self):
        compressor = self.make(error_feedback=True)
        x = self.data((33, 17), np.float32)
        kept = x.copy()
        compressor.compress(x, compressor.init_state(x.shape, x.dtype))
        np.testing.assert_array_equal(x, kept)

    def test_a_payload_that_does_not_fit_is_refused(self):
        compressor = self.make()
        x = self.data((33, 17), np.float32)
        packed = compressor.compress(x, compressor.init_state(x.shape, x.dtype))
        payload = list(packed.payload)
        broken = [payload[:-1]]                                      # an array missing
        for i, array in enumerate(payload):
            other = np.float64 if array.dtype != np.float64 else np.float32
            broken.append(payload[:i] + [array.astype(other)] + payload[i + 1:])     # another dtype
            if array.size:
                broken.append(payload[:i] + [array.reshape(-1)[:-1]] + payload[i + 1:])  # cut short
        for arrays in broken:
            with pytest.raises(ProtocolError):
                compressor.decompress(Compressed(tuple(arrays), packed.shape, packed.dtype, dict(packed.meta)))

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_error_feedback_loses_nothing(self, dtype):
        compressor = self.make(error_feedback=True)
        shape = (33, 17)
        state = compressor.init_state(shape, dtype)
        carried = np.zeros(shape, np.float64)
        for step in range(4):
            x = self.data(shape, dtype, seed=step)
            sent = compressor.decompress(compressor.compress(x, state)).astype(np.float64)
            residual = state["residual"].astype(np.float64)
            expected = x.astype(np.float64) + carried
            # what was sent plus what waits is what was given: exactly, up to the rounding of one addition
            tolerance = 8 * np.finfo(dtype).eps * (np.abs(expected) + np.abs(sent) + np.abs(residual))
            assert np.all(np.abs(sent + residual - expected) <= tolerance + 1e-300), f"step {step}"
            carried = residual

    def test_error_feedback_sgd_reaches_the_optimum(self):
        compressor = self.make(error_feedback=True)
        a, optimum, centers = quadratic()
        states = [compressor.init_state(a.shape, np.float64) for _ in centers]
        x = np.zeros(a.shape)
        total = np.zeros(a.shape)
        steps = self.quadratic_steps
        for step in range(steps):
            grads = [compressor.decompress(compressor.compress(a * (x - c), s)) for c, s in zip(centers, states)]
            x = x - self.learning_rate * sum(grads) / len(grads)
            if step >= steps // 2:
                total += x
        self._assert_at(total / (steps - steps // 2), optimum, compressor)

    def _assert_at(self, x, optimum, compressor):
        off = float(np.abs(x - optimum).max()) / float(np.abs(optimum).max())
        assert off <= self.quadratic_tolerance, (
            f"compressor {compressor.name!r} with error feedback ended {off:.3g} (relative) from the optimum; "
            f"allowed: {self.quadratic_tolerance}")

    # -- over the replicas -----------------------------------------------------------------------------
    def test_allreduce_gives_every_replica_the_same_sum(self):
        shapes = [(33, 17), (7,), (), (0,), (4, 3, 5)]
        arrays = {rank: [self.data(s, np.float32, seed=10 * rank + i) for i, s in enumerate(shapes)]
                  for rank in range(2)}

        def per_rank(rank, comm, compressor):
            states = [compressor.init_state(s, np.float32) for s in shapes]
            return compressor.allreduce(comm, [x.copy() for x in arrays[rank]], states)

        compressor = self.make()
        first, second = self.allreduce_in_threads(compressor, per_rank)
        for i, shape in enumerate(shapes):
            assert first[i].shape == shape and first[i].dtype == np.float32
            np.testing.assert_array_equal(first[i], second[i])    # the same bits on every replica
            x0, x1 = arrays[0][i], arrays[1][i]
            exact = x0.astype(np.float64) + x1
            bound = (np.asarray(compressor.error_bound(x0), np.float64) + compressor.error_bound(x1)
                     + compressor.error_bound((x0 + x1).astype(np.float32)))
            error = np.abs(first[i] - exact)
            assert np.all(error <= bound * (1 + 1e-5) + 1e-6), (shape, float(error.max(initial=0)))

    def test_allreduce_error_feedback_sgd_reaches_the_optimum(self):
        a, optimum, centers = quadratic()
        steps, rate = self.quadratic_steps, self.learning_rate

        def per_rank(rank, comm, compressor):
            state = compressor.init_state(a.shape, np.float64)
            x, total = np.zeros(a.shape), np.zeros(a.shape)
            for step in range(steps):
                x = x - rate * compressor.allreduce(comm, [a * (x - centers[rank])], [state])[0] / 2
                if step >= steps // 2:
                    total += x
            return total / (steps - steps // 2)

        compressor = self.make(error_feedback=True)
        first, second = self.allreduce_in_threads(compressor, per_rank)
        np.testing.assert_array_equal(first, second)
        self._assert_at(first, optimum, compressor)

    # -- state -------------------------------------------------------------------------------------------
    def test_state_survives_a_checkpoint(self, tmp_path):
        from stratagem.training import checkpoint

        compressor = self.make(error_feedback=True)
        shape = (33, 17)
        state = compressor.init_state(shape, np.float32)
        for step in range(3):
            compressor.compress(self.data(shape, np.float32, seed=step), state)
        assert all(isinstance(v, np.ndarray) for v in state.values()), "the state must be plain arrays"
        checkpoint.save(tmp_path, {f"state/{k}": v for k, v in state.items()}, None, step=3)
        restored_compressor = self.make(error_feedback=True)
        restored = restored_compressor.init_state(shape, np.float32)
        for key, value in checkpoint.load(tmp_path).variables.items():
            restored[key.split("/", 1)[1]] = value
        x = self.data(shape, np.float32, seed=99)
        a, b = compressor.compress(x, state), restored_compressor.compress(x, restored)
        assert a.meta == b.meta and len(a.payload) == len(b.payload)
        for left, right in zip(a.payload, b.payload):
            np.testing.assert_array_equal(left, right)
        for key in state:
            np.testing.assert_array_equal(state[key], restored[key])

    # -- bad input ----------------------------------------------------------------------------------------
    def test_unknown_option_is_refused_with_the_accepted_ones(self):
        with pytest.raises(ConfigurationError, match=r"does not accept option\(s\) 'bogus_option'.*error_feedback"):
            self.make(bogus_option=1)

    def test_integer_arrays_are_refused(self):
        compressor = self.make()
        with pytest.raises(ConfigurationError, match="float16, float32 and float64"):
            compressor.compress(np.arange(6), compressor.init_state((6,), np.int64))


def run_compressor_contract(compressor: str, **attributes) -> type:
    """A ``CompressorContract`` test class for the registered compressor ``compressor`` (class
    attributes such as ``options`` may be given)."""
    return type(f"TestCompressorContract_{compressor}", (CompressorContract,),
                {"compressor": compressor, **attributes})
