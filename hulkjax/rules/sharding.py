"""Per-primitive sharding rules: how an operator runs for given operand layouts.

Two tables, keyed by primitive (like JAX's ``mlir.register_lowering``):

* ``candidate_rules[prim](node, graph, mesh) -> list[Resolution]`` for **leaders** (matmuls,
  convolutions, embedding gathers/scatters): every way to run the operator on the mesh, each with the
  operand layouts it needs, the result layouts, and the collectives it implies itself (a sharded
  contraction leaves partial sums: all-reduce, or reduce-scatter onto a result dimension).
* ``follow_rules[prim](node, graph, lead, lead_spec, mesh) -> Resolution`` for **followers**
  (elementwise, shape and reduction ops): the operator takes the layout of one operand (its lead)
  and states what it needs of the others.

A follower without a follow rule but with a dimension rule (:mod:`hulkjax.rules.dims`) follows by
it: each sharded dimension goes where the rule maps it, a contracted one leaves partial sums (an
all-reduce), the rest is gathered. A primitive in no table is replicated (operands gathered, result
replicated): correct, and visible to the cost model as the all-gathers it costs. Loops (``scan``,
``while``, ``cond``) are leaders through :mod:`hulkjax.rules.loops`, whose candidates the body
planner makes (:mod:`hulkjax.rules.leaders`).

>>> from hulkjax.rules.sharding import Mesh
>>> Mesh(("data", "model"), (2, 4)).sizes
{'data': 2, 'model': 4}
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from jax.extend.core import primitives as P

from hulkjax.plan.collectives import Comm
from hulkjax.plan.specs import Spec, divides, local_shape, num_shards, replicated
from hulkjax.rules.dims import CONTRACTED, dim_rules, map_dim
from hulkjax.rules.halo import halo_permutes, permute_axes
from hulkjax.trace.graph import Node, OpGraph, dtype_size
from hulkjax.trace.primitives import (
    CASTS,
    COMBINING_SCATTERS,
    ELEMENTWISE,
    KERNELS,
    PASSTHROUGH,
    PER_INPUT_ELEMENT,
    POOLING,
    SCATTERS,
    SHAPE_OPS,
    SIZE_PRESERVING,
    SPLIT,
    STACK,
    TOP_K,
    UNSTACK,
    WINDOW_GRADIENTS,
)


@dataclass(frozen=True)
class Mesh:
    """Mesh axes and sizes (the part of a topology the rules need)."""

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape))


@dataclass(frozen=True)
class Resolution:
    """One way to run an operator.

    Attributes:
      in_specs: the layout each operand must have (``None`` for literals).
      out_specs: the layout of each result.
      comms: collectives the operator itself implies (partial sums), in the order they run:
        each takes the previous one's result (the first, the operator's).
      shards: into how many pieces the work is split (1 = every device does all of it).
      label: a short human name (``"col"``, ``"batch:data"``, ...).
      scatters: whether partial sums are reduce-scattered onto the result (``comms`` then says
        how: one reduce-scatter, or the partitioner's all-reduce and permute of
        :func:`scattered_sum`).
    """

    in_specs: tuple[Spec | None, ...]
    out_specs: tuple[Spec, ...]
    comms: tuple[Comm, ...] = ()
    shards: int = 1
    label: str = field(default="", compare=False)
    scatters: bool = field(default=False, compare=False)


CandidateRule = Callable[[Node, OpGraph, Mesh], list[Resolution]]
FollowRule = Callable[[Node, OpGraph, int, Spec, Mesh], Resolution]
candidate_rules: dict[object, CandidateRule] = {}
follow_rules: dict[object, FollowRule] = {}


def registrar(table: dict, doc: str) -> Callable:
    """``register(*prims)``: a decorator that files its rule under each primitive in ``table``."""

    def register(*prims):
        def deco(rule):
            for p in prims:
                table[p] = rule
            return rule

        return deco

    register.__doc__ = doc
    return register


register_candidate_rule = registrar(
    candidate_rules, "Register a leader rule ``(node, graph, mesh) -> list[Resolution]``: every "
    "way to run the operator, each with its operand and result layouts and the collectives it "
    "implies (the replicated candidate is added for you).")
register_follow_rule = registrar(
    follow_rules, "Register a follower rule ``(node, graph, lead, lead_spec, mesh) -> Resolution``: "
    "how the operator runs when its lead operand has layout ``lead_spec``.")


# ---- helpers ---------------------------------------------------------------------------------


def _shape(graph: OpGraph, vid: int | None) -> tuple[int, ...]:
    return () if vid is None else graph.values[vid].shape


def _local_bytes(graph: OpGraph, vid: int, spec: Spec, mesh: Mesh) -> int:
    v = graph.values[vid]
    return int(np.prod(local_shape(v.shape, spec, mesh.sizes), dtype=np.int64)) * dtype_size(v.dtype)


def replicated_resolution(node: Node, graph: OpGraph) -> Resolution:
    """Operands gathered, results replicated: the fallback for operators without a rule."""
    return Resolution(
        in_specs=tuple(None if v is None else replicated(len(_shape(graph, v))) for v in node.inputs),
        out_specs=tuple(replicated(len(_shape(graph, o))) for o in node.outputs),
        label="replicated")


def follow(node: Node, graph: OpGraph, lead: int, lead_spec: Spec, mesh: Mesh) -> Resolution:
    """Resolve a follower from its lead operand's layout: its follow rule, else its dimension rule
    (:func:`mapped_follow`), else replicated."""
    rule = follow_rules.get(node.primitive)
    if rule is not None:
        return rule(node, graph, lead, lead_spec, mesh)
    if node.primitive in dim_rules:
        return mapped_follow(node, graph, lead, lead_spec, mesh, partial_kind="all-reduce")
    return replicated_resolution(node, graph)


def _conform(graph: OpGraph, node: Node, out_spec: Spec) -> tuple[Spec | None, ...]:
    """Operand layouts matching an elementwise result layout (size-1 broadcast dims unsharded)."""
    out_shape = _shape(graph, node.outputs[0])
    ins = []
    for v in node.inputs:
        if v is None:
            ins.append(None)
            continue
        s = _shape(graph, v)
        if len(s) != len(out_shape):
            ins.append(replicated(len(s)))
        else:
            ins.append(tuple(ax if s[d] == out_shape[d] else () for d, ax in enumerate(out_spec)))
    return tuple(ins)


# ---- followers -------------------------------------------------------------------------------

@register_follow_rule(*ELEMENTWISE, *CASTS)
def _elementwise_follow(node, graph, lead, lead_spec, mesh):
    out_shape = _shape(graph, node.outputs[0])
    lead_shape = _shape(graph, node.inputs[lead])
    if len(lead_shape) != len(out_shape):
        out = replicated(len(out_shape))
    else:
        out = tuple(ax if lead_shape[d] == out_shape[d] else () for d, ax in enumerate(lead_spec))
    outs = tuple(out if len(_shape(graph, o)) == len(out) else replicated(len(_shape(graph, o)))
                 for o in node.outputs)
    return Resolution(_conform(graph, node, out), outs, shards=num_shards(out, mesh.sizes))


def mapped_follow(node: Node, graph: OpGraph, lead: int, lead_spec: Spec, mesh: Mesh,
                  partial_kind: str | None = None) -> Resolution:
    """Carry each sharded dim through the dimension table (``map_dim``); gather what does not
    survive; other operands replicated.

    Dims summed away leave partial sums: an all-reduce over their axes when ``partial_kind``,
    one dimension at a time where they are split over different axes (the last dimension's
    first, each reading the last), as XLA's partitioner completes a reduction: ``sum`` over
    dims 0 and 1 of a ``(data, model)``-split array is an all-reduce over ``model`` then one over
    ``data`` (XLA:CPU; a ``dot_general``'s contraction likewise, :func:`_combine`).
    """
    out_shape = _shape(graph, node.outputs[0])
    out = [()] * len(out_shape)
    need = list(lead_spec)
    partial: dict[int, tuple[str, ...]] = {}  # summed-away dim -> its axes
    for d, axes in enumerate(lead_spec):
        if not axes:
            continue
        r = map_dim(node, graph, lead, d)
        if isinstance(r, int) and not out[r]:
            cand = list(out)
            cand[r] = axes
            if divides(out_shape, tuple(cand), mesh.sizes):
                out[r] = axes
                continue
        if r == CONTRACTED and partial_kind:
            partial[d] = tuple(axes)
            continue
        need[d] = ()  # gathered before the op
    ins = [None] * len(node.inputs)
    ins[lead] = tuple(need)
    for k, v in enumerate(node.inputs):
        if k != lead and v is not None:
            ins[k] = replicated(len(_shape(graph, v)))
    out_t = tuple(out)
    comms = ()
    if partial:
        nbytes = _local_bytes(graph, node.outputs[0], out_t, mesh)
        comms = tuple(Comm(partial_kind, axes, nbytes)
                      for _, axes in sorted(partial.items(), reverse=True))
    work = num_shards(tuple(need), mesh.sizes)
    outs = tuple(out_t if k == 0 else replicated(len(_shape(graph, o))) for k, o in enumerate(node.outputs))
    return Resolution(tuple(ins), outs, comms, work)


@register_follow_rule(*SHAPE_OPS)
def _shape_follow(node, graph, lead, lead_spec, mesh):
    r = mapped_follow(node, graph, lead, lead_spec, mesh)
    return Resolution(r.in_specs, r.out_specs, r.comms, num_shards(r.out_specs[0], mesh.sizes))


_ARITH_REDUCTIONS = frozenset((P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p))


@register_follow_rule(*_ARITH_REDUCTIONS)
def _reduce_follow(node, graph, lead, lead_spec, mesh):
    return mapped_follow(node, graph, lead, lead_spec, mesh, partial_kind="all-reduce")


@register_follow_rule(*(PER_INPUT_ELEMENT - _ARITH_REDUCTIONS))
def _along_axis_follow(node, graph, lead, lead_spec, mesh):
    return mapped_follow(node, graph, lead, lead_spec, mesh)


def _axes_size(axes, mesh) -> int:
    n = 1
    for a in axes:
        n *= mesh.sizes[a]
    return n


@register_follow_rule(P.concatenate_p)
def _concat_follow(node, graph, lead, lead_spec, mesh):
    """Operands keep the lead's layout. Along the concatenated dimension a split survives when every
    operand divides it (the gradient of ``split``, heads concatenated back), and XLA's partitioner
    moves the split elsewhere to concatenate: where another dimension's block divides by the
    split's size, an all-to-all per operand moves the split onto it, the blocks are concatenated
    whole along the dimension, and one more all-to-all moves the result's split back; where none
    does, each operand is all-gathered along the dimension and the result cut from the whole
    (measured on XLA:CPU: ``tests/cost/test_backends.py``). Otherwise that dimension is gathered
    first."""
    dim = node.params["dimension"]
    axes = lead_spec[dim]
    n = _axes_size(axes, mesh)
    keep = bool(axes) and all(v is None or _shape(graph, v)[dim] % n == 0 for v in node.inputs)
    out = tuple(ax if d != dim or keep else () for d, ax in enumerate(lead_spec))
    ins = tuple(None if v is None else out for v in node.inputs)
    comms = ()
    if keep:
        operands = [v for v in node.inputs if v is not None]
        block = local_shape(_shape(graph, node.outputs[0]), out, mesh.sizes)
        if any(size % n == 0 for d, size in enumerate(block) if d != dim):
            comms = tuple(Comm("all-to-all", tuple(axes), _local_bytes(graph, v, out, mesh))
                          for v in operands)
            comms += (Comm("all-to-all", tuple(axes),
                           _local_bytes(graph, node.outputs[0], out, mesh)),)
        else:
            comms = tuple(Comm("all-gather", tuple(axes), _local_bytes(graph, v, out, mesh) * n)
                          for v in operands)
    return Resolution(ins, (out,), comms, shards=num_shards(out, mesh.sizes))


def _same_size_dims_follow(node, graph, lead, lead_spec, mesh):
    """Slicing, padding, reversal, sorting, scans, top-k: dims that keep their size keep their
    sharding (except the dims the operator works along); every same-rank operand keeps the axes of
    the dims where it is as large as the result (a dynamic update's update, a sort's keys)."""
    src, dst = _shape(graph, node.inputs[lead]), _shape(graph, node.outputs[0])
    touched = set()
    if node.primitive is P.rev_p:
        touched = set(node.params["dimensions"])
    elif node.primitive is P.sort_p:
        touched = {node.params["dimension"]}
    elif node.primitive in TOP_K:
        axis = node.params.get("axis", node.params.get("reduction_dimension", len(src) - 1))
        touched = {axis % max(len(src), 1)}
    if len(src) != len(dst):
        return replicated_resolution(node, graph)
    out = tuple(ax if src[d] == dst[d] and d not in touched else () for d, ax in enumerate(lead_spec))
    if node.primitive is P.slice_p:
        kept = _sharded_slice(node, graph, lead_spec, mesh)
        if kept is not None:
            d, comms = kept
            out = tuple(lead_spec[d] if i == d else ax for i, ax in enumerate(out))
            return Resolution((tuple(out[:d]) + (lead_spec[d],) + tuple(out[d + 1:]),), (out,),
                              comms, shards=num_shards(out, mesh.sizes))
    ins = []
    for v in node.inputs:
        if v is None:
            ins.append(None)
            continue
        shape = _shape(graph, v)
        if len(shape) != len(dst):
            ins.append(replicated(len(shape)))
        else:
            ins.append(tuple(ax if shape[d] == dst[d] else () for d, ax in enumerate(out)))
    outs = tuple(out if _shape(graph, o) == dst else replicated(len(_shape(graph, o)))
                 for o in node.outputs)
    return Resolution(tuple(ins), outs, shards=num_shards(out, mesh.sizes))


def _sharded_slice(node, graph, lead_spec, mesh):
    """A static slice along one sharded dimension keeps it sharded, as XLA compiles it.

    XLA reshards the operand as a windowed input: every device fetches the rows of its result
    block that it does not hold from the devices that do, in a halo exchange of
    collective-permutes (GPT-2's ``wpe[:T]`` of a position table sharded by rows), instead of
    gathering the operand. :func:`hulkjax.rules.halo.halo_permutes` gives the permutes and their
    rows as XLA's partitioner makes them; checked against XLA:CPU on 8 devices
    (``tests/cost/test_backends.py``), count and bytes exact.

    Returns:
      ``(dim, comms)``, or ``None`` when the slice is not of that kind (no sharded dimension
      changes size, more than one does, a stride, or sizes that do not divide): then the operand
      is gathered along that dimension as before.
    """
    src, dst = _shape(graph, node.inputs[0]), _shape(graph, node.outputs[0])
    dims = [d for d, ax in enumerate(lead_spec) if ax and src[d] != dst[d]]
    strides = node.params.get("strides") or (1,) * len(src)
    if len(dims) != 1 or strides[dims[0]] != 1:
        return None
    d = dims[0]
    axes = tuple(lead_spec[d])
    n = _axes_size(axes, mesh)
    if src[d] % n or dst[d] % n:
        return None
    out = tuple(ax if i == d or src[i] == dst[i] else () for i, ax in enumerate(lead_spec))
    row = _local_bytes(graph, node.outputs[0], out, mesh) // (dst[d] // n)
    permutes = halo_permutes(src[d], n, node.params["start_indices"][d], dst[d])
    return d, tuple(Comm("collective-permute", permute_axes(axes, mesh.sizes, pairs), r * row)
                    for r, pairs in permutes)


register_follow_rule(*SIZE_PRESERVING, *TOP_K)(_same_size_dims_follow)


@register_follow_rule(*SPLIT)
def _split_follow(node, graph, lead, lead_spec, mesh):
    """``split``: every piece keeps the operand's layout. Along the split axis a piece's columns do
    not line up with the operand's shards: when the split axis is sharded and every piece divides
    it (a fused QKV projection split into q, k, v), the pieces stay split and each is a slice
    whose missing columns the devices exchange (the halo exchange XLA emits:
    :func:`hulkjax.rules.halo.halo_permutes`, piece by piece), otherwise that axis is gathered
    first."""
    axis = node.params["axis"]
    axes = lead_spec[axis]
    n = _axes_size(axes, mesh)
    keep = bool(axes) and all(_shape(graph, o)[axis] % n == 0 for o in node.outputs)
    out = tuple(ax if d != axis or keep else () for d, ax in enumerate(lead_spec))
    comms = []
    if keep:
        whole, start = _shape(graph, node.inputs[0])[axis], 0
        for o in node.outputs:
            size = _shape(graph, o)[axis]
            row = _local_bytes(graph, o, out, mesh) // (size // n)
            comms += [Comm("collective-permute", permute_axes(axes, mesh.sizes, pairs), r * row)
                      for r, pairs in halo_permutes(whole, n, start, size)]
            start += size
    comms = tuple(comms)
    return Resolution((lead_spec if keep else out,), tuple(out for _ in node.outputs), comms,
                      shards=num_shards(out, mesh.sizes))


@register_follow_rule(*STACK)
def _stack_follow(node, graph, lead, lead_spec, mesh):
    """Every operand keeps the lead's layout; the new dimension is whole on every device (its
    entries are the operands)."""
    axis = node.params["axis"]
    out = (*lead_spec[:axis], (), *lead_spec[axis:])
    ins = tuple(None if v is None else tuple(lead_spec) for v in node.inputs)
    return Resolution(ins, (out,), shards=num_shards(out, mesh.sizes))


@register_follow_rule(*UNSTACK)
def _unstack_follow(node, graph, lead, lead_spec, mesh):
    """Every result keeps the operand's layout without ``axis``, which is gathered first when it
    is split (each result is one index of it)."""
    axis = node.params["axis"]
    need = tuple(() if d == axis else ax for d, ax in enumerate(lead_spec))
    out = tuple(ax for d, ax in enumerate(lead_spec) if d != axis)
    return Resolution((need,), tuple(out for _ in node.outputs), shards=num_shards(out, mesh.sizes))


@register_follow_rule(*PASSTHROUGH)
def _passthrough_follow(node, graph, lead, lead_spec, mesh):
    """Results are the operands, one for one: each keeps its own layout. The lead's is known here;
    the others (``None``: no requirement, no layout) keep theirs through the cost model's
    aliases. What work there is (a copy between device and host memory) splits as the lead's
    value: each device handles its shard."""
    ins = tuple(None if v is None else (lead_spec if k == lead else None)
                for k, v in enumerate(node.inputs))
    outs = tuple(lead_spec if k == lead else None for k in range(len(node.outputs)))
    return Resolution(ins, outs, shards=num_shards(lead_spec, mesh.sizes))


def _window_follow(node, graph, lead, lead_spec, mesh):
    """Pooling and its gradient: dims without a window (size 1, stride 1) keep their sharding."""
    window = node.params["window_dimensions"]
    strides = node.params["window_strides"]
    out = tuple(ax if window[d] == 1 and strides[d] == 1 else () for d, ax in enumerate(lead_spec))
    ins = []
    for v in node.inputs:
        if v is None:
            ins.append(None)
        elif len(_shape(graph, v)) == len(out):
            ins.append(out)
        else:
            ins.append(replicated(len(_shape(graph, v))))
    outs = tuple(out if len(_shape(graph, o)) == len(out) else replicated(len(_shape(graph, o)))
                 for o in node.outputs)
    return Resolution(tuple(ins), outs, shards=num_shards(out, mesh.sizes))


register_follow_rule(*POOLING, *WINDOW_GRADIENTS)(_window_follow)


@register_follow_rule(*KERNELS)
def _kernel_follow(node, graph, lead, lead_spec, mesh):
    """A Pallas kernel (:class:`hulkjax.trace.kernels.Kernel`) runs as one piece per device
    along the grid axes it may be split along: a dimension of the lead operand whose block index
    is such an axis keeps its mesh axes (when they divide the grid there), and so does every
    operand and result dimension that axis indexes; the rest is gathered. Operands the axis does
    not index are read whole by every piece (replicated over its mesh axes). Attention kernels
    split by batch and heads, not by the query blocks a causal mask reads. The emitter runs the
    kernel per shard (``jax.shard_map``): XLA's partitioner cannot split a custom call."""
    k = node.kernel
    if k is None or lead >= len(k.operand_axes):
        return replicated_resolution(node, graph)
    keep: dict[int, tuple[str, ...]] = {}
    for d, ax in enumerate(lead_spec):
        g = k.operand_axes[lead][d] if d < len(k.operand_axes[lead]) else None
        if ax and g is not None and g in k.parallel and k.grid[g] % _axes_size(ax, mesh) == 0:
            keep[g] = ax

    def spec(axes):
        return tuple(keep.get(g, ()) if g is not None else () for g in axes)

    ins = tuple(None if v is None else spec(k.operand_axes[i]) for i, v in enumerate(node.inputs))
    shards = math.prod(_axes_size(ax, mesh) for ax in keep.values())
    return Resolution(ins, tuple(spec(a) for a in k.result_axes), shards=shards,
                      label="kernel:" + ",".join(a for ax in keep.values() for a in ax))


# ---- leaders ---------------------------------------------------------------------------------


@register_candidate_rule(P.dot_general_p)
def _dot_general_candidates(node, graph, mesh):
    """Every assignment of each mesh axis to a batch, free or contracting dimension (or none).

    A contracting dimension split over axes leaves partial sums: the result is all-reduced over
    them, or reduce-scattered onto a result dimension.
    """
    lhs, rhs = node.inputs
    ls, rs = _shape(graph, lhs), _shape(graph, rhs)
    os_ = _shape(graph, node.outputs[0])
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    nb = len(lb)
    # options per axis: (lhs dim, rhs dim, out dim, contracting?)
    opts = [None]
    for i in range(nb):
        opts.append((lb[i], rb[i], i, False))
    for j, d in enumerate(lfree):
        opts.append((d, None, nb + j, False))
    for j, d in enumerate(rfree):
        opts.append((None, d, nb + len(lfree) + j, False))
    for i in range(len(lc)):
        opts.append((lc[i], rc[i], None, True))
    return _combine(node, graph, mesh, [ls, rs], os_, opts, per_dim_partials=True)


def _combine(node, graph, mesh, in_shapes, out_shape, opts, *, per_dim_partials=False):
    """Every assignment of each mesh axis to one of ``opts`` (``(lhs dim, rhs dim, out dim,
    contracting?)``, or ``None``), with the all-reduce or reduce-scatter a contraction implies.

    ``per_dim_partials``: contracting dimensions split over different axes are all-reduced one
    dimension at a time, as XLA's partitioner completes a ``dot_general`` (``(B, S, D) x (B, S,
    V)`` contracting ``B`` over ``("data", "fsdp")`` and ``S`` over ``"model"``: an all-reduce
    over ``model`` and one over ``data, fsdp``, each of the whole result; measured on XLA:CPU,
    ``tests/rules/test_dot_partials.py``); otherwise one all-reduce over all their axes."""
    out_cands = []
    seen = set()
    for choice in itertools.product(opts, repeat=len(mesh.axis_names)):
        ins = [[() for _ in s] for s in in_shapes]
        out = [() for _ in out_shape]
        partial: list[str] = []
        partial_by_dim: dict[int, tuple[str, ...]] = {}  # lhs contracting dim -> its axes
        for axis, opt in zip(mesh.axis_names, choice):
            if opt is None:
                continue
            dl, dr, do, contracting = opt
            if dl is not None:
                ins[0][dl] = (*ins[0][dl], axis)
            if dr is not None:
                ins[1][dr] = (*ins[1][dr], axis)
            if contracting:
                partial.append(axis)
                partial_by_dim[dl] = (*partial_by_dim.get(dl, ()), axis)
            else:
                out[do] = (*out[do], axis)
        in_specs = [tuple(s) for s in ins]
        if not all(divides(sh, sp, mesh.sizes) for sh, sp in zip(in_shapes, in_specs)):
            continue
        work = 1
        for axis, opt in zip(mesh.axis_names, choice):
            if opt is not None:
                work *= mesh.sizes[axis]
        out_t = tuple(out)
        # (result layout, collectives, work split, reduce-scattered?)
        variants = [(out_t, (), work, False)]
        if partial:
            ar = Comm("all-reduce", tuple(partial),
                      _local_bytes(graph, node.outputs[0], out_t, mesh))
            if per_dim_partials and len(partial_by_dim) > 1:
                # in the order they run (the last dimension's first), each reading the last
                variants = [(out_t, tuple(Comm("all-reduce", axes, ar.bytes) for _, axes
                                          in sorted(partial_by_dim.items(), reverse=True)),
                             work, False)]
            else:
                variants = [(out_t, (ar,), work, False)]
            free = [axis for axis, opt in zip(mesh.axis_names, choice) if opt is None]
            for d in range(len(out_shape)):  # reduce-scatter onto result dim d
                rs_out = list(out_t)
                rs_out[d] = (*rs_out[d], *partial)
                rs_out = tuple(rs_out)
                if divides(out_shape, rs_out, mesh.sizes):
                    # (partial sums over several dimensions: not measured, one reduce-scatter)
                    comms, more = (scattered_sum(partial, ar.bytes, free, mesh)
                                   if len(partial_by_dim) == 1 else
                                   ((Comm("reduce-scatter", tuple(partial), ar.bytes),), 1))
                    variants.append((rs_out, comms, work * more, True))
        full_ins = []
        it = iter(in_specs)
        for v in node.inputs:
            full_ins.append(None if v is None else next(it, replicated(len(_shape(graph, v)))))
        for out_spec, comms, shards, scatters in variants:
            key = (tuple(full_ins), out_spec, comms)
            if key in seen:
                continue
            seen.add(key)
            outs = (out_spec,) + tuple(replicated(len(_shape(graph, o))) for o in node.outputs[1:])
            out_cands.append(Resolution(tuple(full_ins), outs, comms, shards,
                                        label=_label(mesh, choice, comms, scatters),
                                        scatters=scatters))
    return out_cands


def scattered_sum(partial, nbytes: int, free, mesh: Mesh) -> tuple[tuple[Comm, ...], int]:
    """``(collectives, extra work split)`` of partial sums over ``partial`` reduce-scattered
    onto a result dimension, the operator's ``nbytes`` result block summed, ``free`` the mesh
    axes the operator leaves unused (its operands and result replicated along them).

    Where the unused axes' devices are a multiple of the sum's group, XLA's partitioner uses
    them: each device computes only a ``1 / n`` block of the scattered dimension (``n`` the
    sum's group size), picked by its position along the unused axes, all-reduces that block over
    ``partial``, and a collective-permute (over the unused axes and ``partial``) brings every
    block where the reduce-scattered layout wants it. The operator's work is split ``n`` times
    more. Otherwise it is one reduce-scatter of the block (XLA:CPU: an all-reduce and a local
    slice, :mod:`hulkjax.cost.backends`). Measured on XLA:CPU for ``dot_general`` and
    ``conv_general_dilated`` on 2x2, 4x4, 4x2, 2x4, 8x2, 2x2x2, 2x2x4 and 4x2x2 meshes (those of
    8 devices held in ``tests/rules/test_dot_partials.py``).

    >>> scattered_sum(("model",), 1024, ["data"], Mesh(("data", "model"), (2, 2)))[0]
    (Comm(kind='all-reduce', axes=('model',), bytes=512, deferred=False), \
Comm(kind='collective-permute', axes=('data', 'model'), bytes=512, deferred=False))
    """
    n = math.prod(mesh.sizes[a] for a in partial)
    spare = math.prod(mesh.sizes[a] for a in free)
    if not free or n == 1 or spare % n:
        return (Comm("reduce-scatter", tuple(partial), nbytes),), 1
    block = nbytes // n
    around = tuple(a for a in mesh.axis_names if a in free or a in partial)
    return (Comm("all-reduce", tuple(partial), block),
            Comm("collective-permute", around, block)), n


def _label(mesh, choice, comms, scatters: bool = False) -> str:
    parts = []
    for axis, opt in zip(mesh.axis_names, choice):
        if opt is None:
            continue
        dl, dr, do, contracting = opt
        kind = "K" if contracting else ("B" if dl is not None and dr is not None else
                                        ("L" if dl is not None else "R"))
        parts.append(f"{axis}:{kind}")
    if comms:
        parts.append("rs" if scatters else "ar")
    return ",".join(parts) or "replicated"


@register_candidate_rule(P.conv_general_dilated_p)
def _conv_candidates(node, graph, mesh):
    """Batch, output features, or input features (partial sums); spatial dims stay whole."""
    lhs, rhs = node.inputs
    ls, rs = _shape(graph, lhs), _shape(graph, rhs)
    os_ = _shape(graph, node.outputs[0])
    dn = node.params["dimension_numbers"]
    opts = [None, (dn.lhs_spec[0], None, dn.out_spec[0], False)]
    if node.params.get("batch_group_count", 1) == 1 and node.params.get("feature_group_count", 1) == 1:
        opts.append((None, dn.rhs_spec[0], dn.out_spec[1], False))
        opts.append((dn.lhs_spec[1], dn.rhs_spec[1], None, True))
    return _combine(node, graph, mesh, [ls, rs], os_, opts)


@register_candidate_rule(P.gather_p)
def _gather_candidates(node, graph, mesh):
    """Embedding-style lookups: split the indices' batch dims, the table's kept (offset) dims, or
    the table's indexed dim (masked lookups: partial sums, all-reduced)."""
    table, idx = node.inputs[0], node.inputs[1]
    ts, is_ = _shape(graph, table), _shape(graph, idx)
    os_ = _shape(graph, node.outputs[0])
    dn = node.params["dimension_numbers"]
    if len(node.inputs) != 2:
        return [replicated_resolution(node, graph)]
    slice_sizes = node.params["slice_sizes"]
    offset_src = [d for d in range(len(ts)) if d not in dn.collapsed_slice_dims
                  and d not in dn.operand_batching_dims]
    batch_out = [d for d in range(len(os_)) if d not in dn.offset_dims]
    idx_batch = list(range(len(is_) - 1))  # index_vector_dim is last
    opts = [None]
    # take_along_axis: operand and indices share batching dims, split together.
    for ob, ib in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        opts.append((ob, ib, batch_out[idx_batch.index(ib)], False))
    paired = set(dn.start_indices_batching_dims)
    for src, out in zip(offset_src, sorted(dn.offset_dims)):
        if slice_sizes[src] == ts[src]:
            opts.append((src, None, out, False))
    for i, out in zip(idx_batch, batch_out):
        if i not in paired:
            opts.append((None, i, out, False))
    for d in dn.collapsed_slice_dims:
        if d in dn.start_index_map:
            opts.append((d, None, None, True))
    cands = _combine(node, graph, mesh, [ts, is_], os_, opts)
    # Reduce-scatter variants of masked lookups are not what partitioners emit: keep all-reduce.
    return [c for c in cands if not c.scatters]


@register_candidate_rule(*SCATTERS)
def _scatter_candidates(node, graph, mesh):
    """Embedding gradients and other scatters: split the updates' window dims (the table split the
    same way) or the dims they share with the table (``take_along_axis`` batching dims); for
    combining scatters (add, mul, min, max) also the updates' scatter dims: each device combines
    its updates into a table of partial results, completed by an all-reduce (or reduce-scatter)
    with that combiner. An overwriting ``scatter`` cannot combine partial tables: it never splits
    its scatter dims. Any scatter may split the table along a dimension its indices address, with
    whole updates: each device applies the updates that fall in its rows (a vocab-parallel
    embedding's gradient, the label logit's gradient of a vocab-parallel cross-entropy)."""
    if len(node.inputs) != 3:
        return [replicated_resolution(node, graph)]
    combining = node.primitive in COMBINING_SCATTERS
    operand, idx, upd = node.inputs
    os_, is_, us = _shape(graph, operand), _shape(graph, idx), _shape(graph, upd)
    dn = node.params["dimension_numbers"]
    window_dst = [d for d in range(len(os_)) if d not in dn.inserted_window_dims
                  and d not in dn.operand_batching_dims]
    upd_batch = [d for d in range(len(us)) if d not in dn.update_window_dims]
    out_cands = []
    opts = [None]
    for ud, od in zip(sorted(dn.update_window_dims), window_dst):
        if us[ud] == os_[od]:
            opts.append(("window", ud, od))
    # take_along_axis gradients: operand, indices and updates share batching dims (no partials).
    paired = {}
    for ob, ib in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        paired[ib] = ob
    for j, ud in enumerate(upd_batch):
        if j in paired:
            opts.append(("paired", ud, j, paired[j]))
        elif combining:
            opts.append(("batch", ud, j))
    # The table split along a dimension the indices address (an embedding's rows, the vocabulary
    # of a ``take_along_axis`` gradient): each device applies the updates that land in its rows
    # and drops the rest; no collective (what XLA's partitioner compiles, tests/rules). Not with
    # partial tables over another axis: XLA then reshards the updates with all-to-alls and
    # permutes that the cost model does not predict (BERT's embedding gradient on 2x2x2).
    for od in dn.scatter_dims_to_operand_dims:
        if od in dn.inserted_window_dims:
            opts.append(("indexed", od))
    seen = set()
    for choice in itertools.product(opts, repeat=len(mesh.axis_names)):
        o = [()] * len(os_)
        u = [()] * len(us)
        ix = [()] * len(is_)
        partial = []
        partial_by_dim: dict[int, tuple[str, ...]] = {}  # update dim -> axes it is split over
        for axis, opt in zip(mesh.axis_names, choice):
            if opt is None:
                continue
            if opt[0] == "window":
                o[opt[2]] = (*o[opt[2]], axis)
                u[opt[1]] = (*u[opt[1]], axis)
            elif opt[0] == "indexed":
                o[opt[1]] = (*o[opt[1]], axis)
            elif opt[0] == "paired":
                o[opt[3]] = (*o[opt[3]], axis)
                u[opt[1]] = (*u[opt[1]], axis)
                ix[opt[2]] = (*ix[opt[2]], axis)
            else:
                u[opt[1]] = (*u[opt[1]], axis)
                if opt[2] < len(is_) - 1:
                    ix[opt[2]] = (*ix[opt[2]], axis)
                partial.append(axis)
                partial_by_dim[opt[1]] = (*partial_by_dim.get(opt[1], ()), axis)
        if partial and any(opt is not None and opt[0] == "indexed" for opt in choice):
            continue  # rows kept per device and partial tables elsewhere: XLA exchanges more
        o, u, ix = tuple(o), tuple(u), tuple(ix)
        if not (divides(os_, o, mesh.sizes) and divides(us, u, mesh.sizes)
                and divides(is_, ix, mesh.sizes)):
            continue
        work = num_shards(u, mesh.sizes)
        variants = [(o, ())]
        if partial:
            ar = Comm("all-reduce", tuple(partial), _local_bytes(graph, node.outputs[0], o, mesh))
            # XLA's partitioner completes a scatter split along several update dimensions one
            # dimension at a time: one all-reduce per dimension, over the axes that split it
            # (T5's relative-position bias gradient, split over "fsdp" and "model", compiles to an
            # all-reduce over each, combined with other all-reduces of the same axes). Listed in
            # the order they run, each reading the last: the last update dimension's first.
            variants = [(o, tuple(Comm("all-reduce", axes, ar.bytes)
                                  for _, axes in sorted(partial_by_dim.items(), reverse=True)))]
            for d in range(len(os_)):
                rs = list(o)
                rs[d] = (*rs[d], *partial)
                rs = tuple(rs)
                if divides(os_, rs, mesh.sizes):
                    variants.append((rs, (Comm("reduce-scatter", tuple(partial), ar.bytes),)))
        for out_spec, comms in variants:
            key = (o, u, ix, out_spec, comms)
            if key in seen:
                continue
            seen.add(key)
            out_cands.append(Resolution((o, ix, u), (out_spec,), comms, work,
                                        label=f"scatter{len(out_cands)}",
                                        scatters=out_spec != o))
    return out_cands


def candidate_specs(shape: Sequence[int], mesh: Mesh, *,
                    max_axes_per_dim: int | None = None) -> list[Spec]:
    """Layouts for a graph input: each mesh axis on one dimension (or none), dividing evenly; the
    axes on one dimension in mesh order. Every layout a baseline writes is among them."""
    rank = len(shape)
    out = []
    seen = set()
    for choice in itertools.product([None, *range(rank)], repeat=len(mesh.axis_names)):
        spec = [()] * rank
        for axis, d in zip(mesh.axis_names, choice):
            if d is not None:
                spec[d] = (*spec[d], axis)
        spec = tuple(spec)
        if max_axes_per_dim is not None and any(len(a) > max_axes_per_dim for a in spec):
            continue
        if divides(shape, spec, mesh.sizes) and spec not in seen:
            seen.add(spec)
            out.append(spec)
    return out

