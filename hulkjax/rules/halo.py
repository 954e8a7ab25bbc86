"""The collective-permutes XLA's SPMD partitioner emits to slice a sharded dimension.

A static slice ``[start, start + size)`` of a dimension of length ``dim`` split evenly over ``n``
devices, whose result stays split over the same ``n`` devices, is a windowed reshard in XLA
(``PartitionedHlo::ReshardAsWindowedInput``): device ``j`` needs rows ``[start + j c, start +
(j + 1) c)`` (``c = size / n``) and holds rows ``[j b, (j + 1) b)`` (``b = dim / n``). What it
lacks comes from its neighbours in a halo exchange (``ExchangeHaloAndGetValidData`` in
``xla/service/spmd/spmd_partitioner_util.cc``):

* when no halo is longer than one block, ``ExchangeHalo``: one permute per distance to the left
  and to the right, every device sending the same-sized piece;
* otherwise ``ExchangeHaloCompact``: every device's window cut into pieces at block boundaries,
  one piece per (source, target) pair, and the pieces packed into permutes in which no device
  receives twice, each permute as wide as the union of its pieces.

:func:`halo_permutes` follows both to the row. Measured on XLA:CPU (``tests/cost``): GPT-2's
fused QKV ``split`` (192 columns over 4 devices into three 64-column pieces) compiles to 2, 2 and
3 permutes of 32 + 16, 32 + 32 and 16 + 16 + 16 columns, and position-table slices to the counts
and sizes this module gives.
"""

from __future__ import annotations


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def halo_permutes(dim: int, n: int, start: int, size: int) -> list[tuple[int, list]]:
    """The collective-permutes XLA emits for the slice: ``(rows, [(source, target), ...])`` per
    permute, devices numbered by their block along the dimension.

    ``dim`` and ``size`` must divide by ``n``. An empty list: every device already holds its rows.

    >>> [rows for rows, _ in halo_permutes(192, 4, 0, 64)]  # GPT-2's q of a fused QKV
    [32, 16]
    >>> halo_permutes(192, 4, 64, 64)  # k: one block to the left, one to the right
    [(32, [(0, 1), (1, 2), (2, 3)]), (32, [(1, 0), (2, 1), (3, 2)])]
    >>> [rows for rows, _ in halo_permutes(64, 8, 0, 16)]  # wpe[:16] of a 64-row table, 8 ways
    [4, 4, 4, 2]
    >>> halo_permutes(64, 8, 0, 64)
    []
    """
    b, c = dim // n, size // n

    def left(j):  # rows device j needs from before its block
        return j * b - (start + j * c)

    def right(j):  # rows device j needs from after its block
        return start + (j + 1) * c - (j + 1) * b

    max_left = max(left(j) for j in range(1, n)) if n > 1 else 0
    max_right = max(right(j) for j in range(n - 1)) if n > 1 else 0
    if max_left > b or max_right > b:
        return _compact(b, c, n, start)
    left_bound = -max(left(j) for j in range(n))
    right_bound = b + max(right(j) for j in range(n))
    out = []
    i = _ceil_div(max_left, b) - 1
    while i >= 0 and (-i - 1) * b < right_bound:  # from i + 1 blocks to the left
        out.append((min(max_left - b * i, b) - max(-i * b - right_bound, 0),
                    [(j - i - 1, j) for j in range(i + 1, n)]))
        i -= 1
    skipped = min(max(left_bound - b, 0), max(max_right, 0)) // b
    for i in range(skipped, _ceil_div(max_right, b)):  # from i + 1 blocks to the right
        out.append((min(max_right - b * i, b) - max(left_bound - (i + 1) * b, 0),
                    [(j, j - i - 1) for j in range(i + 1, n)]))
    return [(rows, pairs) for rows, pairs in out if rows > 0]


def _compact(b: int, c: int, n: int, start: int) -> list[tuple[int, list]]:
    """``ExchangeHaloCompact`` for a slice: ``(rows, pairs)`` per permute."""
    # Every device's window, cut at block boundaries: (source block, target, first, last row in
    # the source block, offset in the window).
    src_to_dst: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n)]
    for j in range(n):
        lo, hi = start + j * c, start + (j + 1) * c
        pos = lo
        while pos < hi:
            shard, first = divmod(pos, b)
            piece = min(b - first, hi - pos)
            if shard != j:
                src_to_dst[shard].append((pos - lo, j, first, first + piece))
            pos += piece
    for pieces in src_to_dst:
        pieces.sort(key=lambda p: p[0])  # stable: by offset in the target's window
    nxt = [0] * n
    out = []
    while True:
        seen: set[int] = set()
        lo, hi = b, 0
        pairs = []
        for src in range(n):
            if nxt[src] >= len(src_to_dst[src]):
                continue
            _, dst, first, last = src_to_dst[src][nxt[src]]
            if pairs and (dst in seen
                          or (lo > last and hi == b and first == 0)
                          or (hi < first and lo == 0 and last == b)):
                continue
            seen.add(dst)
            lo, hi = min(lo, first), max(hi, last)
            nxt[src] += 1
            pairs.append((src, dst))
        if not pairs:
            return out
        out.append((hi - lo, pairs))


def permute_axes(axes: tuple[str, ...], sizes: dict[str, int], pairs) -> tuple[str, ...]:
    """The mesh axes along which a permute's sources and targets differ, for a dimension split
    over ``axes`` (block ``j`` at mesh coordinates ``j`` in row-major order over ``axes``): how
    the compiled HLO's permute is attributed (:class:`hulkjax.emit.hlo.Collective`).

    >>> permute_axes(("data", "model"), {"data": 2, "model": 4}, [(3, 4), (1, 2)])
    ('data', 'model')
    >>> permute_axes(("data", "model"), {"data": 2, "model": 4}, [(1, 2), (5, 6)])
    ('model',)
    """

    def coords(j):
        out = {}
        for a in reversed(axes):
            j, out[a] = divmod(j, sizes[a])
        return out

    differ = set()
    for s, t in pairs:
        cs, ct = coords(s), coords(t)
        differ |= {a for a in axes if cs[a] != ct[a]}
    return tuple(a for a in axes if a in differ)
