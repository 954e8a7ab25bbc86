"""Peak memory per device from what stays live: a liveness walk over the step in program order.

What a device holds at once is its arguments (parameters, optimizer state, its slice of the batch)
plus, at the worst moment of the step, every intermediate buffer still waiting for a use: the
activations autodiff saved for the backward pass, gradients not yet consumed by the optimizer, and
the transient buffers of collectives (a gathered parameter right before its use; on backends
without reduce-scatters, the whole partial sum before its slice and the whole sum it reduces to).
Buffers are sized at their planned layouts. Elementwise chains fuse: a value is a buffer only when
an unfusible operator makes or reads it (or it is a result of the step), as XLA's loop and
reduction fusions keep the rest in registers, and a fused chain reads its operands where it runs
(its last operator). The state update writes into the donated arguments (no new buffer). Gradient
reductions run combined as the backend's combiner groups them; where a group runs, its partial sums
and its results are live together unless the backend reduces in place (XLA:CPU does not, and makes
one group: twice the gradients; XLA:GPU's all-reduce is in place). A matmul operand XLA lays out
anew is copied where it is made. Loops add their body's transient at the loop.

This is the memory :class:`~hulkjax.plan.Cost` reports (``peak_memory``, ``memory_breakdown``) and
that ``tests/cost/test_memory.py`` holds against ``compiled.memory_analysis()``. The ILP's
memory constraint needs an additive model; it uses the per-group sums of
:meth:`~hulkjax.cost.CostModel.memory` (parameters, gradients, optimizer state and saved
activations), which usually bounds this one from above (not where a combined gradient reduction
holds its operands and results at once), and the planners check their result with this walk.

>>> import jax, jax.numpy as jnp, hulkjax as hj
>>> p = hj.plan(lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w),
...             jnp.ones((64, 64)), jnp.ones((128, 64)), topology=hj.Topology.grid((8,), ("d",)),
...             strategy="dp")
>>> sorted(k for k, v in p.cost.memory_breakdown.items() if v)  # the peak: the gradient all-reduce
['data', 'gradients', 'parameters']
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from hulkjax.plan.specs import local_shape, num_shards
from hulkjax.rules.loops import LoopResolution
from hulkjax.trace.graph import DATA, OPTIMIZER, PARAMETER, dtype_size
from hulkjax.trace.primitives import FUSIBLE, PASSTHROUGH, SCATTERS, handles

KINDS = ("parameters", "optimizer", "data", "activations", "gradients", "transients")
"""The kinds of bytes a device holds, as :class:`~hulkjax.plan.Cost` reports them."""

_FUSES_INPUTS = FUSIBLE
_IN_PLACE = SCATTERS | handles("dynamic_update_slice")
"""Operators that write into their first operand's buffer when nothing else reads it."""
EXPENSIVE = handles("exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "erfc",
                    "erf_inv", "sqrt", "rsqrt", "cbrt", "pow", "sin", "cos", "tan", "atan2", "div",
                    "integer_pow")
"""Elementwise operators a fusion does not duplicate into several users: their result is a
buffer when more than one operator reads it."""


def host_copies(g) -> dict[int, float]:
    """The operators of ``g`` that copy a value between device and host memory, each with the
    whole value's bytes: a ``device_put`` whose result lives in another memory space than its
    operand (:attr:`~hulkjax.trace.graph.Value.host`): out to the host (an offloaded activation)
    or back to the device (where the backward pass reads it).

    >>> import jax, jax.numpy as jnp, hulkjax as hj
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> policy = jax.checkpoint_policies.save_and_offload_only_these_names(
    ...     names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
    ...     offload_src="device", offload_dst="pinned_host")
    >>> layer = jax.checkpoint(lambda w, x: jnp.sum(jnp.tanh(checkpoint_name(x @ w, "h"))),
    ...                        policy=policy)
    >>> g = hj.trace(jax.grad(layer), jnp.ones((4, 4)), jnp.ones((8, 4)))
    >>> sorted(host_copies(g).values())  # the (8, 4) float32 activation: out, and back
    [128.0, 128.0]
    """
    out = {}
    for n in g.nodes:
        if n.primitive not in _DEVICE_PUT:
            continue
        for v, o in zip(n.inputs, n.outputs):
            if v is not None and g.values[v].host != g.values[o].host:
                out[n.id] = out.get(n.id, 0.0) + float(g.values[o].nbytes)
    return out


