"""Byte sizes and rates as the benchmarks read and print them.

Sizes are binary (``4K`` = 4096 bytes, ``64M`` = 2**26), as nccl-tests and MPI benchmarks use;
rates are decimal (``GB/s`` = 10**9 bytes a second), as nccl-tests report bandwidth.

    >>> parse_size("64M")
    67108864
    >>> parse_sizes("4K-1M")                 # a range: powers of 4 from the start, the end included
    [4096, 16384, 65536, 262144, 1048576]
    >>> parse_sizes("4K-32Kx2")              # xN: another step factor
    [4096, 8192, 16384, 32768]
    >>> parse_sizes("4K,1M,64M")             # a list (ranges and single sizes mix: "4K-64K,1M")
    [4096, 1048576, 67108864]
    >>> human_bytes(67108864), human_bytes(1536), human_rate(2.5e9)
    ('64M', '1.5K', '2.50 GB/s')

Errors are :class:`SizeError`, which is both a ``ValueError`` and an ``argparse.ArgumentTypeError``,
so ``type=parse_sizes`` in an argparse option prints the message itself.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["SizeError", "parse_size", "parse_sizes", "human_bytes", "human_rate", "DEFAULT_STEP"]

#: The step of a range without ``xN``: ``4K-256M`` is 4K, 16K, 64K, ... 256M (nine sizes, not 17).
DEFAULT_STEP = 4

_SCALE = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_RANGE = re.compile(r"([^-]+)-([^-x]+?)(?:x(\d+))?", re.IGNORECASE)


class SizeError(argparse.ArgumentTypeError, ValueError):
    """A size or size list that cannot be read; the message says what is wrong and what would do."""


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: ``4096``, ``4K``, ``4KB``, ``4KiB``, ``64M``, ``1G`` (binary units, any case).

    >>> parse_size("4k"), parse_size("1GiB"), parse_size(512)
    (4096, 1073741824, 512)
    >>> parse_size("1.5M")
    Traceback (most recent call last):
    ...
    stratagem.bench.units.SizeError: not a size: '1.5M' (use a whole number ...; for 1.5M write 1536K)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise SizeError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE.fullmatch(str(text).strip())
    if not match:
        hint = ""
        fraction = re.fullmatch(r"\s*(\d*\.\d+)\s*([KMGT])(?:I?B)?\s*", str(text), re.IGNORECASE)
        if fraction and (exact := float(fraction.group(1)) * _SCALE[fraction.group(2).upper()]).is_integer():
            unit = next(u for u in "TGMK" if int(exact) % _SCALE[u] == 0 or u == "K")
            hint = (f"; for {text.strip()} write {int(exact) // _SCALE[unit]}{unit}" if int(exact) % _SCALE[unit] == 0
                    else f"; for {text.strip()} write {int(exact)}")
        raise SizeError(f"not a size: {text!r} (use a whole number with an optional binary unit: "
                        f"4096, 4K, 64M, 1G{hint})")
    return int(match.group(1)) * _SCALE[match.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """The sizes in ``text``, sorted, without repeats: comma-separated sizes and ranges.

    A range ``A-B`` is A, A*4, A*16, ... up to B, and B itself even when the steps skip it
    (``4K-128M`` ends 16M, 64M, 128M); ``A-BxN`` steps by N instead (``x2``: every power of 2).

    >>> parse_sizes("64K-4K")
    Traceback (most recent call last):
    ...
    stratagem.bench.units.SizeError: size range '64K-4K' goes down: write the smaller size first (4K-64K)
    """
    sizes: set[int] = set()
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        match = _RANGE.fullmatch(item)
        if match is None:
            sizes.add(parse_size(item))
            continue
        low, high = parse_size(match.group(1)), parse_size(match.group(2))
        step = int(match.group(3) or DEFAULT_STEP)
        if step < 2:
            raise SizeError(f"size range {item!r}: the step x{step} must be 2 or more")
        if low < 1:
            raise SizeError(f"size range {item!r} must start at 1 byte or more")
        if high < low:
            raise SizeError(f"size range {item!r} goes down: write the smaller size first "
                            f"({match.group(2).strip()}-{match.group(1).strip()})")
        size = low
        while size < high:
            sizes.add(size)
            size *= step
        sizes.add(high)
    if not sizes:
        raise SizeError(f"no sizes in {text!r} (write e.g. 4K-64M, 4K-64Mx2 or 4K,1M,64M)")
    if 0 in sizes:
        raise SizeError(f"sizes must be at least 1 byte: {text!r}")
    return sorted(sizes)


def human_bytes(n: int) -> str:
    """``64M``, ``4K``, ``1.5K``, ``100B``: the largest binary unit, exact when it divides ``n``."""
    for unit in "TGMK":
        scale = _SCALE[unit]
        if n >= scale:
            return f"{n // scale}{unit}" if n % scale == 0 else f"{n / scale:.3g}{unit}"
    return f"{n}B"


def human_rate(bytes_per_s: float) -> str:
    """``2.50 GB/s``, ``850 MB/s``: decimal units (10**9), three significant digits."""
    value = float(bytes_per_s)
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if abs(value) >= scale:
            return f"{_three_digits(value / scale)} {unit}"
    return f"{_three_digits(value)} B/s"


def _three_digits(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
