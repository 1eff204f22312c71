"""Sizes for people: bytes in the unit that shows them."""

GB = 1e9


def amount(n: float) -> str:
    """Bytes in the unit that shows them (a tiny filesystem's "0.0 GB free" said nothing)."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"