_DEVICE_PUT = handles("device_put")


@dataclass(frozen=True)
class Buffer:
    """One buffer live at the peak: ``bytes`` of ``kind``, made for ``node`` (``None``: an
    argument of the step), whose value is ``value`` (``None``: a collective's transient)."""

    node: int | None
    value: int | None
    kind: str
    bytes: float


@dataclass(frozen=True)
class MemoryReport:
    """The liveness walk's result.

    Attributes:
      peak: bytes per device at the worst moment (arguments included).  # float
      at: the node after which the peak happens (``-1``: before the first node).  # int
      breakdown: the peak's bytes by kind (:data:`KINDS`).  # dict[str, float]
      live: the buffers live at the peak (their bytes add up to ``peak``).  # tuple of Buffer
    """

    peak: float
    at: int
    breakdown: dict
    live: tuple[Buffer, ...]

    @property
    def temporaries(self) -> float:
        """Bytes at the peak beyond the arguments (what the program allocates per call: XLA's
        temporaries: 0.82-1.59x ``compiled.memory_analysis().temp_size_in_bytes`` for the donated
        training steps of five Hugging Face families at batches 2-16, ``benchmarks/COMPUTE.md``)."""
        return self.peak - sum(b.bytes for b in self.live if b.node is None and b.value is not None)


