"""Memory budgets: bytes given as an int or as text such as ``"512MiB"``."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_budget"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_budget(value: object, name: str = "memory_budget") -> int:
    """Bytes from an int or a string with a unit (B, KB, MB, GB, KiB, MiB, GiB).

    Decimal units are powers of 1000, binary units powers of 1024.

    Example:
        >>> parse_budget("512MiB"), parse_budget("2GB"), parse_budget(4096)
        (536870912, 2000000000, 4096)
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"seqckpt: {name} must be bytes as an int or a string like '512MiB', "
            f"got {value!r} ({type(value).__name__})."
        )
    if isinstance(value, int):
        nbytes = value
    else:
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"seqckpt: {name}={value!r} is not a size; write a number and a unit "
                "such as '512MiB', '2GB' or '1048576'."
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(
            f"seqckpt: {name} must be a positive number of bytes, got {value!r}."
        )
    return nbytes


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in MiB with two decimals, e.g. ``'12.50 MiB'``."""
    return f"{nbytes / 2**20:.2f} MiB"
