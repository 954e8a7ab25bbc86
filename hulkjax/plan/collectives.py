"""Collective kinds and the record of one collective a layout implies.

>>> Comm("all-reduce", ("data",), 4096)
Comm(kind='all-reduce', axes=('data',), bytes=4096, deferred=False)
"""

from __future__ import annotations

from dataclasses import dataclass

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                    "collective-permute")
"""Every collective kind hulkjax predicts or reads back from compiled HLO."""


@dataclass(frozen=True)
class Comm:
    """A collective an operator or a layout change implies.

    Attributes:
      kind: one of :data:`COLLECTIVE_KINDS`.  # str
      axes: mesh axes it runs over.  # tuple of str
      bytes: per-device bytes of the tensor it moves (all-reduce: the operand; reduce-scatter: the
        full operand; all-gather: the gathered result; all-to-all: the local block).  # int
      deferred: off the step's critical path: its result only feeds the state update (a gradient's
        reduction). Compilers combine such collectives into a few large ones.  # bool
    """

    kind: str
    axes: tuple[str, ...]
    bytes: int
    deferred: bool = False
