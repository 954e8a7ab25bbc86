"""Why no plan fits: the teaching message of :class:`~hulkjax.errors.InfeasiblePlanError`.

A mesh axis whose size divides no dimension of the step's inputs cannot split any of them: every
slice along it holds the same copy of the parameters, optimizer state and batch, so it adds devices
without adding memory. On three cloud regions (``Topology.preset("geo")``: a 3-way ``region`` axis)
and a model whose sizes are powers of two, that is the cause of an infeasible plan, and the fix is
the topology or the sizes, not a smaller batch. :func:`infeasible_error` names such axes with the
sizes involved and says what to do; the planners (``ilp``, ``auto``) raise what it returns.

>>> import jax.numpy as jnp, hulkjax as hj
>>> g = hj.trace(lambda w, x: (w, x @ w), jnp.ones((64, 64)), jnp.ones((32, 64)))
>>> [(a.axis, a.size, a.splittable_bytes) for a in axis_splits(g, hj.Topology.preset("geo"))]
[('region', 3, 0.0), ('gpu', 2, 24576.0)]
"""

from __future__ import annotations

from dataclasses import dataclass

from hulkjax.errors import InfeasiblePlanError
from hulkjax.formatting import format_bytes
from hulkjax.trace.graph import DATA, OpGraph

# The words for what a mesh axis spans, by its widest level (Topology.axis_scope).
_SPANS = {"wan": "regions", "region": "nodes", "node": "devices"}


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisSplit:
    """How much of a step's inputs one mesh axis can split.

    Attributes:
      axis: the mesh axis name.  # str
      size: its size (> 1).  # int
      spans: what its slices are: ``"regions"``, ``"nodes"`` or ``"devices"``.  # str
      splittable_bytes: bytes of the inputs with a dimension divisible by ``size``.  # float
      total_bytes: bytes of all inputs.  # float
    """

    axis: str
    size: int
    spans: str
    splittable_bytes: float
    total_bytes: float

    @property
    def splits_nothing(self) -> bool:
        """No input has a dimension divisible by the axis size."""
        return self.splittable_bytes == 0


def axis_splits(graph: OpGraph, topology) -> list[AxisSplit]:
    """One :class:`AxisSplit` per mesh axis of size > 1 (in mesh order).

    An input can be split over a set of mesh axes only along a dimension that the product of their
    sizes divides, so an axis whose size divides none of an input's dimensions leaves that input
    whole on every slice along it, whatever the other axes do.
    """
    shapes = [(graph.values[v].shape, float(graph.values[v].nbytes)) for v in graph.inputs]
    total = sum(b for _, b in shapes)
    out = []
    for axis, size in zip(topology.axis_names, topology.shape):
        if size < 2:
            continue
        splittable = float(sum(b for shape, b in shapes if any(d % size == 0 for d in shape)))
        out.append(AxisSplit(axis=axis, size=int(size), spans=_SPANS.get(
            topology.axis_scope(axis), "devices"), splittable_bytes=splittable, total_bytes=total))
    return out


def blocking_axes(graph: OpGraph, topology) -> list[AxisSplit]:
    """The axes that cannot split most of the inputs' bytes (none of them, or under half)."""
    return [a for a in axis_splits(graph, topology)
            if a.total_bytes > 0 and a.splittable_bytes < 0.5 * a.total_bytes]


def infeasible_error(cm, need: float, *, planner: str, exhaustive: bool = True,
                     also: str | None = None) -> InfeasiblePlanError:
    """The error for "even the leanest plan needs ``need`` bytes per device", naming its cause.

    Args:
      cm: the cost model (graph, topology, device capacity).
      need: the least memory per device any plan the planner searched needs, bytes.
      planner: who searched (``"ilp"``, ``"auto"``), for the first words of the message.
      exhaustive: ``need`` is the least over every layout (``ilp``), not over a search's.
      also: one more remedy to offer (``auto``: the ILP, which searches every layout).
    """
    g, topo = cm.graph, cm.topology
    biggest = sorted(((g.values[v].nbytes, p, g.values[v].shape) for v, p in
                      zip(g.inputs, g.input_paths)), reverse=True)[:3]
    tensors = ", ".join(f"{p} {tuple(s)} ({format_bytes(b)})" for b, p, s in biggest)
    leanest = "even the most memory-saving layouts need" if exhaustive else \
        "the leanest plan it found needs"
    head = (f"{planner}: no plan fits: {leanest} {format_bytes(need)} per device and the "
            f"smallest device has "
            f"{format_bytes(cm.capacity)}. Largest tensors: {tensors}.")
    blocked = blocking_axes(g, topo)
    if not blocked:
        fixes = ["more devices", "a smaller batch", "rematerialization (jax.checkpoint)",
                 "bfloat16", *([also] if also else [])]
        return InfeasiblePlanError(f"{head} Use {', '.join(fixes[:-1])}, or {fixes[-1]}.")
    causes = []
    for a in blocked:
        if a.splits_nothing:
            causes.append(f"nothing in the model can be split over mesh axis {a.axis!r} "
                          f"({a.size} {a.spans}): no dimension of the step's inputs is divisible "
                          f"by {a.size}")
        else:
            causes.append(f"mesh axis {a.axis!r} ({a.size} {a.spans}) can split only "
                          f"{format_bytes(a.splittable_bytes)} of the inputs' "
                          f"{format_bytes(a.total_bytes)}: the rest has no dimension divisible "
                          f"by {a.size}")
    names = {a.axis for a in blocked}
    ways = 1
    for axis, size in zip(topo.axis_names, topo.shape):
        ways *= 1 if axis in names else int(size)
    dims = sorted({d for v in g.inputs for d in g.values[v].shape if d > 1})
    shown = ", ".join(map(str, dims[:16])) + (", ..." if len(dims) > 16 else "")
    a = blocked[0]
    one = a.spans.removesuffix("s")
    batch = _batch_size(g)
    resize = f"hidden sizes divisible by {a.size} for the parameters"
    if batch and batch % a.size:
        resize = f"a batch of {-(-batch // a.size) * a.size} instead of {batch} for the " \
                 f"activations, {resize}"
    fixes = [f"a topology whose mesh does not put {a.size} {a.spans} on one axis (e.g. "
             f"{a.size - 1} or {a.size + 1} {a.spans}, or one job per {one})",
             f"sizes that {a.size} divides ({resize})",
             f"staged plans that place layers per {one} (stages=True, the default of 'ilp' "
             f"and 'auto')",
             "more memory per device", *([also] if also else [])]
    share = "the inputs are" if all(b.splits_nothing for b in blocked) else "most of the inputs is"
    return InfeasiblePlanError(
        f"{head} The mesh is why: {'; '.join(causes)}. Every slice along "
        f"{'it' if len(blocked) == 1 else 'them'} holds the same copy, so {share} divided at most "
        f"{ways} ways, not {topo.num_devices}. The inputs' dimensions: {shown}. Fix it with "
        f"{', '.join(fixes[:-1])}, or {fixes[-1]}.")

def _batch_size(g: OpGraph) -> int | None:
    """Dimension 0 of the data inputs (the batch the baselines split), the most common one."""
    sizes = [g.values[v].shape[0] for v, r in zip(g.inputs, g.input_roles)
             if r == DATA and g.values[v].shape]
    return max(sorted(set(sizes)), key=sizes.count) if sizes else None
