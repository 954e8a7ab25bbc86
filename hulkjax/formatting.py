"""Units for people: bytes, rates, times, shapes, layouts. One set of formatters for every layer.

A leaf module (it imports nothing from hulkjax), so the topology's ``describe``, the cost record's
``str``, explanations, plots, errors and the command line all print the same units: decimal SI
prefixes (``kB``, ``MB``, ``GB``: powers of 1000, as link and memory vendors quote them), seconds
scaled to ``s`` / ``ms`` / ``us`` / ``ns``.

>>> format_bytes(1.5e9), format_rate(5e10), format_time(0.0123), format_shape((8, 16))
('1.5 GB', '50 GB/s', '12.3 ms', '8x16')
"""

from __future__ import annotations

_BYTE_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))


def byte_unit(n: float) -> tuple[str, float]:
    """The unit and its scale for showing ``n`` bytes (plots label an axis with it).

    >>> byte_unit(3e6)
    ('MB', 1000000.0)
    """
    for unit, scale in _BYTE_UNITS:
        if abs(n) >= scale:
            return unit, scale
    return "B", 1.0


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit and its scale for showing ``seconds``.

    >>> time_unit(2e-5)
    ('us', 1e-06)
    """
    for unit, scale in _TIME_UNITS:
        if abs(seconds) >= scale:
            return unit, scale
    return "ns", 1e-9


def format_bytes(n: float) -> str:
    """Decimal units: ``format_bytes(1.5e9) == "1.5 GB"``, ``format_bytes(512) == "512 B"``.

    >>> format_bytes(2048), format_bytes(0)
    ('2.05 kB', '0 B')
    """
    unit, scale = byte_unit(n)
    return f"{n:.0f} B" if unit == "B" else f"{n / scale:.3g} {unit}"


def format_rate(bytes_per_s: float) -> str:
    """``format_rate(5e10) == "50 GB/s"``.

    >>> format_rate(1.25e8)
    '125 MB/s'
    """
    return format_bytes(bytes_per_s) + "/s"


def format_time(seconds: float) -> str:
    """``format_time(0.0123) == "12.3 ms"``; zero is ``"0 s"``.

    >>> format_time(0), format_time(3.2e-7)
    ('0 s', '320 ns')
    """
    if seconds == 0:
        return "0 s"
    unit, scale = time_unit(seconds)
    return f"{seconds / scale:.3g} {unit}"


def format_shape(shape) -> str:
    """``(8, 16, 64)`` -> ``"8x16x64"``; scalars -> ``"scalar"``.

    >>> format_shape(()), format_shape((3, 4))
    ('scalar', '3x4')
    """
    return "x".join(str(d) for d in shape) if len(shape) else "scalar"


def format_count(n: int, word: str) -> str:
    """``format_count(2, "region") == "2 regions"``.

    >>> format_count(1, "node")
    '1 node'
    """
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_spec(spec) -> str:
    """A layout: ``PartitionSpec(None, 'model')`` -> ``"[-, model]"``; replicated -> ``"replicated"``.

    Also takes the cost model's specs (a tuple of axis tuples per dimension).

    >>> from jax.sharding import PartitionSpec as P
    >>> format_spec(P(None, ("node", "gpu"))), format_spec(((), ("gpu",))), format_spec(P())
    ('[-, node+gpu]', '[-, gpu]', 'replicated')
    """
    entries = list(spec)
    if not any(e for e in entries):
        return "replicated"
    parts = []
    for e in entries:
        if not e:
            parts.append("-")
        elif isinstance(e, tuple):
            parts.append("+".join(e))
        else:
            parts.append(str(e))
    return "[" + ", ".join(parts) + "]"


SHORT_COLLECTIVES = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
                     "all-to-all": "A2A", "collective-permute": "CP"}
"""Short names of collective kinds, for tables."""
