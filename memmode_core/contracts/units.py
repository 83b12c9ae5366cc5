"""Byte sizes for people: read (``"8GiB"``, ``"512 MB"``: budgets and size options) and written (``"1.5 GiB"``)."""

from __future__ import annotations

#: unit -> bytes: decimal units are powers of 1000, binary ones of 1024
UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_byte_size(text: str) -> int:
    """``"8GiB"`` -> 8589934592. Decimal units are powers of 1000, binary ones of 1024."""
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number) :]
    if unit not in UNITS or not number:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. '8GiB', '512MB' or a number of bytes")
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. '8GiB'") from None
    return finite_bytes(amount * UNITS[unit])


def finite_bytes(amount: float) -> int:
    if amount != amount or amount in (float("inf"), float("-inf")):  # NaN, or a string such as '1e400GB'
        raise ValueError("must be a finite number of bytes (None means no limit)")
    if amount < 0:
        raise ValueError("must not be negative")
    return int(amount)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
