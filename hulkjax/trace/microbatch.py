"""Which values of a traced step depend on the batch, and how: what a staged plan may microbatch.

Where this sits::

    OpGraph (batch B) + OpGraph (batch B/k, same step)  ->  BatchSplit  ->  strategies.stages (plans)
                                                                      ->  emit.mpmd (runs them)

A staged plan runs the batch-dependent part of the step once per microbatch and the rest (the
optimizer update) once per step, on the microbatches' values combined. This module finds that
boundary from the data flow, by comparing the step traced at the full batch ``B`` with the same step
traced at ``B / k`` (:func:`microbatch_graph`): a dimension whose size differs is a batch dimension,
and a literal whose value differs depends on the batch size (the ``1 / B`` of a mean). Every value
gets a :class:`Flow`:

* ``"ind"``: independent of the batch's contents (parameters, optimizer state, constants, masks);
* ``"ex"``: per example along one dimension ``dim`` (activations and their gradients): each slice
  along ``dim`` depends on one example only;
* ``"red"``: an aggregate over the batch (a sum over ``dim``: weight gradients, summed losses) and
  everything computed from aggregates.

and an *exponent* ``e``: the value is ``B ** e`` times a sum over examples (``e = -1`` for a mean:
the literal ``B`` of ``jnp.mean`` or the ``1 / B`` that starts the backward pass of a mean loss).
Nodes reading per-example values run per microbatch; the aggregates they produce are the
*boundary*: the microbatches' values combine to the full batch's exactly, ``M ** e`` times their
sum (``e = -1``: their mean), and per-example results are concatenated. Everything reading
aggregates (the optimizer) then runs once, as in the unsharded step.

**What cannot be microbatched exactly** (:attr:`BatchSplit.problems` says which operator and why):
an aggregate that flows back into per-example computation (batch statistics: BatchNorm, a loss
normalized by a data-dependent count such as ``sum(weights)``; an aggregate of the data alone can
be computed outside the step and passed in, as its message says); reductions over the batch that
are not sums (``max``, a product, a sort or cumulative sum along the batch); a batch-size constant
that is not a power of the batch size (``B - 1``); random numbers or ``iota`` that vary along the
batch dimension (dropout masks would differ by microbatch); examples paired with other examples
(CLIP's in-batch similarities); a gather or scatter that moves rows across examples; a step whose
structure depends on the batch size. Staged plans of such steps use one microbatch. An ``iota``
along the batch that only indexes each example's own row (``x[jnp.arange(B), idx]``: a gather
or scatter whose index column for the batch dimension is that position) is per example: each
microbatch indexes its own rows.

>>> import jax, jax.numpy as jnp
>>> import hulkjax as hj
>>> def step(w, x):
...     loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
...     return w - 0.1 * g, loss
>>> g = hj.trace(step, jnp.ones((4, 4)), jnp.ones((8, 4)))
>>> split = analyze(g, microbatch_graph(g, 2))
>>> split.exact, sorted({c.kind for c in split.boundary.values()})
(True, ['sum'])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np
from jax.extend.core import primitives as P

from hulkjax.errors import UnsupportedStepError
from hulkjax.trace.graph import DATA, OpGraph
from hulkjax.trace.interpret import literal_operands
from hulkjax.trace.primitives import (
    CASTS,
    CUMULATIVE,
    ELEMENTWISE,
    LOOPS,
    POOLING,
    WINDOW_GRADIENTS,
)
from hulkjax.trace.walk import struct_of

IND, EX, RED = "ind", "ex", "red"


@dataclass(frozen=True)
class Flow:
    """How a value depends on the batch.

    Attributes:
      kind: ``"ind"`` (independent of the batch's contents), ``"ex"`` (per example along ``dim``)
        or ``"red"`` (an aggregate over the batch, or computed from one).  # str
      dim: the batch dimension of a per-example value (``None`` otherwise).  # int | None
      exp: the value is ``B ** exp`` times a function of the examples; ``None`` when it is not
        (then it cannot be combined across microbatches).  # int | None
      zero: an independent value known to be all zeros (gradient accumulators start so).  # bool
      varies: an independent value that differs along a batch-sized dimension (``iota`` along the
        batch, random bits): per-example computation reading it differs by microbatch.  # bool
      position: of a varying value, the dimension along which it is each example's position in
        the batch (``jnp.arange(B)``; ``None`` otherwise).  # int | None
      position_column: of a per-example index array, ``(axis, column)`` where the column along
        ``axis`` is each example's position (``x[jnp.arange(B), idx]`` stacks the two index
        columns): a gather or scatter through it reads or writes each example's own row.
        # tuple | None
    """

    kind: str
    dim: int | None = None
    exp: int | None = 0
    zero: bool = False
    varies: bool = False
    position: int | None = None
    position_column: tuple[int, int] | None = None


@dataclass(frozen=True)
class Combine:
    """How the microbatches' values of one boundary value make the full batch's.

    Attributes:
      kind: ``"sum"`` (aggregates: ``scale`` times the sum), ``"concat"`` (per-example results,
        concatenated along ``dim``, times ``scale``) or ``"same"`` (independent values: any
        microbatch's).  # str
      exp: the batch-size exponent; ``scale = M ** exp`` for ``M`` microbatches.  # int
      dim: the concatenation dimension (``"concat"``).  # int | None
    """

    kind: str
    exp: int = 0
    dim: int | None = None

    def scale(self, microbatches: int) -> float:
        """``microbatches ** exp``."""
        return float(microbatches) ** self.exp


@dataclass
class BatchSplit:
    """The per-microbatch part of a step, its boundary, and why it may not be exact.

    Attributes:
      batch: the batch size ``B`` (dimension 0 of the data arguments).  # int
      flows: a :class:`Flow` per value id of the full-batch graph.  # list
      per_microbatch: ids of the nodes that run once per microbatch.  # frozenset of int
      boundary: ``{value id: Combine}``: values the per-microbatch part hands to the rest of the
        step or returns.  # dict
      split_inputs: indices of the graph inputs split into microbatches (dim 0).  # tuple
      problems: why microbatching would not reproduce the step exactly (empty: it does).  # list
    """

    batch: int
    flows: list[Flow]
    per_microbatch: frozenset[int]
    boundary: dict[int, Combine]
    split_inputs: tuple[int, ...]
    problems: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Whether equal microbatches reproduce the full-batch step exactly."""
        return not self.problems


# ---- the batch and the microbatch trace ------------------------------------------------------

def batch_size(graph: OpGraph) -> int | None:
    """The batch size: the leading dimension shared by most data arguments (ties: the larger),
    or ``None`` when the step has no data argument with a dimension.

    >>> import jax.numpy as jnp, hulkjax as hj
    >>> batch_size(hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4))))
    8
    """
    counts: dict[int, int] = {}
    for vid, role in zip(graph.inputs, graph.input_roles):
        shape = graph.values[vid].shape
        if role == DATA and shape:
            counts[shape[0]] = counts.get(shape[0], 0) + 1
    if not counts:
        return None
    return max(counts, key=lambda b: (counts[b], b))


def split_inputs(graph: OpGraph) -> tuple[int, ...]:
    """Indices of the data arguments whose dimension 0 is the batch (what microbatching splits)."""
    b = batch_size(graph)
    return tuple(i for i, (vid, role) in enumerate(zip(graph.inputs, graph.input_roles))
                 if role == DATA and graph.values[vid].shape[:1] == (b,))


def microbatch_graph(graph: OpGraph, microbatches: int) -> OpGraph:
    """The same step traced with the batch cut into ``microbatches`` (cached on the graph).

    Raises:
      UnsupportedStepError: the graph has no traced function (``graph.fn``), no batch, or a batch
        that ``microbatches`` does not divide.
    """
    from hulkjax.trace.tracer import trace

    cache = graph.memo.setdefault("microbatch_graphs", {})
    if microbatches in cache:
        return cache[microbatches]
    b = batch_size(graph)
    if graph.fn is None or b is None or b % microbatches:
        raise UnsupportedStepError(
            f"cannot cut this step's batch into {microbatches} microbatches: "
            f"{'it was not traced from a function' if graph.fn is None else f'batch size {b}'}. "
            f"Use a batch size divisible by the number of microbatches.")
    split = set(split_inputs(graph))
    leaves = []
    for i, _vid in enumerate(graph.inputs):
        aval = graph.jaxpr.in_avals[i]
        shape = tuple(aval.shape)
        if i in split:
            shape = (shape[0] // microbatches,) + shape[1:]
        # (weak_type kept: a weakly typed argument, say jnp.full(..., 0.1), traced as a strong
        # one would add or drop casts, and the two traces would differ in structure; so is
        # the memory space)
        leaves.append(struct_of(aval, shape))
    args = jax.tree_util.tree_unflatten(graph.in_tree, leaves)
    micro = trace(graph.fn, *args)
    cache[microbatches] = micro
    return micro


def planning_graph(graph: OpGraph, microbatches: int) -> OpGraph:
    """The step at ``1 / microbatches`` of the batch, for planning: :func:`microbatch_graph`'s
    graph, derived without tracing where that is exact (cached on the graph).

    Tracing a step again per microbatch count was the staged search's largest cost. The graph at
    the partition's microbatch count ``k`` (traced once for the batch analysis) and the full graph
    say which sizes scale with the batch: every shape dimension and integer parameter that differs
    between the two is ``k`` times larger at the full batch, and is divided by ``microbatches``
    here (:func:`scaled_graph`); FLOPs and bytes are recomputed from the new shapes as the tracer
    computes them. Where that reading does not hold (a size not proportional to the batch, a
    parameter of another kind that changes, a loop whose body changes, FLOPs or bytes the tracer's
    formulas do not reproduce at both batch sizes), and for microbatches of one example (size-1
    dimensions may trace to other operators), the step is traced. The result has no ``jaxpr``:
    emission traces (:func:`microbatch_graph`). ``tests/trace/test_microbatch.py`` holds derived
    graphs equal to traced ones on the zoo's models.
    """
    cache = graph.memo.setdefault("planning_graphs", {})
    hit = cache.get(microbatches)
    if hit is not None:
        return hit
    traced = graph.memo.get("microbatch_graphs", {})
    b = batch_size(graph)
    out = traced.get(microbatches)
    if out is None and b is not None and graph.fn is not None and b % microbatches == 0 \
            and b // microbatches >= 2:
        k = next((d for d in sorted(traced) if d != microbatches and d > 1 and b % d == 0), None)
        if k is not None:
            out = scaled_graph(graph, traced[k], k, microbatches)
    if out is None:
        out = microbatch_graph(graph, microbatches)
    cache[microbatches] = out
    return out


def broadcast_to_the_batch(graph: OpGraph):
    """A ``broadcast_in_dim`` of ``graph`` that stretches a dimension of size 1 to the batch's
    size (transformers' causal masks: ``jnp.broadcast_to(mask, (batch,) + mask.shape[1:])``),
    or ``None``; read off a graph of the step traced at a microbatch (the partition's), where
    the stretched dimension has the microbatch's size (``None`` until there is one).

    ``jnp.broadcast_to`` returns its operand where the shapes are equal, so at a microbatch of
    one example such a step traces to other operators, and its per-node plans do not apply
    there (a step that calls ``lax.broadcast_in_dim`` itself keeps the operator, and the staged
    search then leaves out a count it could have used). Tracing the step to find that out cost
    the staged search as much as a trace (2 s for an 8B LLaMA). ``benchmarks/UNSEEN.md``
    counts, of its third-party models, those that trace to other operators at one example and
    those this finds."""
    hit = graph.memo.get("broadcast to the batch", False)
    if hit is not False:
        return hit
    b = batch_size(graph)
    for k, m in sorted(graph.memo.get("microbatch_graphs", {}).items()):
        if b is None or k < 2 or len(m.nodes) != len(graph.nodes):
            continue
        found = None
        for n, c in zip(graph.nodes, m.nodes):
            if n.name != "broadcast_in_dim" or n.inputs[0] is None or c.name != n.name:
                continue
            src, out, mout = (graph.values[n.inputs[0]].shape, graph.values[n.outputs[0]].shape,
                              m.values[c.outputs[0]].shape)
            if len(out) == len(mout) and any(
                    src[i] == 1 and out[d] == b and mout[d] == b // k
                    for i, d in enumerate(n.params["broadcast_dimensions"])):
                found = n
                break
        graph.memo["broadcast to the batch"] = found
        return found
    return None


class _NotScalable(Exception):
    pass


def scaled_graph(graph: OpGraph, micro: OpGraph, k: int, microbatches: int) -> OpGraph | None:
    """``graph`` (batch ``B``) with its batch-proportional sizes divided by ``microbatches``,
    read off ``micro`` (the same step traced at ``B / k``); ``None`` where that is not exact (see
    :func:`planning_graph`)."""
    try:
        return _Scaler(graph, micro, k, microbatches).run()
    except _NotScalable:
        return None


class _Scaler:
    def __init__(self, g: OpGraph, m: OpGraph, k: int, M: int):
        self.g, self.m, self.k, self.M = g, m, k, M
        # What the checks of _flops and _bytes read of the two traced graphs alone (not of M):
        # kept with ``g`` per micro trace, so every count scaled from one trace checks each node
        # once. ``nbytes``: each value's bytes in g and in m; ``checks``: node id -> whether the
        # tracer's FLOPs formula reproduces both traced FLOPs, and the literals' bytes (None
        # where the two traces disagree on them); ``kept``: the nodes ``run`` keeps as they are
        # in g (nothing of them differs between the traces: so at every M).
        key = ("scaler checks", id(m), k)
        hit = g.memo.get(key)
        if hit is None or hit[0] is not m:
            hit = g.memo[key] = (m, [v.nbytes for v in g.values], [v.nbytes for v in m.values],
                                 {}, {}, set())
        _, self.g_nbytes, self.m_nbytes, self.flops_ok, self.rest, self.kept = hit

    def size(self, full, micro):
        if full == micro:
            return full
        if type(full) is not type(micro) or isinstance(full, bool) or not isinstance(full, int) \
                or full != self.k * micro or full % self.M:
            raise _NotScalable
        return type(full)(full // self.M)

    def shape(self, full: tuple, micro: tuple) -> tuple:
        if full == micro:
            return full
        if len(full) != len(micro):
            raise _NotScalable
        return tuple(self.size(a, c) for a, c in zip(full, micro))

    def param(self, full, micro):
        if full is micro:
            return full
        if isinstance(full, int) and not isinstance(full, bool):
            return self.size(full, micro)
        if isinstance(full, tuple) and type(full) is type(micro) and len(full) == len(micro):
            items = [self.param(a, c) for a, c in zip(full, micro)]
            if all(a is b for a, b in zip(items, full)):
                return full
            return type(full)(*items) if hasattr(full, "_fields") else type(full)(items)
        try:
            same = bool(full == micro)
        except Exception:  # noqa: BLE001 - arrays, objects without a plain equality
            same = False
        if not same or repr(full) != repr(micro):
            raise _NotScalable
        return full

    def run(self) -> OpGraph:
        from hulkjax.trace.flops import flops_of
        from hulkjax.trace.graph import Node, Value

        g, m = self.g, self.m
        if len(g.nodes) != len(m.nodes) or len(g.values) != len(m.values) \
                or g.inputs != m.inputs or g.outputs != m.outputs \
                or g.input_roles != m.input_roles or g.constants != m.constants:
            raise _NotScalable
        values = []
        for a, c in zip(g.values, m.values):
            if a.dtype != c.dtype or a.producer != c.producer or a.index != c.index:
                raise _NotScalable
            shape = self.shape(a.shape, c.shape)
            values.append(a if shape is a.shape else
                          Value(a.id, shape, a.dtype, a.producer, a.index, a.name, a.host))
        # The scaled values' bytes (a value left as it was keeps its bytes in g).
        self.nbytes = [nb if v is gv else v.nbytes
                       for v, gv, nb in zip(values, g.values, self.g_nbytes)]
        nodes = []
        kept = self.kept
        for a, c in zip(g.nodes, m.nodes):
            if a.id in kept:
                nodes.append(a)
                continue
            if a.primitive is not c.primitive or a.inputs != c.inputs or a.outputs != c.outputs \
                    or a.layer != c.layer or a.backward != c.backward:
                raise _NotScalable
            changed = any(values[v] is not g.values[v] for v in (*a.inputs, *a.outputs)
                          if v is not None)
            if a.subgraphs or c.subgraphs:
                # A loop is kept only where nothing of it depends on the batch.
                if changed or a.trip_count != c.trip_count or len(a.subgraphs) != \
                        len(c.subgraphs) or any(x.fingerprint() != y.fingerprint()
                                                for x, y in zip(a.subgraphs, c.subgraphs)):
                    raise _NotScalable
                nodes.append(a)
                kept.add(a.id)
                continue
            if a.params.keys() != c.params.keys():
                raise _NotScalable
            params = {key: self.param(val, c.params[key]) for key, val in a.params.items()}
            if all(params[key] is a.params[key] for key in params) and not changed:
                nodes.append(a)
                kept.add(a.id)
                continue
            flops = self._flops(flops_of, a, c, values, params)
            nbytes = self._bytes(a, c, values)
            nodes.append(Node(id=a.id, primitive=a.primitive, params=params, inputs=a.inputs,
                              outputs=a.outputs, flops=flops, bytes=nbytes, layer=a.layer,
                              backward=a.backward, traceback=a.traceback))
        out = OpGraph(nodes=nodes, values=values, inputs=g.inputs, outputs=g.outputs,
                      input_paths=g.input_paths, output_paths=g.output_paths, in_tree=m.in_tree,
                      out_tree=m.out_tree, jaxpr=None, constants=g.constants,
                      input_roles=m.input_roles)
        out.carried = dict(m.carried)
        out.owners = dict(m.owners)
        out.fn = g.fn
        return out

    @staticmethod
    def _shapes(node, values):
        return ([() if v is None else values[v].shape for v in node.inputs],
                [values[o].shape for o in node.outputs])

    def _flops(self, flops_of, a, c, values, params) -> float:
        """FLOPs at the new shapes, by the tracer's formula, which must give the traced FLOPs at
        both traced batch sizes (literal operands are taken as scalars)."""
        ok = self.flops_ok.get(a.id)
        if ok is None:  # a function of the two traces alone: the same for every M
            ok = self.flops_ok[a.id] = all(
                flops_of(node.primitive, *self._shapes(node, vals), node.params) == node.flops
                for node, vals in ((a, self.g.values), (c, self.m.values)))
        if not ok:
            raise _NotScalable
        return flops_of(a.primitive, *self._shapes(a, values), params)

    def _bytes(self, a, c, values) -> float:
        """Bytes at the new shapes: the traced bytes less the values' (what remains is the
        literals', the same at every batch size, or this is no exact rescaling)."""
        def sized(node, nbytes):  # (integer sums: exact in any order)
            return sum(nbytes[v] for v in (*node.inputs, *node.outputs) if v is not None)

        if a.id in self.rest:  # a function of the two traces alone: the same for every M
            rest = self.rest[a.id]
        else:
            rest = a.bytes - sized(a, self.g_nbytes)
            if rest != c.bytes - sized(c, self.m_nbytes) or rest < 0:
                rest = None
            self.rest[a.id] = rest
        if rest is None:
            raise _NotScalable
        return float(rest + sized(a, self.nbytes))


# ---- the analysis ------------------------------------------------------------------------------

def analyze(graph: OpGraph, micro: OpGraph) -> BatchSplit:
    """Compare the full-batch graph with a microbatch graph of the same step (see the module doc).

    The analysis is exact for any number of microbatches dividing the batch: it depends only on
    which dimensions and constants scale with the batch size.
    """
    b = batch_size(graph)
    problems: list[str] = []
    if b is None:
        return BatchSplit(batch=0, flows=[Flow(IND)] * len(graph.values),
                          per_microbatch=frozenset(), boundary={}, split_inputs=(),
                          problems=["the step has no data argument with a batch dimension"])
    bm = batch_size(micro)
    k = b // bm if bm else 0
    if not bm or k < 2 or b != k * bm:
        raise UnsupportedStepError(f"the microbatch graph's batch {bm} does not divide {b} "
                                   f"into two or more microbatches")
    flows = [Flow(IND)] * len(graph.values)
    split = split_inputs(graph)
    for i in split:
        flows[graph.inputs[i]] = Flow(EX, dim=0)
    mismatch = structure_mismatch(graph, micro)
    if mismatch:
        problems.append(mismatch)
        return BatchSplit(batch=b, flows=flows, per_microbatch=frozenset(), boundary={},
                          split_inputs=split, problems=problems)
    _Analysis(graph, micro, k, flows, problems).run()
    per_micro = _per_microbatch(graph, flows)
    boundary = _boundary(graph, flows, per_micro, problems)
    return BatchSplit(batch=b, flows=flows, per_microbatch=frozenset(per_micro),
                      boundary=boundary, split_inputs=split, problems=list(dict.fromkeys(problems)))


def sum_over_examples(graph: OpGraph, node, flows: list[Flow]) -> dict[int, int] | None:
    """``{operand index: batch dimension}`` of the operands of ``node`` that are read example
    by example, where its result is a sum of per-example terms, each reading one example (one
    slice along that dimension) of each of those operands and the others whole; ``None`` for
    every other node. ``flows`` are :func:`analyze`'s, for ``graph``'s values.

    Such a node run on any cut of the batch (the same examples of each of those operands in
    each piece, the other operands whole) gives partial results that add up to its result:
    what lets a staged plan accumulate a weight gradient's per-device partial sums over the
    microbatches and reduce them once per step (:mod:`hulkjax.cost.unreduced`). Which operators
    qualify is read from what they are:

    * ``reduce_sum`` over the batch dimension;
    * ``dot_general`` contracting the batch dimensions of two per-example operands with each
      other (a weight gradient ``x^T dy``);
    * ``scatter-add`` of per-example updates into zeros, their batch dimension a scatter
      dimension, at indices cut along the matching dimension (per-example token ids: an
      embedding's gradient; or indices independent of the data with a dimension of the batch's
      size there: the positions of a position embedding's gradient);
    * ``conv_general_dilated`` contracting the batch dimensions of two per-example operands (a
      kernel's gradient), without feature or batch groups (a group would cut the batch).

    Loops are not: their bodies are traced at the microbatch's shapes and run as one operator.

    >>> import jax.numpy as jnp, hulkjax as hj
    >>> g = hj.trace(lambda w, x: jnp.sum(x @ w), jnp.ones((4, 4)), jnp.ones((8, 4)))
    >>> split = analyze(g, microbatch_graph(g, 2))
    >>> [(n.name, sum_over_examples(g, n, split.flows)) for n in g.nodes]
    [('dot_general', None), ('reduce_sum', {0: 0})]
    """
    if len(node.outputs) != 1 or flows[node.outputs[0]].kind != RED \
            or flows[node.outputs[0]].exp is None:
        return None
    ins = [None if v is None else flows[v] for v in node.inputs]
    if any(f is None or f.kind == RED for f in ins):
        return None
    ex = {k: f.dim for k, f in enumerate(ins) if f.kind == EX}
    prim, params = node.primitive, node.params
    if prim is P.reduce_sum_p:
        return ex if len(ex) == 1 and ex.get(0) in tuple(params["axes"]) else None
    if prim is P.dot_general_p:
        (lc, rc), _ = params["dimension_numbers"]
        if set(ex) != {0, 1} or ex[0] not in lc or ex[1] not in rc \
                or list(lc).index(ex[0]) != list(rc).index(ex[1]):
            return None
        return ex
    if node.name in ("scatter-add", "scatter_add"):
        dn = params["dimension_numbers"]
        if ins[0].kind != IND or not ins[0].zero or set(ex) - {1, 2} or 2 not in ex \
                or dn.operand_batching_dims:
            return None
        upd = graph.values[node.inputs[2]].shape
        scattered = [d for d in range(len(upd)) if d not in dn.update_window_dims]
        if ex[2] not in scattered:
            return None
        d = scattered.index(ex[2])  # the indices' dimensions in order (the last: the index)
        if ex.get(1, d) != d or graph.values[node.inputs[1]].shape[d] != upd[ex[2]]:
            return None
        return {1: d, 2: ex[2]}
    if prim is P.conv_general_dilated_p:
        dn = params["dimension_numbers"]
        if set(ex) != {0, 1} or ex[0] != dn.lhs_spec[1] or ex[1] != dn.rhs_spec[1] \
                or params.get("feature_group_count", 1) != 1 \
                or params.get("batch_group_count", 1) != 1:
            return None
        return ex
    return None


def structure_mismatch(g: OpGraph, m: OpGraph) -> str:
    """Why ``m`` (the step traced at another batch size) is not ``g``'s operators on other
    shapes, or ``""`` where it is (the same operators, reading and making the same values)."""
    if len(g.nodes) != len(m.nodes) or len(g.values) != len(m.values):
        return (f"the step's structure depends on the batch size ({len(g.nodes)} operators at the "
                f"full batch, {len(m.nodes)} at a microbatch)")
    for a, c in zip(g.nodes, m.nodes):
        if a.primitive is not c.primitive or a.inputs != c.inputs or a.outputs != c.outputs:
            return (f"the step's structure depends on the batch size (operator {a.id}: {a.name} "
                    f"at the full batch, {c.name} at a microbatch)")
    return ""


def _per_microbatch(g: OpGraph, flows: list[Flow]) -> set[int]:
    """Nodes reading per-example values, and the independent nodes they need."""
    per = set()
    for n in g.nodes:
        if any(v is not None and flows[v].kind == EX for v in n.inputs):
            per.add(n.id)
    # Independent helpers of per-microbatch nodes run with them (masks, casts of parameters).
    for n in reversed(g.nodes):
        if n.id in per:
            continue
        if all(flows[o].kind == IND for o in n.outputs) and any(
                c in per for o in n.outputs for c, _ in g.consumers(o)):
            per.add(n.id)
    return per


def _boundary(g: OpGraph, flows, per: set[int], problems: list[str]) -> dict[int, Combine]:
    outputs = {v for v in g.outputs if v is not None}
    out: dict[int, Combine] = {}
    for nid in sorted(per):
        n = g.nodes[nid]
        for o in n.outputs:
            used_later = o in outputs or any(c not in per for c, _ in g.consumers(o))
            if not used_later:
                continue
            f = flows[o]
            if f.exp is None:
                problems.append(f"{_where(n)}: its result is handed to the optimizer or returned, "
                                f"but it is not a power of the batch size times a sum over "
                                f"examples, so microbatches cannot be combined into it")
                continue
            if f.position_column is not None:
                problems.append(f"{_where(n)}: its result (holding the examples' positions in "
                                f"the batch, which differ by microbatch) is returned")
                continue
            if f.kind == RED:
                out[o] = Combine("sum", f.exp)
            elif f.kind == EX:
                out[o] = Combine("concat", f.exp, f.dim)
            else:
                if f.exp != 0:
                    problems.append(f"{_where(n)}: a constant that depends on the batch size is "
                                    f"used once per step")
                out[o] = Combine("same", 0)
    return out


def _where(node) -> str:
    return f"operator {node.id} ({node.name}, {node.source})"


class _Analysis:
    """Forward propagation of flows over one graph (recursing into loop bodies)."""

    def __init__(self, g: OpGraph, m: OpGraph, k: int, flows: list[Flow], problems: list[str]):
        self.g, self.m, self.k = g, m, k
        self.flows = flows
        self.problems = problems
        self.literals = literal_operands(g.jaxpr)
        self.micro_literals = literal_operands(m.jaxpr)
        self._const_exps()

    def problem(self, node, why: str) -> None:
        self.problems.append(f"{_where(node)}: {why}")

    def data_only(self) -> list[bool]:
        """Per value id of ``g``: whether it is computed from the batch's data and constants
        alone (no parameter or optimizer state; inside a loop body, from nothing the body takes).
        Made on first use."""
        only = getattr(self, "_data_only", None)
        if only is None:
            g = self.g
            only = [False] * len(g.values)
            for v in g.constants:
                only[v] = True
            for v, role in zip(g.inputs, g.input_roles):
                only[v] = role == DATA
            for n in g.nodes:
                ok = all(v is None or only[v] for v in n.inputs)
                for o in n.outputs:
                    if o is not None:
                        only[o] = ok
            self._data_only = only
        return only

    # ---- batch dimensions and constants -----------------------------------------------------
    def diff_dims(self, vid: int) -> list[int]:
        a, c = self.g.values[vid].shape, self.m.values[vid].shape
        return [i for i, (x, y) in enumerate(zip(a, c)) if x != y]

    def exponent(self, full, micro) -> int | None:
        """``e`` with ``full = k ** e * micro`` (0 for equal values), else ``None``."""
        try:
            a = np.asarray(full, dtype=np.float64)
            c = np.asarray(micro, dtype=np.float64)
        except (TypeError, ValueError):
            return 0 if np.array_equal(np.asarray(full), np.asarray(micro)) else None
        if a.shape != c.shape:
            return None
        if np.array_equal(a, c):
            return 0
        for e in (1, -1, 2, -2):
            if np.allclose(a, c * float(self.k) ** e, rtol=1e-6, atol=0):
                return e
        return None

    def _const_exps(self) -> None:
        g, m = self.g, self.m
        for cv, _mv, val, mval in zip(g.constants, m.constants, _consts(g), _consts(m)):
            e = self.exponent(val, mval) if val is not None and mval is not None else 0
            self.flows[cv] = Flow(IND, exp=e, zero=_is_zero(val))

    def operand_flow(self, node, k: int) -> Flow:
        v = node.inputs[k]
        if v is not None:
            return self.flows[v]
        full = self.literals.get((node.id, k))
        micro = self.micro_literals.get((node.id, k))
        return Flow(IND, exp=self.exponent(full, micro), zero=_is_zero(full))

    # ---- the walk -------------------------------------------------------------------------------
    def run(self) -> None:
        # Values downstream of a reported problem: an aggregate made from them that flows back
        # into per-example computation is that problem again, not another one to report.
        self.tainted: set[int] = set()
        for node in self.g.nodes:
            ins = [self.operand_flow(node, k) for k in range(len(node.inputs))]
            before = len(self.problems)
            outs = self.transfer(node, ins)
            for o, f in zip(node.outputs, outs):
                self.flows[o] = f
            if len(self.problems) > before or any(v in self.tainted for v in node.inputs):
                self.tainted.update(o for o in node.outputs if o is not None)

    def transfer(self, node, ins: list[Flow]) -> list[Flow]:
        kinds = {f.kind for f in ins}
        n_out = len(node.outputs)
        if any(f.position_column is not None for k, f in enumerate(ins)
               if not (k == 1 and node.name in _INDEXED)):
            # The positions are each microbatch's own (0 .. B / M - 1): only a gather or scatter
            # through them (checked there) reads the same rows at every size; a loop's body
            # would see them as plain per-example values.
            self.problem(node, f"{node.name} reads the examples' positions in the batch (an "
                               f"iota along the batch) as data: they differ by microbatch")
            return [Flow(EX, exp=None)] * n_out
        if node.primitive in LOOPS:
            return self.loop(node, ins)
        if EX in kinds and RED in kinds:
            if any(v in self.tainted for v in node.inputs):
                pass  # a consequence of a problem already reported
            elif all(self.data_only()[v] for v, f in zip(node.inputs, ins) if f.kind == RED and v is not None):
                self.problem(node, "an aggregate of the batch's data alone (a count such as "
                                   "sum(weights) or the number of valid tokens that normalizes "
                                   "the loss, a mean of the inputs) flows back into "
                                   "per-example computation, so each microbatch would use its "
                                   "own. Compute it outside the step and pass it in (e.g. a "
                                   "scalar in the batch): every microbatch then uses the full "
                                   "batch's")
            else:
                self.problem(node, "an aggregate over the batch that depends on the parameters "
                                   "(a batch statistic, such as BatchNorm's mean and variance) "
                                   "flows back into per-example computation, so each microbatch "
                                   "would use its own")
            return [Flow(RED, exp=None)] * n_out
        if RED in kinds:
            return [Flow(RED, exp=self.red_exp(node, ins))] * n_out
        if EX in kinds:
            stacked = self.index_columns(node, ins)
            if stacked is not None:
                return stacked
            for f in ins:
                if f.kind == IND and f.varies:
                    self.problem(node, "per-example computation reads values that vary along "
                                       "the batch dimension without depending on the data "
                                       "(random numbers such as dropout masks, or an iota): "
                                       "microbatches would draw other ones")
            return self.example(node, ins)
        return self.independent(node, ins)

    # ---- independent values ---------------------------------------------------------------------
    def independent(self, node, ins: list[Flow]) -> list[Flow]:
        prim = node.primitive
        e = _arith_exp(prim, node, ins)
        varies = any(f.varies for f in ins)
        outs = []
        for o in node.outputs:
            dd = self.diff_dims(o)
            v = varies and bool(dd)
            if dd and node.name in _VARYING_SOURCES:
                if node.name != "iota" or node.params.get("dimension") in dd:
                    v = True
            if prim is P.broadcast_in_dim_p and ins and ins[0].varies:
                src = node.inputs[0]
                v = src is not None and bool(self.diff_dims(src))
            zero = bool(ins) and prim in _ZERO_PRESERVING and ins[0].zero
            if prim is P.mul_p:
                zero = any(f.zero for f in ins)
            pos = self.position(node, ins, dd) if v else None
            if pos is not None and node.name == "select_n":
                e = ins[1].exp  # x itself (the wrapped x + n is never selected)
            outs.append(Flow(IND, exp=e, zero=zero, varies=v, position=pos))
        return outs

    def position(self, node, ins: list[Flow], dd: list[int]) -> int | None:
        """The dimension along which ``node``'s (varying) result is each example's position in
        the batch: an ``iota`` along the batch, carried through broadcasts and casts, and
        through the negative-index fix-up ``jnp`` indexing applies (``select_n(x < 0, x,
        x + n)``, which keeps ``x``: a position is never negative)."""
        name = node.name
        if name == "iota":
            d = node.params.get("dimension")
            return d if dd == [d] else None
        if name == "select_n":
            src = ins[1].position if len(ins) == 3 and self._keeps_position(node) else None
            return src if src is not None and dd == [src] else None
        src = ins[0].position if ins else None
        if src is None:
            return None
        if name == "broadcast_in_dim":
            d = node.params["broadcast_dimensions"][src]
            return d if dd == [d] else None
        if name in ("convert_element_type", "copy", "copy_p"):
            return src if dd == [src] else None
        return None

    def _keeps_position(self, node) -> bool:
        """``select_n(x < 0, x, x + n)``: ``x`` wherever ``x`` is not negative."""
        g = self.g
        pred, x, wrapped = node.inputs
        if pred is None or x is None or wrapped is None:
            return False
        lt, add = g.values[pred].producer, g.values[wrapped].producer
        if lt is None or add is None:
            return False
        lt, add = g.nodes[lt], g.nodes[add]
        zero = self.literals.get((lt.id, 1))
        return lt.name == "lt" and lt.inputs[0] == x and lt.inputs[1] is None and \
            zero is not None and _is_zero(zero) and add.name == "add" and x in add.inputs

    def index_columns(self, node, ins: list[Flow]) -> list[Flow] | None:
        """Index columns stacked for ``x[jnp.arange(B), idx]``: a concatenation, along a
        dimension other than the batch's, of per-example columns and one column of each
        example's position (along the same batch dimension); ``None`` for anything else."""
        if node.name != "concatenate":
            return None
        axis = node.params["dimension"]
        ex = {f.dim for f in ins if f.kind == EX}
        if len(ex) != 1 or None in ex or axis in ex:
            return None
        d = ex.pop()
        at, cols = 0, []
        for v, f in zip(node.inputs, ins):
            if v is None or f.kind == RED or f.position_column is not None:
                return None
            if f.kind == IND and f.varies:
                if f.position != d or self.g.values[v].shape[axis] != 1:
                    return None
                cols.append(at)
            at += self.g.values[v].shape[axis]
        if len(cols) != 1:
            return None
        out = self.ex_out(node, _arith_exp(node.primitive, node, ins))
        if out[0].dim != d:
            return None
        return [replace(out[0], position_column=(axis, cols[0]))]

    def red_exp(self, node, ins: list[Flow]) -> int | None:
        """Exponent of an aggregate (only loop carries need it: accumulators add aggregates)."""
        reds = [f for f in ins if f.kind == RED]
        if node.primitive in _SUMS and all(f.kind == RED or f.zero for f in ins):
            es = {f.exp for f in reds}
            return es.pop() if len(es) == 1 else None
        if node.primitive in _ZERO_PRESERVING or node.primitive in CASTS:
            return reds[0].exp
        if node.primitive is P.mul_p and len(ins) == 2:
            return _add(ins[0].exp, ins[1].exp)
        if node.primitive is P.div_p and ins[0].kind == RED and ins[1].kind == IND:
            return _sub(ins[0].exp, ins[1].exp)
        return None

    # ---- per-example values -------------------------------------------------------------------
    def example(self, node, ins: list[Flow]) -> list[Flow]:
        prim, name = node.primitive, node.name
        ex = [(k, f) for k, f in enumerate(ins) if f.kind == EX]
        if any(f.dim is None for _, f in ex):
            # A per-example value whose batch dimension was lost upstream (where a problem
            # says why: examples paired with examples, CLIP's in-batch similarities): nothing
            # below can place it, and its result cannot be combined across microbatches.
            return self.ex_out(node, None)
        e = _arith_exp(prim, node, ins)
        if prim in (P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p,
                    P.reduce_and_p, P.reduce_or_p, P.argmax_p, P.argmin_p):
            axes = tuple(node.params["axes"])
            d = ex[0][1].dim
            if d in axes:
                if prim is P.reduce_sum_p:
                    return [Flow(RED, exp=ex[0][1].exp)]
                self.problem(node, f"{name} over the batch dimension is not a sum: microbatch "
                                   f"results cannot be combined into it")
                return [Flow(RED, exp=None)]
            return self.ex_out(node, e)
        if prim is P.dot_general_p:
            return self.dot(node, ins, e)
        if prim is P.conv_general_dilated_p:
            return self.conv(node, ins, e)
        if name == "gather":
            return self.gather(node, ins)
        if name in _SCATTERS:
            return self.scatter(node, ins)
        if prim in CUMULATIVE or name in ("sort", "cumsum"):
            axis = node.params.get("axis", node.params.get("dimension"))
            if any(f.dim == axis for _, f in ex):
                self.problem(node, f"{name} runs along the batch dimension (it mixes examples)")
                return [Flow(EX, exp=None)] * len(node.outputs)
            return self.ex_out(node, e)
        if prim is P.reshape_p:
            return self.reshape(node, ins, e)
        checks = _ALONG.get(name)
        if checks is not None:
            for k, f in ex:
                why = checks(node, self, k, f)
                if why:
                    self.problem(node, why)
                    return [Flow(EX, exp=None)] * len(node.outputs)
            return self.ex_out(node, e)
        if prim in ELEMENTWISE or prim in CASTS or name in _STRUCTURAL or prim in POOLING \
                or prim in WINDOW_GRADIENTS:
            return self.ex_out(node, e)
        self.problem(node, f"hulkjax cannot tell whether {name} mixes examples of the batch")
        return [Flow(EX, exp=None)] * len(node.outputs)

    def ex_out(self, node, e) -> list[Flow]:
        outs = []
        for o in node.outputs:
            dd = self.diff_dims(o)
            if len(dd) == 1:
                outs.append(Flow(EX, dim=dd[0], exp=e))
            elif not dd:
                # Shaped without a batch dimension though it reads per-example values: an indexed
                # reduction we did not recognize.
                self.problem(node, f"{node.name} reads per-example values but its result has no "
                                   f"batch dimension")
                outs.append(Flow(RED, exp=None))
            else:
                self.problem(node, f"{node.name}'s result has several batch-sized dimensions")
                outs.append(Flow(EX, exp=None))
        return outs

    def dot(self, node, ins, e) -> list[Flow]:
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        lf, rf = ins[0], ins[1]
        lcon = lf.kind == EX and lf.dim in lc
        rcon = rf.kind == EX and rf.dim in rc
        if lcon or rcon:
            # A sum over examples: x^T dy (both per example, batch contracted with batch).
            if lf.kind == EX and rf.kind == EX:
                if not (lcon and rcon and list(lc).index(lf.dim) == list(rc).index(rf.dim)):
                    self.problem(node, "dot_general contracts the batch of one operand with "
                                       "another dimension of the other")
                    return [Flow(RED, exp=None)]
            return [Flow(RED, exp=_add(lf.exp, rf.exp))]
        if lf.kind == EX and rf.kind == EX:
            aligned = lf.dim in lb and rf.dim in rb and \
                list(lb).index(lf.dim) == list(rb).index(rf.dim)
            if not aligned:
                self.problem(node, "dot_general pairs examples with other examples (an outer "
                                   "product over the batch)")
                return [Flow(EX, exp=None)]
        return self.ex_out(node, e)

    def conv(self, node, ins, e) -> list[Flow]:
        dn = node.params["dimension_numbers"]
        lf, rf = ins[0], ins[1]
        if lf.kind == EX and lf.dim == dn.lhs_spec[0] and rf.kind == IND:
            return self.ex_out(node, e)
        if lf.kind == EX and rf.kind == EX and lf.dim == dn.lhs_spec[1] \
                and rf.dim == dn.rhs_spec[1]:
            return [Flow(RED, exp=_add(lf.exp, rf.exp))]  # the kernel's gradient
        if lf.kind == EX and rf.kind == EX and lf.dim == dn.lhs_spec[0] \
                and rf.dim == dn.rhs_spec[0] and node.params.get("batch_group_count", 1) > 1:
            return [Flow(RED, exp=_add(lf.exp, rf.exp))]
        self.problem(node, "a convolution that mixes examples of the batch")
        return [Flow(EX, exp=None)]

    def gather(self, node, ins) -> list[Flow]:
        dn = node.params["dimension_numbers"]
        op = ins[0]
        if op.kind == EX:
            d = op.dim
            shape = self.g.values[node.inputs[0]].shape
            kept = d not in dn.start_index_map and d not in dn.collapsed_slice_dims and \
                node.params["slice_sizes"][d] == shape[d]
            own = self._own_rows(node, ins[1], dn.start_index_map, d) and \
                node.params["slice_sizes"][d] == 1
            if not (d in dn.operand_batching_dims or kept or own):
                self.problem(node, "gather indexes across examples of the batch")
                return [Flow(EX, exp=None)]
        if ins[1].position_column is not None and not (op.kind == EX and own):
            self.problem(node, "gather indexes by the examples' positions in the batch into "
                               "something other than each example's own row")
            return [Flow(EX, exp=None)]
        return self.ex_out(node, _arith_exp(node.primitive, node, ins))

    def _own_rows(self, node, idx: Flow, index_map, d: int) -> bool:
        """Whether indices ``idx`` (of ``node``, operand 1) pick each example's own row along
        operand dimension ``d``: their column mapped to ``d`` is each example's position, and
        the examples run along the same dimension of the indices as of the result."""
        if idx.kind != EX or idx.position_column is None:
            return False
        axis, col = idx.position_column
        rank = len(self.g.values[node.inputs[1]].shape)
        return axis == rank - 1 and col < len(index_map) and index_map[col] == d

    def scatter(self, node, ins) -> list[Flow]:
        dn = node.params["dimension_numbers"]
        op, upd = ins[0], ins[2]
        out = node.outputs[0]
        dd = self.diff_dims(out)
        if dd:
            d = op.dim if op.kind == EX else (dd[0] if len(dd) == 1 else None)
            own = d is not None and self._own_rows(node, ins[1],
                                                   dn.scatter_dims_to_operand_dims, d)
            if op.kind == EX or (upd.kind == EX and d is not None):
                ok = own or d in dn.operand_batching_dims or (
                    d not in dn.scatter_dims_to_operand_dims and d not in dn.inserted_window_dims)
                if not ok:
                    self.problem(node, "scatter writes across examples of the batch")
                    return [Flow(EX, exp=None)]
            if ins[1].position_column is not None and not own:
                self.problem(node, "scatter writes by the examples' positions in the batch into "
                                   "something other than each example's own row")
                return [Flow(EX, exp=None)]
            return self.ex_out(node, _arith_exp(node.primitive, node, ins))
        if ins[1].position_column is not None:
            self.problem(node, "scatter writes by the examples' positions in the batch into a "
                               "table without a batch dimension")
            return [Flow(RED, exp=None)]
        if node.name == "scatter" or not (op.kind == IND and op.zero):
            self.problem(node, f"{node.name} of per-example updates into a table that is not "
                               f"zero is not a sum over examples")
            return [Flow(RED, exp=None)]
        return [Flow(RED, exp=upd.exp)]  # embedding gradients: a sum of per-example rows

    def reshape(self, node, ins, e) -> list[Flow]:
        f = ins[0]
        src = self.g.values[node.inputs[0]].shape
        out = node.outputs[0]
        dst = self.g.values[out].shape
        dd = self.diff_dims(out)
        if len(dd) != 1 or math.prod(src[:f.dim]) != math.prod(dst[:dd[0]]):
            self.problem(node, "a reshape that interleaves the batch with another dimension")
            return [Flow(EX, exp=None)]
        return [Flow(EX, dim=dd[0], exp=e)]

    # ---- loops --------------------------------------------------------------------------------
    def loop(self, node, ins: list[Flow]) -> list[Flow]:
        if all(f.kind == IND for f in ins):
            varies = any(f.varies for f in ins)
            e = 0 if all(f.exp == 0 for f in ins) else None
            return [Flow(IND, exp=e, varies=varies and bool(self.diff_dims(o)))
                    for o in node.outputs]
        if node.primitive is P.scan_p:
            return self.scan(node, ins)
        if node.primitive is P.cond_p:
            pred = ins[0]
            if pred.kind != IND:
                self.problem(node, "a cond whose branch depends on the batch")
                return [Flow(RED, exp=None)] * len(node.outputs)
            outs = None
            for bi, _body in enumerate(node.subgraphs):
                got = self.body(node, bi, list(ins[1:]))
                outs = got if outs is None else [_join(a, b) for a, b in zip(outs, got)]
            return outs or []
        # while: cond consts, body consts, carries.
        cn, bn = node.params["cond_nconsts"], node.params["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        for _ in range(4):
            out = self.body(node, 1, bconsts + carry)
            joined = [_join(a, b) for a, b in zip(carry, out)]
            if joined == carry:
                break
            carry = joined
        pred = self.body(node, 0, cconsts + carry)
        if pred and pred[0].kind != IND:
            self.problem(node, "a while loop whose trip count depends on the batch")
        return carry

    def scan(self, node, ins: list[Flow]) -> list[Flow]:
        nc, ncar = node.params["num_consts"], node.params["num_carry"]
        consts, carry, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        xs_in = []
        for f in xs:
            if f.kind == EX and f.dim == 0:
                self.problem(node, "a scan over the batch dimension")
                return [Flow(EX, exp=None)] * len(node.outputs)
            xs_in.append(Flow(f.kind, None if f.dim is None else f.dim - 1, f.exp, f.zero,
                              f.varies))
        out = []
        for _ in range(4):
            out = self.body(node, 0, consts + carry + xs_in)
            joined = [_join(a, b) for a, b in zip(carry, out[:ncar])]
            if joined == carry:
                break
            carry = joined
        ys = [Flow(f.kind, None if f.dim is None else f.dim + 1, f.exp, f.zero, f.varies)
              for f in out[ncar:]]
        return list(carry) + ys

    def body(self, node, index: int, ins: list[Flow]) -> list[Flow]:
        sub, msub = node.subgraphs[index], self.m.nodes[node.id].subgraphs[index]
        flows = [Flow(IND)] * len(sub.values)
        for vid, f in zip(sub.inputs, ins):
            flows[vid] = f
        inner = _Analysis.__new__(_Analysis)
        inner.g, inner.m, inner.k = sub, msub, self.k
        inner.flows, inner.problems = flows, self.problems
        inner.literals = literal_operands(sub.jaxpr)
        inner.micro_literals = literal_operands(msub.jaxpr)
        for cv, _mv, val, mval in zip(sub.constants, msub.constants, _consts(sub), _consts(msub)):
            if flows[cv].kind == IND and cv not in sub.inputs:
                e = inner.exponent(val, mval) if val is not None and mval is not None else 0
                flows[cv] = Flow(IND, exp=e, zero=_is_zero(val))
        inner.run()
        return [Flow(IND) if o is None else flows[o] for o in sub.outputs]


def _consts(g: OpGraph) -> list[Any]:
    """Values of a graph's closed-over constants (``None`` where not concrete)."""
    vals = list(getattr(g.jaxpr, "consts", ()))
    vals += [None] * (len(g.constants) - len(vals))
    return vals


def _is_zero(val) -> bool:
    if val is None:
        return False
    try:
        a = np.asarray(val)
        return a.dtype != object and a.size > 0 and not np.any(a)
    except (TypeError, ValueError):
        return False


def _add(a, b):
    return None if a is None or b is None else a + b


def _sub(a, b):
    return None if a is None or b is None else a - b


_SUMS = frozenset({P.add_p, P.sub_p, P.add_jaxvals_p})
_ZERO_PRESERVING = frozenset({P.broadcast_in_dim_p, P.reshape_p, P.transpose_p, P.squeeze_p,
                              P.convert_element_type_p, P.neg_p, P.slice_p, P.reduce_sum_p,
                              P.copy_p, P.rev_p, P.pad_p})
_SCATTERS = frozenset({"scatter", "scatter-add", "scatter_add"})
_INDEXED = _SCATTERS | {"gather"}  # operand 1: the indices
_VARYING_SOURCES = frozenset({"iota", "random_bits", "threefry2x32", "rng_bit_generator",
                              "rng_uniform", "random_seed", "random_wrap"})
_STRUCTURAL = frozenset({"broadcast_in_dim", "transpose", "squeeze", "expand_dims", "copy",
                         "copy_p", "convert_element_type", "reduce_precision", "stop_gradient",
                         "select_n", "clamp", "integer_pow", "square", "erf_inv", "logistic",
                         "add_any", "pjit", "optimization_barrier", "random_wrap",
                         # identities: a remat label, a copy to or from host memory, a layout
                         "name", "device_put", "sharding_constraint",
                         "random_unwrap", "random_split", "random_fold_in", "split",
                         # stack: its new axis is never the batch's; unstack: one result per
                         # index of its axis, so one of the batch changes the step's structure
                         # (refused before the flows are read)
                         "stack", "unstack"})


def _arith_exp(prim, node, ins: list[Flow]) -> int | None:
    """The batch-size exponent of an arithmetic result from its operands'."""
    es = [f.exp for f in ins]
    if prim is P.mul_p:
        if any(f.zero for f in ins):
            return 0
        return None if None in es else sum(es)
    if prim is P.div_p:
        return _sub(es[0], es[1]) if len(es) == 2 else None
    if prim is P.integer_pow_p:
        return None if es[0] is None else es[0] * int(node.params["y"])
    if prim is P.square_p:
        return None if es[0] is None else 2 * es[0]
    if prim in (P.sqrt_p, P.rsqrt_p):
        if es[0] is None or es[0] % 2:
            return None if es[0] != 0 else 0
        return es[0] // 2 if prim is P.sqrt_p else -es[0] // 2
    if prim in _LINEAR_N:
        live = [f.exp for f in ins if not f.zero]
        if not live:
            return 0
        return live[0] if all(x == live[0] for x in live) else None
    if prim is P.select_n_p:
        live = [f.exp for f in ins[1:] if not f.zero]
        return live[0] if live and all(x == live[0] for x in live) else (0 if not live else None)
    if prim in (P.dot_general_p, P.conv_general_dilated_p):
        return _add(es[0], es[1])
    if prim in _COMPARISONS:
        return 0 if len(set(es)) == 1 and es[0] is not None else None
    if prim in (P.argmax_p, P.argmin_p, P.iota_p):
        return 0
    # Shape operators, reductions along other dimensions, gathers and scatters: the exponent of
    # the operands that carry values (not indices), zeros left out.
    if prim in _KEEPS or prim in CASTS or prim in POOLING or prim in WINDOW_GRADIENTS \
            or node.name in ('split', 'stack', 'unstack', 'tile', 'reduce_window', 'cumsum',
                             'cummax', 'cummin'):
        which = _VALUE_OPERANDS.get(node.name)
        vals = [ins[k] for k in (which if which is not None else range(len(ins))) if k < len(ins)]
        live = [f.exp for f in vals if not f.zero]
        if not live:
            return 0
        return live[0] if all(x == live[0] for x in live) else None
    return 0 if all(x == 0 for x in es) else None


# Operands that carry the values of an indexed or padded operator (the others are indices).
_VALUE_OPERANDS = {"gather": (0,), "scatter-add": (0, 2), "scatter": (0, 2), "dynamic_slice": (0,),
                   "dynamic_update_slice": (0, 1), "pad": (0, 1),
                   "select_and_scatter_add": (0,), "select_and_gather_add": (0,)}


_LINEAR_N = frozenset({P.add_p, P.sub_p, P.neg_p, P.max_p, P.min_p, P.concatenate_p,
                       P.add_jaxvals_p})
_COMPARISONS = frozenset({P.eq_p, P.ne_p, P.lt_p, P.le_p, P.gt_p, P.ge_p})
_KEEPS = frozenset({P.broadcast_in_dim_p, P.reshape_p, P.transpose_p, P.squeeze_p, P.slice_p,
                    P.dynamic_slice_p, P.pad_p, P.rev_p, P.reduce_sum_p, P.reduce_max_p,
                    P.reduce_min_p, P.gather_p, P.scatter_add_p, P.dynamic_update_slice_p,
                    P.cumsum_p, P.sort_p, P.copy_p, P.reduce_precision_p, P.abs_p,
                    P.sign_p})


def _full_extent(node, analysis: _Analysis, k: int, f: Flow) -> str:
    """Slices, pads, updates and tiles that keep the whole batch dimension."""
    d = f.dim
    name = node.name
    shape = analysis.g.values[node.inputs[k]].shape
    if name == "slice":
        start, limit = node.params["start_indices"][d], node.params["limit_indices"][d]
        strides = node.params.get("strides")
        if start != 0 or limit != shape[d] or (strides and strides[d] != 1):
            return "a slice along the batch dimension"
    elif name == "pad":
        if k == 0 and tuple(node.params["padding_config"][d]) != (0, 0, 0):
            return "padding along the batch dimension"
    elif name == "dynamic_slice":
        if k == 0 and node.params["slice_sizes"][d] != shape[d]:
            return "a dynamic slice along the batch dimension"
    elif name == "dynamic_update_slice":
        out = analysis.g.values[node.outputs[0]].shape
        if k == 1 and shape[d] != out[d]:
            return "an update of part of the batch dimension"
    elif name == "concatenate":
        if node.params["dimension"] == d:
            return "a concatenation along the batch dimension"
    elif name == "rev":
        if d in tuple(node.params["dimensions"]):
            return "a reversal of the batch dimension"
    elif name in ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
                  "select_and_scatter_add", "select_and_gather_add"):
        wd = node.params.get("window_dimensions")
        if wd is not None and k == 0 and wd[d] != 1:
            return "a window over the batch dimension"
    elif name == "split":
        if node.params.get("axis") == d:
            return "a split of the batch dimension"
    elif name == "tile":
        if node.params["reps"][d] != 1:
            return "a tile that repeats the batch dimension"
    return ""


_ALONG = {name: _full_extent for name in (
    "slice", "pad", "dynamic_slice", "dynamic_update_slice", "concatenate", "rev",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "select_and_gather_add", "split", "tile")}


def _join(a: Flow, b: Flow) -> Flow:
    """The flow of a loop carry that starts as ``a`` and becomes ``b``."""
    if a == b:
        return a
    if a.kind == IND and b.kind in (EX, RED) and (a.zero or a.exp == b.exp):
        return b
    if b.kind == IND and a.kind in (EX, RED) and (b.zero or a.exp == b.exp):
        return a
    if a.kind == b.kind:
        return Flow(a.kind, a.dim if a.dim == b.dim else None,
                    a.exp if a.exp == b.exp else None, a.zero and b.zero, a.varies or b.varies)
    kind = RED if RED in (a.kind, b.kind) else EX
    return Flow(kind, None, None)
