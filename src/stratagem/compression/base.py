"""The compressor contract: what a gradient compressor plugin implements (README: "Gradient compression").

A :class:`Compressor` turns one gradient array into a smaller :class:`Compressed` *payload* (a few
arrays plus a dict of plain values) and back. Strategies use it in two places:

- ``mirrored`` all-reduces compressed gradients with :meth:`Compressor.allreduce`, which every
  replica calls with its gradients (one bucket at a time) and which returns their sum over the
  replicas, the same bits on every replica;
- the parameter-server strategies compress each gradient a worker pushes (:meth:`Compressor.compress`),
  and the ps task decompresses it before applying (:meth:`Compressor.decompress`).

How the payloads of several replicas are combined is the class's ``reduction``:

- ``"sum"``: payloads add up element-wise, so they ride a plain sum all-reduce (in ``sum_dtype`` when
  set: ``bf16`` sums its uint16 bit patterns as bfloat16) and the sum is decompressed once
  (``fp16``, ``bf16``). Any transport's all-reduce carries them, native ones included.
- ``"gather"``: payloads do not add up (``topk``'s indices differ per replica): every replica's payload
  is all-gathered, decompressed and summed in rank order. The payload's layout must depend on the
  array's shape and dtype and the options only, so that every replica's has the same size.
- ``"custom"``: the class overrides :meth:`Compressor.allreduce` with a scheme of its own
  (``powersgd`` all-reduces its factors P, then Q).

State is per variable and belongs to the caller: :meth:`Compressor.init_state` makes a dict of arrays
(``residual`` for error feedback, ``q`` for PowerSGD's warm start) that the caller keeps and hands back
at every step; the compressor object itself holds only its options, so one instance serves any number
of variables and strategies. With ``error_feedback=True`` what compression drops is kept in the
residual and added to the next gradient, so nothing is lost, only delayed. State is plain arrays: it
round-trips through :mod:`stratagem.training.checkpoint` (a strategy's ``save()`` does not include it;
see the README).

A compressor of your own subclasses :class:`Compressor` and implements :meth:`~Compressor.encode`,
:meth:`~Compressor.layout`, :meth:`~Compressor.expand` and :meth:`~Compressor.error_bound`; see
:mod:`stratagem.compression.casts` for the smallest ones. Register it through the
``stratagem_add_compressors`` hook and check it with :class:`stratagem.testing.compressor_contract.CompressorContract`.

    >>> import numpy as np
    >>> from stratagem.compression.topk import TopKCompressor
    >>> topk = TopKCompressor(ratio=0.5)
    >>> state = topk.init_state((4,), np.float32)
    >>> packed = topk.compress(np.array([0.1, -3.0, 0.2, 2.0], np.float32), state)
    >>> [a.tolist() for a in packed.payload], packed.meta
    ([[1, 3], [-3.0, 2.0]], {'k': 2})
    >>> topk.decompress(packed), state["residual"]          # what was dropped waits in the residual
    (array([ 0., -3.,  0.,  2.], dtype=float32), array([0.1, 0. , 0.2, 0. ], dtype=float32))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from stratagem.core.errors import ConfigurationError, ProtocolError
from stratagem.core.options import declared_options, reject_unknown_options
from stratagem.training.variables import array_module, is_device_array

#: What ``Compressor.reduction`` may be.
REDUCTIONS = ("sum", "gather", "custom")
#: The dtypes compressors take (what they return is the same dtype).
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


@dataclass
class Compressed:
    """One compressed array: the ``payload`` arrays, the original ``shape`` and ``dtype``, and ``meta``
    (plain values: ints, floats, strings, bools, lists, dicts) that :meth:`Compressor.layout` reads.

    Only ``payload`` and ``meta`` travel; the receiver knows the shape and dtype (a ps task holds the
    variable's), so a peer cannot make it allocate more than the variable."""

    payload: tuple
    shape: tuple
    dtype: np.dtype
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The payload's bytes (what goes on the wire, beside ``meta``)."""
        return int(sum(int(a.nbytes) for a in self.payload))


class Compressor:
    """Base class of every compressor plugin (see the module doc).

    Args:
        **options: the compressor's options, the keys of its class attribute ``options`` (merged with
            its bases'; every compressor has ``error_feedback``). Others are refused with the list of
            those it takes. The resolved values are in ``self.config``.

    Class attributes a subclass sets: ``name`` (its registered name), ``options`` (its options and
    defaults), ``reduction`` (``"sum"``, ``"gather"`` or ``"custom"``), ``sum_dtype`` (``"sum"`` only:
    the dtype the payload is summed as, same item size), ``device_arrays`` (True if it compresses cupy
    arrays too; else it takes numpy arrays only).
    """

    name: ClassVar[str] = "base"
    options: ClassVar[Mapping[str, Any]] = {"error_feedback": False}
    reduction: ClassVar[str] = "gather"
    sum_dtype: ClassVar[Any] = None
    device_arrays: ClassVar[bool] = False

    def __init__(self, **options):
        defaults = self.option_defaults()
        reject_unknown_options(f"compressor {self.name!r}", options, defaults)
        #: The compressor's options: defaults updated with what the caller passed.
        self.config: dict[str, Any] = {**defaults, **options}
        if not isinstance(self.config["error_feedback"], bool):
            raise ConfigurationError(f"compressor {self.name!r}: error_feedback must be True or False, "
                                     f"got {self.config['error_feedback']!r}")
        self.check_config()

    # -- class-level declarations ------------------------------------------------------------------
    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The compressor's options and their defaults, from ``options`` of this class and its bases."""
        return declared_options(cls)

    @classmethod
    def check_usable(cls) -> None:
        """Raise ``PluginError`` with the reason and the install hint if it cannot run here."""

    @classmethod
    def supports(cls, transport_class: type) -> str | None:
        """``None`` if gradients compressed by this class can be reduced over ``transport_class``, else
        why not (a strategy raises it as one ``IncompatibleError``). The built-ins reduce through the
        communicator, whose core algorithms every transport carries, so they accept every transport."""
        return None

    def check_config(self) -> None:
        """Validate ``self.config``; raise ``ConfigurationError`` naming the option."""

    @property
    def error_feedback(self) -> bool:
        """True if what compression drops is carried over to the next step (the ``residual`` state)."""
        return bool(self.config["error_feedback"])

    # -- state -------------------------------------------------------------------------------------
    def init_state(self, shape, dtype) -> dict:
        """A fresh state for one variable of ``shape`` and ``dtype``: a dict of arrays (plain data,
        checkpointable). The base gives ``{"residual": zeros}`` with error feedback, else ``{}``."""
        dtype = np.dtype(dtype)
        return {"residual": np.zeros(tuple(shape), dtype)} if self.error_feedback else {}

    # -- one array ---------------------------------------------------------------------------------
    def compress(self, array, state: dict) -> Compressed:
        """``array`` compressed; updates ``state`` (the residual with error feedback, and whatever the
        compressor keeps between steps). ``state`` is this variable's, from :meth:`init_state`."""
        array = self.check_array(array)
        residual = state.get("residual") if self.error_feedback else None
        if residual is not None:
            if residual.shape != array.shape:
                raise ConfigurationError(
                    f"compressor {self.name!r}: the state was made for shape {residual.shape}, the array "
                    f"has shape {array.shape}; keep one state per variable (init_state(shape, dtype))")
            corrected = array + residual
        else:
            corrected = array
        compressed = self.encode(corrected, state)
        if residual is not None:   # what this step did not send waits for the next one
            array_module(residual).subtract(corrected, self.expand(compressed), out=residual)
        return compressed

    def decompress(self, compressed: Compressed):
        """The array ``compressed`` stands for (its shape and dtype). The payload is checked against
        :meth:`layout` first: a payload that does not match (from a faulty or hostile peer) raises
        ``ProtocolError`` before anything is allocated."""
        self.check(compressed)
        return self.expand(compressed)

    def check(self, compressed: Compressed) -> None:
        """Raise ``ProtocolError`` unless the payload has the arrays :meth:`layout` says, of the
        right shapes and dtypes (and whatever :meth:`check_payload` checks besides)."""
        shape, dtype = tuple(compressed.shape), np.dtype(compressed.dtype)
        if not isinstance(compressed.meta, dict):
            raise ProtocolError(f"compressor {self.name!r}: meta must be a dict, got {type(compressed.meta).__name__}")
        try:
            expected = self.layout(shape, dtype, compressed.meta)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"compressor {self.name!r}: bad meta {compressed.meta!r} for shape {shape}, "
                                f"{dtype}: {exc}") from None
        payload = compressed.payload
        if len(payload) != len(expected):
            raise ProtocolError(f"compressor {self.name!r}: expected {len(expected)} payload array(s) for shape "
                                f"{shape}, got {len(payload)}")
        for index, (array, (want_shape, want_dtype)) in enumerate(zip(payload, expected)):
            if tuple(array.shape) != tuple(want_shape) or np.dtype(array.dtype) != np.dtype(want_dtype):
                raise ProtocolError(
                    f"compressor {self.name!r}: payload array {index} is {tuple(array.shape)} {array.dtype}, "
                    f"expected {tuple(want_shape)} {np.dtype(want_dtype)} (for shape {shape}, {dtype})")
        self.check_payload(compressed)

    def check_array(self, array):
        """``array`` as an array this compressor takes (floating point; numpy, or cupy if it takes
        device arrays), else a ``ConfigurationError`` saying what it takes."""
        if is_device_array(array):
            if not self.device_arrays:
                raise ConfigurationError(
                    f"compressor {self.name!r} compresses numpy (host) arrays, not cupy arrays: move the "
                    f"gradients to the host, or use compression='fp16' or 'bf16', which work on the GPU")
        else:
            array = np.asarray(array)
        if np.dtype(array.dtype) not in FLOAT_DTYPES:
            raise ConfigurationError(f"compressor {self.name!r} compresses float16, float32 and float64 "
                                     f"arrays, got {array.dtype}")
        return array

    # -- what a subclass implements ------------------------------------------------------------------
    def encode(self, array, state: dict) -> Compressed:
        """Compress ``array`` (the gradient plus the residual, already added). May read and update
        ``state`` (not the residual: :meth:`compress` keeps that one)."""
        raise NotImplementedError(f"{type(self).__name__}.encode")

    def layout(self, shape: tuple, dtype: np.dtype, meta: dict) -> list:
        """The payload arrays for an array of ``shape`` and ``dtype`` compressed with ``meta``:
        ``[(shape, dtype), ...]``. ``meta`` may come from a peer: raise ``ValueError`` (or
        ``KeyError``/``TypeError``) if it is not one ``encode`` could have made."""
        raise NotImplementedError(f"{type(self).__name__}.layout")

    def check_payload(self, compressed: Compressed) -> None:
        """Checks beyond the layout (values within range...); raise ``ProtocolError``. Default: none."""

    def expand(self, compressed: Compressed):
        """The array of ``compressed.shape`` and ``compressed.dtype`` that a checked payload stands for."""
        raise NotImplementedError(f"{type(self).__name__}.expand")

    def accumulate(self, out, compressed: Compressed) -> None:
        """``out += expand(compressed)``; a sparse compressor overrides it to add only what it kept."""
        out += self.expand(compressed)

    def error_bound(self, array):
        """An upper bound (a number, or one per element) of ``|decompress(compress(array)) - array|``
        with a fresh state: the compressor's stated tolerance, which the contract suite checks."""
        raise NotImplementedError(f"{type(self).__name__}.error_bound")

    # -- over the replicas -----------------------------------------------------------------------------
    def allreduce(self, comm, arrays: Sequence, states: Sequence[dict]) -> list:
        """The sum over the replicas of each of ``arrays``, through compressed payloads; the same bits
        on every replica. Every replica calls it with arrays of the same shapes and dtypes (its own
        values), each with its variable's state, in the same order. ``comm`` is the replicas'
        :class:`~stratagem.collectives.communicator.Communicator`. The payloads of all ``arrays`` are
        fused: one collective per payload dtype, not one per array."""
        compressed = [self.compress(array, state) for array, state in zip(arrays, states)]
        if self.reduction == "sum":
            return self._reduce_by_sum(comm, compressed)
        if self.reduction == "gather":
            return self._reduce_by_gather(comm, compressed)
        raise NotImplementedError(f"{type(self).__name__} declares reduction={self.reduction!r} but does "
                                  f"not override allreduce()")

    def _reduce_by_sum(self, comm, compressed: list) -> list:
        payloads = [list(c.payload) for c in compressed]
        views = [[_as_dtype(a, self.sum_dtype) for a in payload] for payload in payloads]
        fused = _Fused(views)
        for flat in fused.flats.values():
            if flat.size:
                comm.allreduce(flat, op="sum", out=flat)
        summed = fused.split()
        return [self.expand(Compressed(tuple(_as_dtype(a, p.dtype) for a, p in zip(arrays, payload)),
                                       c.shape, c.dtype, c.meta))
                for arrays, payload, c in zip(summed, payloads, compressed)]

    def _reduce_by_gather(self, comm, compressed: list) -> list:
        fused = _Fused([list(c.payload) for c in compressed])
        gathered = {dtype: comm.allgather(flat) for dtype, flat in fused.flats.items()}
        results = []
        for c in compressed:
            xp = array_module(c.payload[0]) if c.payload else np
            results.append(xp.zeros(c.shape, c.dtype))
        for rank in range(comm.size):
            theirs = fused.split({dtype: rows[rank] for dtype, rows in gathered.items()})
            for out, arrays, c in zip(results, theirs, compressed):
                self.accumulate(out, Compressed(tuple(arrays), c.shape, c.dtype, c.meta))
        return results

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"<{type(self).__name__} {self.name!r}: {options}>"