def liveness(cm, assignment, *, breakdown=None, nodes=None, held=None,
             in_flight: int = 1, received_as_arguments: bool = False) -> MemoryReport:
    """Walk the step in program order under ``assignment`` and find its peak memory per device
    (``breakdown``: the assignment's :class:`~hulkjax.cost.Breakdown`, if already made).

    A pipeline stage runs part of the step: ``nodes`` (node ids) are the operators it runs,
    ``held`` (input indices) the parameters and optimizer state it holds, and ``in_flight`` the
    microbatches whose data and saved activations (a forward buffer read by the backward pass)
    it holds at once. A value read only by other stages is sent and freed after it is made.
    ``received_as_arguments``: ``nodes`` are one program, and the values other programs make
    (another stage's, or the forward's for a backward program) are its arguments, live
    throughout (:attr:`MemoryReport.temporaries` leaves them out), rather than buffers from
    their first use to their last.
    """
    g = cm.graph
    mine = None if nodes is None else set(nodes)
    in_flight = max(int(in_flight), 1)
    sk = _skeleton(cm, nodes, mine)
    sizes = cm.sizes
    b = cm.breakdown(assignment, memory=False) if breakdown is None else breakdown
    specs = dict(b.specs)  # the assignment's value layouts (CostModel.value_specs)
    # What is computed in place from constants (zeros to scatter into, masks, iota) is made in the
    # layout its uses slice it to: partitioners propagate the consumers' sharding onto it.
    for nid, k, v in sk.free_uses:
        gid = cm.group_of_node[nid]
        r = cm.resolution(gid, assignment[gid], nid)
        need = r.in_specs[k] if r is not None else None
        have = specs.get(v)
        if need is not None and have is not None \
                and num_shards(need, sizes) > num_shards(have, sizes):
            specs[v] = need

    wire = cm.backend.wire_factor
    offloads = cm.backend.host_offload

    def nbytes(vid, spec=None, held_as_is=False):
        # Intermediates of a backend without narrow-float arithmetic (XLA:CPU) are held in f32;
        # the step's arguments and results keep their dtype.
        v = g.values[vid]
        if offloads and v.host:  # in host memory: none of the device's
            return 0.0
        spec = specs.get(vid) if spec is None else spec
        shape = v.shape if spec is None else local_shape(v.shape, spec, sizes)
        widen = 1.0 if held_as_is else wire(v.dtype)
        # math.prod of ints is exact, as np.prod in float64 is below 2**53 elements
        return float(math.prod(shape)) * dtype_size(v.dtype) * widen

    args: list[Buffer] = []
    roles = {PARAMETER: "parameters", OPTIMIZER: "optimizer", DATA: "data"}
    for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
        if role not in roles:
            continue
        if role == DATA:
            if mine is None or any(c in mine for c, _ in g.consumers(vid)):
                args.append(Buffer(None, vid, "data", nbytes(vid, held_as_is=True) * in_flight))
        elif held is None or i in held:
            args.append(Buffer(None, vid, roles[role], nbytes(vid, held_as_is=True)))

    end = len(g.nodes)

    # A reduction is not in place: the partial sums (the whole operand of a reduce-scatter) are a
    # buffer until the collective runs, its result another. Deferred ones (gradient reductions)
    # run combined, as the backend's combiner groups them: in program order, up to its threshold
    # per kind and devices (XLA:CPU: all in one). A group runs once its last member is made and
    # that node's operands are freed, on the boundary after it (an index <= the number of nodes:
    # the sweep has a slot for the step's end). Its partial sums wait for it; its results exist
    # from then on, so operands and results are live together there, unless the backend reduces
    # in place.
    # A loop's collectives run inside its body, once per iteration: their buffers are part of the
    # body's own walk (the loop's transient below), not held across the step.
    own = {nid: comms for nid, comms in b.own.items()
           if (mine is None or nid in mine) and not g.nodes[nid].subgraphs}
    reductions = ("all-reduce", "reduce-scatter")
    pending: dict[tuple, list] = {}  # (kind, axes) -> [(nid, comm), ...] of the open group
    runs_at: dict[int, int] = {}  # id(comm) -> where its group runs
    # Thresholds only, not the dependency rule of ``CostModel._combine``: that rule treats all of
    # a node's descendants as depending on its own collective, which splits a scan's gradient
    # reductions from the embedding's (GPT-2 with scanned layers: 0.88 of the compiled peak
    # instead of 0.94); the gradient reductions here are independent.
    for nid in sorted(own):
        for c in own[nid]:
            if not (c.deferred and c.kind in reductions):
                continue
            kind = cm.backend.kind_of(c.kind)
            threshold = cm.backend.combine_threshold.get(kind, 0.0)
            group = pending.setdefault((kind, c.axes), [])
            if group and sum(x.bytes for _, x in group) + c.bytes > threshold:
                for _, x in group:
                    runs_at[id(x)] = group[-1][0] + 1
                group.clear()
            group.append((nid, c))
    for group in pending.values():
        for _, x in group:
            runs_at[id(x)] = group[-1][0] + 1
    reduced_at = {nid: max(runs_at[id(c)] for c in comms if id(c) in runs_at)
                  for nid, comms in own.items() if any(id(c) in runs_at for c in comms)}

    # Intervals [start, stop] (node ids) of every buffer (their places: :func:`_skeleton`).
    intervals: list[tuple[int, int, Buffer]] = []
    for nid, o, stop, kind, is_output, saved, hoisted in sk.buffers:
        size = nbytes(o, held_as_is=is_output)
        if in_flight > 1 and saved:
            size *= in_flight  # saved for the backward pass of every microbatch in flight
        start = sk.first if hoisted else reduced_at.get(nid, nid)
        intervals.append((start, max(stop, start), Buffer(nid, o, kind, size)))
    for v, first_use, last_use, saved in sk.received:
        size = nbytes(v)
        if in_flight > 1 and saved:
            size *= in_flight
        if received_as_arguments:
            args.append(Buffer(None, v, "activations", size))
        else:
            intervals.append((first_use, last_use, Buffer(first_use, v, "activations", size)))
    copies: dict[tuple, list] = {}  # one gathered copy per (value, layout), live across its uses
    for mv in b.moves:
        if mv.node < 0 or (mine is not None and mv.node not in mine):
            continue
        dst = cm.required(mv.group, assignment[mv.group], mv.node, _operand(g, mv.node, mv.value))
        if dst is None:
            continue
        key = (mv.value, dst)
        span = copies.setdefault(key, [mv.node, mv.node, nbytes(mv.value, dst)])
        span[0], span[1] = min(span[0], mv.node), max(span[1], mv.node)
    for _, (start, stop, size) in copies.items():
        intervals.append((start, stop, Buffer(start, None, "transients", size)))
    for nid, comms in own.items():
        for c in comms:
            if c.kind not in ("all-reduce", "reduce-scatter"):
                continue
            stop = runs_at.get(id(c), nid)
            if cm.backend.in_place(c.kind):
                stop -= 1  # the result (the value's own buffer, from ``stop`` on) takes it over
            kind = "gradients" if c.deferred else "transients"
            intervals.append((nid, stop, Buffer(nid, None, kind, float(c.bytes))))
            if c.kind == "reduce-scatter" and not cm.backend.reduce_scatter:
                # The backend all-reduces, then slices: where the reduction runs, its result is
                # the whole sum, not the shard the value is sized at (the rest of it here).
                n = math.prod(cm.sizes[a] for a in c.axes)
                intervals.append((stop, stop, Buffer(nid, None, kind, c.bytes * (1 - 1 / n))))
    # Matmul operands XLA first copies into its canonical dimension order. Layout assignment
    # makes the copy where the operand is made (a parameter's at the start of the step), not
    # where the matmul reads it: the copy of a weight or of a saved activation that a backward
    # matmul reads transposed is live from then on. An operand nothing else reads is made in
    # the matmul's order directly: its copy is a transient at the matmul.
    relaid: dict[tuple, list] = {}
    for nid, k, v, order, start in sk.relaid:
        gid = cm.group_of_node[nid]
        r = cm.resolution(gid, assignment[gid], nid)
        need = r.in_specs[k] if r is not None else None
        span = relaid.setdefault((v, order, need), [start, nid, nbytes(v, need)])
        span[0], span[1] = min(span[0], start), max(span[1], nid)
    for start, stop, size in relaid.values():
        intervals.append((start, stop, Buffer(start, None, "transients", size)))
    for grp in cm.groups:
        if grp.kind == "leader" and (mine is None or grp.leader in mine):
            r = grp.candidates[assignment[grp.id]]
            if isinstance(r, LoopResolution) and r.memory:
                intervals.append((grp.leader, grp.leader,
                                  Buffer(grp.leader, None, "transients", float(r.memory))))

    # Sweep: +bytes at start, -bytes after stop; the peak over node boundaries.
    delta = np.zeros(end + 2)
    for start, stop, buf in intervals:
        delta[start] += buf.bytes
        delta[stop + 1] -= buf.bytes
    running = np.cumsum(delta)
    at = int(np.argmax(running)) if len(running) else -1
    temp = float(running[at]) if len(running) else 0.0
    live = tuple(a for a in args) + tuple(buf for start, stop, buf in intervals
                                          if start <= at <= stop)
    breakdown: dict[str, float] = defaultdict(float)
    for buf in live:
        breakdown[buf.kind] += buf.bytes
    total = sum(a.bytes for a in args) + temp
    return MemoryReport(total, at, {k: breakdown.get(k, 0.0) for k in KINDS}, live)


