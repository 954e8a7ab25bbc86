"""Sharding specs as the rules and the cost model see them.

A :data:`Spec` has one entry per dimension: the tuple of mesh axes that split it (``()`` for none).
``((), ("data",))`` is ``PartitionSpec(None, "data")``. Specs are plain tuples: hashable and cheap.

>>> to_pspec(((), ("data", "model")))
P(None, ('data', 'model'))
>>> from_pspec(to_pspec(((), ("data",))), 2)
((), ('data',))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from hulkjax.errors import InvalidPlanError

Spec = tuple[tuple[str, ...], ...]


def replicated(rank: int) -> Spec:
    """The spec of a replicated tensor of this rank."""
    return ((),) * rank


def to_pspec(spec: Spec) -> PartitionSpec:
    """A ``PartitionSpec`` (trailing unsharded dims dropped)."""
    entries: list = [None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))
                     for axes in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_pspec(pspec: PartitionSpec, rank: int) -> Spec:
    """The :data:`Spec` of a ``PartitionSpec`` for a tensor of this rank."""
    out: list[tuple[str, ...]] = []
    for i in range(rank):
        e = pspec[i] if i < len(pspec) else None
        out.append(() if e is None else (tuple(e) if isinstance(e, tuple) else (e,)))
    return tuple(out)


def axes_of(spec: Spec) -> tuple[str, ...]:
    """Every mesh axis the spec uses, in dimension order."""
    return tuple(a for axes in spec for a in axes)


def num_shards(spec: Spec, sizes: Mapping[str, int]) -> int:
    """Into how many pieces the spec splits the tensor."""
    n = 1
    for a in axes_of(spec):
        n *= sizes[a]
    return n


def local_shape(shape: Sequence[int], spec: Spec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The per-device shape."""
    out = []
    for d, axes in zip(shape, spec):
        for a in axes:
            d //= sizes[a]
        out.append(d)
    return tuple(out)


def divides(shape: Sequence[int], spec: Spec, sizes: Mapping[str, int]) -> bool:
    """Whether every sharded dimension divides evenly."""
    for d, axes in zip(shape, spec):
        n = 1
        for a in axes:
            n *= sizes[a]
        if d % n:
            return False
    return True


def dim_of(spec: Spec, axis: str) -> int | None:
    """The dimension that ``axis`` splits, or ``None``."""
    for i, axes in enumerate(spec):
        if axis in axes:
            return i
    return None


def without(spec: Spec, drop: Sequence[str]) -> Spec:
    """The spec with some axes removed (the tensor gathered over them)."""
    drop = set(drop)
    return tuple(tuple(a for a in axes if a not in drop) for axes in spec)


def with_axis(spec: Spec, dim: int, axis: str) -> Spec:
    """The spec with ``axis`` added (minor-most) to ``dim``."""
    out = list(spec)
    out[dim] = (*out[dim], axis)
    return tuple(out)


def spec_to_json(spec: PartitionSpec) -> list:
    """A ``PartitionSpec`` as JSON: one entry per dimension, a list for several axes.

    >>> spec_to_json(PartitionSpec(None, ("a", "b")))
    [None, ['a', 'b']]
    """
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_json(entries) -> PartitionSpec:
    """Inverse of :func:`spec_to_json`."""
    if not isinstance(entries, list):
        raise InvalidPlanError(f"a PartitionSpec is stored as a list, got {entries!r}")
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


def paths_to_json(paths: dict) -> list:
    """``{(node, operand): (PartitionSpec, ...)}`` (``operand_paths``) as JSON."""
    return [[n, k, [spec_to_json(x) for x in via]] for (n, k), via in sorted(paths.items())]


def paths_from_json(entries) -> dict:
    """Inverse of :func:`paths_to_json`."""
    if not isinstance(entries, list):
        raise InvalidPlanError(f"operand paths are stored as a list, got {entries!r}")
    return {(int(n), int(k)): tuple(spec_from_json(x) for x in via) for n, k, via in entries}