class _Fused:
    """Arrays of several payloads packed into one flat buffer per dtype (in order), and split back."""

    def __init__(self, payloads: list[list]):
        self.slots: list[list[tuple]] = []          # per payload: (dtype key, offset, shape) per array
        sizes: dict[str, int] = {}
        kinds: dict[str, tuple] = {}                # dtype key -> (dtype, array module)
        for payload in payloads:
            slots = []
            for array in payload:
                key = np.dtype(array.dtype).str
                kinds.setdefault(key, (array.dtype, array_module(array)))
                slots.append((key, sizes.get(key, 0), tuple(array.shape)))
                sizes[key] = sizes.get(key, 0) + int(array.size)
            self.slots.append(slots)
        #: dtype key -> the flat buffer of every array of that dtype.
        self.flats = {key: kinds[key][1].empty(sizes[key], kinds[key][0]) for key in sizes}
        for payload, slots in zip(payloads, self.slots):
            for array, (key, offset, shape) in zip(payload, slots):
                self.flats[key][offset:offset + int(array.size)] = array.reshape(-1)

    def split(self, flats: dict | None = None) -> list[list]:
        """Views of ``flats`` (default: the fused buffers) shaped as the arrays that were packed."""
        flats = self.flats if flats is None else flats
        return [[flats[key][offset:offset + math.prod(shape)].reshape(shape) for key, offset, shape in slots]
                for slots in self.slots]


def _as_dtype(array, dtype):
    """``array``'s bits viewed as ``dtype`` (same item size); itself when ``dtype`` is None or its own."""
    if dtype is None or np.dtype(dtype) == array.dtype:
        return array
    return array.view(dtype)


def check_number(owner: str, option: str, value, *, low: float, high: float | None = None,
                 low_open: bool = False, integer: bool = False):
    """``value`` if it is a number within range, else a ``ConfigurationError`` naming the option.

    >>> check_number("compressor 'topk'", "ratio", 2, low=0, high=1, low_open=True)
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: compressor 'topk': ratio must be a number in (0, 1], got 2
    """
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    ok = not isinstance(value, bool) and isinstance(value, kinds) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        what = "an integer" if integer else "a number"
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        if high is None and low_open:
            span = f"> {low:g}"
        raise ConfigurationError(f"{owner}: {option} must be {what} {'in ' if high is not None else ''}{span}, "
                                 f"got {value!r}")
    return value