@dataclass(frozen=True)
class _Skeleton:
    """What the liveness walk of one cost model (and set of nodes) finds without an assignment:
    which results are buffers and until when they are read, what other stages send, which
    matmul operands are copied into another dimension order, and the constant-made values."""

    free_uses: tuple  # (node, operand, value) of every use of a constant-made value
    buffers: tuple  # (node, value, stop, kind, is a result of the step, saved for backward,
    #                  made at the start: see Backend.hoists_argument_values)
    first: int  # the first node the walk covers
    received: tuple  # (value, first use, last use, saved for backward)
    relaid: tuple  # (matmul node, operand, value, dimension order, start)


def _skeleton(cm, nodes, mine) -> _Skeleton:
    """The assignment-independent part of :func:`liveness` (memoized on the graph, per cost
    model and set of nodes)."""
    g = cm.graph
    key = ("liveness skeleton", id(cm), None if nodes is None else tuple(nodes))
    hit = g.memo.get(key)
    if hit is not None and hit[0] is cm:
        return hit[1]
    fu = g.memo.get(("liveness free uses", id(cm)))
    if fu is None or fu[0] is not cm:
        free = {v for v, gid in cm.group_of_value.items() if gid == cm.free_group}
        fu = g.memo[("liveness free uses", id(cm))] = (cm, tuple(
            (n.id, k, v) for n in g.nodes for k, v in enumerate(n.inputs)
            if v is not None and v in free))
    free_uses = fu[1]
    facts = g.memo.get("liveness graph facts")
    if facts is None:
        facts = g.memo["liveness graph facts"] = _graph_facts(g)
    carried, outputs, fusible, buffer_values, from_arguments, folds, unfolded = facts
    # An add XLA folds into a scatter (_scatter_folds) where one program runs the add, the
    # scatter and its zeros (a stage whose add reads another stage's scatter adds two
    # arguments): the other addend is the scatter's operand, written in place, not the add's;
    # the scatter reads it, at its own position.
    here = {a: f for a, f in folds.items() if mine is None or (
        a in mine and f[0] in mine and g.values[f[3]].producer in mine)}
    away = {v: unfolded[v] for a, f in folds.items() if a not in here for v in f[1:]}
    folded_into = {x: (a, sp) for a, (sp, x, _, _) in here.items()}
    hoists = cm.backend.hoists_argument_values
    first = 0 if mine is None else min(mine, default=0)
    end = len(g.nodes)

    def materialized(n, o) -> bool:
        return away[o] if o in away else o in buffer_values

    # A fused chain runs where its last operator (the one whose result is a buffer) runs: a
    # buffer that a fusible operator reads is read there (an update's ``transpose`` -> ``mul`` ->
    # ``sub`` of a gradient runs with the optimizer, not after the gradient's matmul).
    # A stage's walks cover its own nodes only (a walk of the whole step per stage was most of
    # an interleaved layout's exact cost: 32 stages of an 8B LLaMA's 16,609 nodes).
    walked = g.nodes if mine is None else [g.nodes[i] for i in sorted(mine)]
    read_at = list(range(end))  # consumers come after their producers: one reverse pass
    # A fusible other addend of a fold, read by the add alone, is the scatter's operand fusion,
    # which runs where the scatter does (its operands are read there) and is the scatter's own
    # buffer.
    fused_operands = {x for x in folded_into
                      if fusible[g.values[x].producer] and len(g.consumers(x)) == 1}
    for x in fused_operands:
        read_at[g.values[x].producer] = folded_into[x][1]
    for n in reversed(walked):
        if not fusible[n.id]:
            continue
        for o in n.outputs:
            if g.values[o].shape and o not in carried and not materialized(n, o):
                for c, _ in g.consumers(o):
                    if mine is None or c in mine:
                        read_at[n.id] = max(read_at[n.id], read_at[c])

    buffers = []
    for n in walked:
        for o in n.outputs:
            if not g.values[o].shape or not materialized(n, o) or o in fused_operands:
                continue
            uses = [c for c, _ in g.consumers(o) if mine is None or c in mine]
            fold = folded_into.get(o)
            if fold is not None and fold[0] in uses:
                uses = [fold[1] if c == fold[0] else c for c in uses]
            stop = end if o in outputs else max((read_at[c] for c in uses), default=n.id)
            if len(uses) == 1 and g.nodes[uses[0]].primitive in _IN_PLACE and o not in outputs \
                    and (g.nodes[uses[0]].inputs[0] == o or fold is not None):
                stop = uses[0] - 1  # a scatter's result takes over its operand's buffer
            kind = "gradients" if n.backward and n.id in cm.tail else "activations"
            saved = not n.backward and any(g.nodes[c].backward for c in uses)
            buffers.append((n.id, o, stop, kind, o in outputs, saved,
                            hoists and n.id in from_arguments))
    received_out = []
    if mine is not None:  # what other stages send: a buffer from its first use to its last here
        produced = {o for n in walked for o in n.outputs}
        received: dict[int, list[int]] = {}
        for n in walked:
            for v in n.inputs:
                if v is not None and v not in produced and g.values[v].producer is not None:
                    received.setdefault(v, []).append(n.id)
        for v, uses in received.items():
            if not g.values[v].shape:
                continue
            saved = not g.nodes[uses[0]].backward and g.nodes[uses[-1]].backward
            received_out.append((v, uses[0], uses[-1], saved))
    # Matmul operands XLA first copies into its canonical dimension order. Layout assignment
    # makes the copy where the operand is made (a parameter's at the start of the step), not
    # where the matmul reads it: the copy of a weight or of a saved activation that a backward
    # matmul reads transposed is live from then on. An operand nothing else reads is made in
    # the matmul's order directly: its copy is a transient at the matmul.
    relaid = []
    for n in walked:
        if n.name != "dot_general":
            continue
        (lc, rc), (lb, rb) = n.params["dimension_numbers"]
        for k, (contract, batch) in enumerate(((lc, lb), (rc, rb))):
            v = n.inputs[k]
            if v is None:
                continue
            rank = len(g.values[v].shape)
            free_dims = [d for d in range(rank) if d not in contract and d not in batch]
            order = [*batch, *free_dims, *contract] if k == 0 else [*batch, *contract, *free_dims]
            if order != list(range(rank)) and (
                    k == 0 or [*batch, *free_dims, *contract] != list(range(rank))):
                producer = g.values[v].producer
                if producer is None:
                    start = first
                elif any(c != n.id for c, _ in g.consumers(v)):
                    start = producer
                else:
                    start = n.id
                relaid.append((n.id, k, v, tuple(order), start))
    sk = _Skeleton(free_uses, tuple(buffers), first, tuple(received_out), tuple(relaid))
    g.memo[key] = (cm, sk)
    return sk


