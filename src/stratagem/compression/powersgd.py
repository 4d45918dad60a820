"""The ``powersgd`` compressor: low-rank gradients (Vogels et al., "PowerSGD", NeurIPS 2019).

A gradient of shape ``(n, ...)`` is seen as a matrix ``M`` of ``n`` rows and ``m`` columns (the other
axes flattened) and sent as two thin factors, ``P`` (``n x r``) and ``Q`` (``m x r``), with
``M ~ P Q^T``: ``(n + m) r`` numbers instead of ``n m``. One step of power iteration finds them:
``P = M Q`` (``Q`` warm-started from the previous step's, kept in the variable's state),
orthogonalised (Gram-Schmidt), then ``Q = M^T P``. Vectors and scalars, and matrices too small for the
factors to save bytes (``(n + m) r >= n m``), are sent as they are. What the approximation misses stays
in the residual (``error_feedback``, on by default) and is added to the next gradient.

Under ``mirrored`` the factors are reduced in two phases (``reduction = "custom"``): every replica
computes ``P_i = M_i Q`` with the same ``Q``, the ``P_i`` are summed by one all-reduce (with the
uncompressed arrays), ``P`` is orthogonalised, every replica computes ``Q_i = M_i^T P``, and the ``Q_i``
are summed by a second all-reduce; the sum of the gradients is ``P Q^T``, the same on every replica,
and ``Q`` is the next step's start. Each replica keeps its own residual ``M_i - P Q_i^T``.

    >>> import numpy as np
    >>> powersgd = PowerSGDCompressor(rank=1)
    >>> g = np.outer([1.0, 2.0, 3.0], [1.0, -1.0, 0.5, 2.0]).astype(np.float32)   # rank 1
    >>> state = powersgd.init_state(g.shape, g.dtype)
    >>> packed = powersgd.compress(g, state)
    >>> [a.shape for a in packed.payload], packed.nbytes, g.nbytes
    ([(3, 1), (4, 1)], 28, 48)
    >>> bool(np.allclose(powersgd.decompress(packed), g, atol=1e-5))   # a rank-1 matrix is exact
    True
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from stratagem.compression.base import Compressed, Compressor, _Fused, check_number


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` factors of each matrix-shaped gradient, warm-started (see the module doc).

    Options: ``rank`` (default 1), ``error_feedback`` (default True), ``seed`` (default 0: the
    initial ``Q``, the same on every replica).
    """

    name = "powersgd"
    options = {"rank": 1, "error_feedback": True, "seed": 0}
    reduction = "custom"

    def check_config(self) -> None:
        owner = f"compressor {self.name!r}"
        check_number(owner, "rank", self.config["rank"], low=1, integer=True)
        check_number(owner, "seed", self.config["seed"], low=0, integer=True)

    def plan(self, shape) -> tuple[int, int, int] | None:
        """``(n, m, r)`` for a gradient of ``shape`` sent as factors, ``None`` if it is sent as it is."""
        shape = tuple(shape)
        if len(shape) < 2:
            return None
        n, m = shape[0], math.prod(shape[1:])
        r = min(int(self.config["rank"]), n, m)
        if r < 1 or (n + m) * r >= n * m:
            return None
        return n, m, r

    def init_state(self, shape, dtype) -> dict:
        state = super().init_state(shape, dtype)
        plan = self.plan(shape)
        if plan is not None:
            state["q"] = self._initial_q(plan[1], plan[2], np.dtype(dtype))
        return state

    def _initial_q(self, m: int, r: int, dtype: np.dtype):
        return np.random.default_rng(int(self.config["seed"])).standard_normal((m, r)).astype(dtype)

    def _q(self, state: dict, m: int, r: int, dtype: np.dtype):
        q = state.get("q")
        if q is None or q.shape != (m, r) or q.dtype != dtype:
            q = state["q"] = self._initial_q(m, r, dtype)
        return q

    # -- one array ---------------------------------------------------------------------------------
    def encode(self, array, state: dict) -> Compressed:
        plan = self.plan(array.shape)
        if plan is None:
            return Compressed((array.copy(),), tuple(array.shape), array.dtype, {"rank": 0})
        n, m, r = plan
        matrix = array.reshape(n, m)
        p = matrix @ self._q(state, m, r, array.dtype)
        orthogonalize(p, int(self.config["seed"]))
        q = matrix.T @ p
        state["q"][...] = q
        return Compressed((p, q), tuple(array.shape), array.dtype, {"rank": r})

    def layout(self, shape, dtype, meta) -> list:
        rank = meta["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"rank must be an integer, got {rank!r}")
        if rank == 0:
            return [(shape, dtype)]
        if len(shape) < 2 or not 1 <= rank <= min(shape[0], math.prod(shape[1:])):
            raise ValueError(f"rank {rank} does not fit shape {shape}")
        return [((shape[0], rank), dtype), ((math.prod(shape[1:]), rank), dtype)]

    def expand(self, compressed: Compressed):
        if compressed.meta["rank"] == 0:
            return compressed.payload[0].astype(compressed.dtype, copy=True)
        p, q = compressed.payload
        return (p @ q.T).reshape(compressed.shape)

    def error_bound(self, array):
        array = np.asarray(array)
        if self.plan(array.shape) is None:
            return 0.0
        # P P^T M is an orthogonal projection of M: its error is at most M's Frobenius norm
        return float(np.linalg.norm(array.astype(np.float64))) * (1 + 1e-3) + 1e-30

    # -- over the replicas -----------------------------------------------------------------------------
    def allreduce(self, comm, arrays: Sequence, states: Sequence[dict]) -> list:
        """The two-phase all-reduce of the module doc: the ``P_i`` (with the arrays sent as they are),
        then the ``Q_i``; every replica gets ``P Q^T``, the same bits."""
        arrays = [self.check_array(a) for a in arrays]
        plans = [self.plan(a.shape) for a in arrays]
        results: list = [None] * len(arrays)
        raw = [i for i, plan in enumerate(plans) if plan is None]
        factored = [i for i, plan in enumerate(plans) if plan is not None]
        matrices, ps = {}, {}
        for i in factored:
            n, m, r = plans[i]
            residual = states[i].get("residual") if self.error_feedback else None
            matrix = (arrays[i] + residual) if residual is not None else arrays[i]
            matrices[i] = matrix.reshape(n, m)
            ps[i] = matrices[i] @ self._q(states[i], m, r, arrays[i].dtype)
        summed = _sum(comm, [arrays[i] for i in raw] + [ps[i] for i in factored])
        for i, total in zip(raw, summed[:len(raw)]):
            results[i] = total.copy()
        qs = {}
        for i, p in zip(factored, summed[len(raw):]):
            orthogonalize(p, int(self.config["seed"]))
            ps[i] = p
            qs[i] = matrices[i].T @ p
            residual = states[i].get("residual") if self.error_feedback else None
            if residual is not None:   # this replica's share that P Q_i^T misses
                np.subtract(matrices[i], p @ qs[i].T, out=residual.reshape(matrices[i].shape))
        for i, q in zip(factored, _sum(comm, [qs[i] for i in factored])):
            states[i]["q"][...] = q
            results[i] = (ps[i] @ q.T).reshape(arrays[i].shape)
        return results


def _sum(comm, arrays: list) -> list:
    """Each of ``arrays`` summed over the replicas: one all-reduce per dtype (views of fused buffers)."""
    if not arrays:
        return []
    fused = _Fused([list(arrays)])
    for flat in fused.flats.values():
        if flat.size:
            comm.allreduce(flat, op="sum", out=flat)
    return fused.split()[0]


def orthogonalize(p, seed: int = 0) -> None:
    """Make the columns of ``p`` orthonormal, in place (modified Gram-Schmidt, in order). A column that
    is (numerically) in the span of the ones before it, a zero gradient's, is replaced by a fixed
    pseudo-random one first, so that the next step's ``Q`` does not collapse to zero.

    >>> p = np.array([[3.0, 1.0], [4.0, 0.0]])
    >>> orthogonalize(p); np.round(p @ p.T, 12).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    n, r = p.shape
    tiny = np.finfo(p.dtype).eps * 16
    for i in range(r):
        column = p[:, i]
        for attempt in range(2):
            before = float(np.sqrt(column @ column))
            for j in range(i):
                column -= (p[:, j] @ column) * p[:, j]
            norm = float(np.sqrt(column @ column))
            if norm > tiny * before or attempt:
                break
            column[...] = np.random.default_rng([seed, i]).standard_normal(n).astype(p.dtype)
        if norm > 0:
            column /= p.dtype.type(norm)