def _graph_facts(g):
    """``(carried results, step results, fusible per node, values that are buffers, nodes
    computed from the step's state and constants alone, not from its batch)`` of a graph: a
    result is a buffer unless it is written into a donated argument or is its operand
    (pass-through), or a fusion keeps it in registers (a fusible operator's result that only
    fusing operators read, and that is no expensive result read twice)."""
    carried = {g.outputs[o] for o in g.carried.values()}
    outputs = {v for v in g.outputs if v is not None}
    fusible = [n.primitive in FUSIBLE for n in g.nodes]

    copies = host_copies(g)
    folds = _scatter_folds(g, carried, outputs)
    folded = {v for f in folds.values() for v in (f[2], f[3])}  # the adds' and the zeros'
    operands = {f[1] for f in folds.values()}  # the other addends: the scatters' operands now

    def materialized(n, o, fold=True) -> bool:
        if n.id in copies:  # a copy into the other memory space: a buffer of its own
            return o not in carried
        if fold and o in folded:  # the scatter's buffer / fused into the scatter's operand
            return False
        if fold and o in operands:  # the scatter writes into it
            return True
        if o in carried or n.primitive in PASSTHROUGH:  # written into the donated argument /
            return False  # the operand's own buffer
        if o in outputs:
            return True
        if not fusible[n.id]:
            return True
        users = g.consumers(o)
        if len(users) > 1 and n.primitive in EXPENSIVE:  # not worth recomputing in every user
            return True
        return any(g.nodes[c].primitive not in _FUSES_INPUTS for c, _ in users)

    buffers = frozenset(o for n in g.nodes for o in n.outputs if materialized(n, o))
    # where a fold does not apply (a stage's program without its scatter): as without it
    unfolded = {v: materialized(g.nodes[g.values[v].producer], v, fold=False)
                for f in folds.values() for v in f[1:]}
    # What exists before the step sees its batch: parameters, optimizer state, constants.
    known = {v for v, role in zip(g.inputs, g.input_roles) if role != DATA} | set(g.constants)
    from_arguments = set()
    for n in g.nodes:  # in program order: producers first
        if not n.subgraphs and all(v is None or v in known for v in n.inputs):
            from_arguments.add(n.id)
            known.update(n.outputs)
    return carried, outputs, fusible, buffers, frozenset(from_arguments), folds, unfolded


_ADDS = handles("add", "add_jaxvals")
_SCATTER_ADD = handles("scatter_add")
_BROADCAST = handles("broadcast_in_dim")


def _scatter_folds(g, carried, outputs) -> dict[int, tuple[int, int, int, int]]:
    """``{add node: (scatter node, other addend, the add's result, the scatter's zeros)}``:
    the sums of a scatter-add into a broadcast literal (the zeros JAX's transpose of a gather
    starts from: a cross-entropy's logits gradient, a tied embedding's) and another value.

    XLA's algebraic simplifier rewrites ``A + scatter(B, I, U)`` (a scatter that sums, read by
    that add alone) into ``scatter(A + B, I, U)``; ``B`` a broadcast literal, ``A + B`` is one
    fusion: the scatter's operand, which it writes into, and no buffer holds the zeros or the
    add's result (the scatter's is the sum). Where ``A`` is elementwise, that fusion computes it
    where the scatter runs (its operands are read there); else ``A``'s buffer is the operand,
    until the scatter takes it over. Compiled by XLA:CPU, optax's cross-entropy gradient holds
    two logits-sized buffers at its peak, not three (``tests/cost/test_memory.py``)."""
    folds = {}
    for n in g.nodes:
        if n.primitive not in _ADDS or n.subgraphs or len(n.inputs) != 2 or None in n.inputs:
            continue
        found = []
        for k in (0, 1):
            s_val, x_val = n.inputs[k], n.inputs[1 - k]
            sp, xp = g.values[s_val].producer, g.values[x_val].producer
            if sp is None or xp is None or g.nodes[sp].primitive not in _SCATTER_ADD:
                continue
            scatter = g.nodes[sp]
            z_val = scatter.inputs[0]
            zp = None if z_val is None else g.values[z_val].producer
            if zp is None or g.nodes[zp].primitive not in _BROADCAST \
                    or any(v is not None for v in g.nodes[zp].inputs):
                continue  # not a broadcast literal
            if len(g.consumers(s_val)) != 1 or len(g.consumers(z_val)) != 1 or xp > sp \
                    or any(v in outputs or v in carried for v in (s_val, x_val, z_val)) \
                    or g.values[x_val].shape != g.values[s_val].shape \
                    or g.values[x_val].dtype != g.values[s_val].dtype:
                continue
            found.append((sp, x_val, n.outputs[0], z_val))
        if len(found) == 1 and n.outputs[0] not in outputs and n.outputs[0] not in carried:
            folds[n.id] = found[0]
    return folds



def _operand(g, nid: int, vid: int) -> int:
    return next(k for k, v in enumerate(g.nodes[nid].inputs) if v == vid)
