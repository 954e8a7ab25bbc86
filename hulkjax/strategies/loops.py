"""Loop bodies planned: ``scan``, ``while`` and ``cond`` as leaders whose candidates are shardings of
their bodies; and the cost model every planner shares, with this planner injected.

Where this sits::

    OpGraph node (scan / while / cond, with node.subgraphs)            outer CostModel
            |  loop_candidates(node, graph, mesh, topology)   <--- injected as loop_planner
            v
    boundary (hulkjax.rules.loops) + hypotheses (replicated; batch split per mesh-axis subset;
    parameter slices sharded like fsdp / megatron / dp_tp would) --> each body planned with the
    same machinery: a CostModel of the body graph, completed by ``propagate`` as a baseline
    would (and refined by coordinate descent)
            |
            v
    LoopResolution: operand / result specs of the loop node, the body plans, and
    trip_count x (body compute + body collectives) + carry resharding per iteration

**Forward and backward scans as a pair.** The backward scan of a forward one reads its stacked
residuals (the forward's ``ys``) and its stacked parameters. Besides its own hypotheses it gets
one per candidate of the forward scan: its boundary in the layouts that candidate leaves (the
residuals as the forward body produces them, the parameters as it reads them), its body searched
from there. A forward body refined by search (or split for tensor parallelism) then has a
backward body that meets it without resharding the residuals, and the ILP, which prices the
edge between the two loop nodes, chooses the pair (GPT-2 tiny with its blocks in one scan on a
2 x 4 grid: 106.7 -> 92.7 us, the unrolled model 84.8 us). The rest of that gap is the scanned
program's own work (it writes the stacked residuals and reads them back), not the plan.

**Body roles.** A body input is a parameter (for the baselines' recipes: kept in place or gathered
before use) when the loop operand it comes from is derived from state (a parameter or optimizer
state input, through casts and reshapes); otherwise it is data (its leading dimension is the
batch).

>>> import jax, jax.numpy as jnp, hulkjax as hj
>>> def f(w, x):
...     return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0].sum()
>>> g = hj.trace(f, jnp.ones((3, 16, 16)), jnp.ones((8, 16)))
>>> cm = cost_model(g, hj.Topology.grid((2,), ("d",)))
>>> [r.label for r in cm.groups[cm.group_of_node[0]].candidates][:2]
['replicated', 'batch:d']
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hulkjax.cost.memory import liveness
from hulkjax.cost.model import INPUT, LEADER, CostModel
from hulkjax.plan.collectives import Comm
from hulkjax.plan.records import BodyPlan
from hulkjax.plan.specs import Spec, divides, from_pspec, replicated, to_pspec
from hulkjax.rules.loops import Boundary, LoopBody, LoopResolution, boundary
from hulkjax.rules.sharding import Mesh, Resolution
from hulkjax.strategies.layouts import InputLayouts, shard_parameters, split_batch, tensor_parallel
from hulkjax.strategies.search import coordinate_descent, local_cost, neighbours, propagate
from hulkjax.trace.graph import DATA, OPTIMIZER, PARAMETER, Node, OpGraph
from hulkjax.trace.primitives import VIEWS

MAX_LOOP_CANDIDATES = 32  # per loop node from its own hypotheses (the replicated one included)


def cost_model(graph: OpGraph, topology, *, optimizer_apart: bool = False) -> CostModel:
    """The cost model of (graph, topology), loop bodies planned by :func:`loop_candidates`; built
    once and kept on the graph, so every planner of one step judges with the same tables.
    ``optimizer_apart``: optimizer state decided apart from its parameter (the distributed
    optimizer; :class:`~hulkjax.cost.CostModel`), a model of its own.

    >>> import jax.numpy as jnp, hulkjax as hj
    >>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4)))
    >>> topo = hj.Topology.grid((8,), ("d",))
    >>> cost_model(g, topo) is cost_model(g, topo)
    True
    """
    cache = graph.memo.setdefault("cost_models", {})
    key = (topology, "optimizer apart") if optimizer_apart else topology
    cm = cache.get(key)
    if cm is None:
        cm = cache[key] = CostModel(
            graph, topology, loop_planner=functools.partial(loop_candidates, topology=topology),
            optimizer_apart=optimizer_apart)
    return cm


# ---- body views ------------------------------------------------------------------------------

def _from_state(graph: OpGraph, vid: int | None) -> bool:
    """Whether a value is (a view of) a state input: a parameter or optimizer state."""
    index = graph.memo.get("input_index")
    if index is None:
        index = graph.memo["input_index"] = {v: i for i, v in enumerate(graph.inputs)}
    while vid is not None:
        v = graph.values[vid]
        if v.producer is None:
            i = index.get(vid)
            return i is not None and i < len(graph.input_roles) and \
                graph.input_roles[i] in (PARAMETER, OPTIMIZER)
        node = graph.nodes[v.producer]
        if node.primitive not in VIEWS:
            return False
        vid = node.inputs[0]
    return False


def _body_view(sub: OpGraph, roles: tuple[str, ...], carries) -> OpGraph:
    """The body graph with loop roles and carries ``((body output, body input), ...)``, cached on
    the tracer's sub-graph."""
    key = (roles, carries)
    views = sub.memo.setdefault("loop_views", {})
    view = views.get(key)
    if view is None:
        view = OpGraph(nodes=sub.nodes, values=sub.values, inputs=sub.inputs, outputs=sub.outputs,
                       input_paths=sub.input_paths, output_paths=sub.output_paths, in_tree=None,
                       out_tree=None, jaxpr=sub.jaxpr, constants=sub.constants, input_roles=roles)
        view.carried = {j: i for i, j in carries if sub.outputs[i] is not None}
        view.owners = {}
        view.loop_body = True
        views[key] = view
    return view


# ---- hypotheses --------------------------------------------------------------------------------


def _axes_subsets(axes: Sequence[str]) -> list[tuple[str, ...]]:
    return [c for r in range(1, len(axes) + 1) for c in itertools.combinations(axes, r)]


def _hypotheses(b: Boundary, views: list[OpGraph], state: list[bool], topology):
    """``[(label, spec per operand, param_use)]``: the boundary layouts to plan the bodies for."""
    axes = tuple(topology.axis_names)
    main = views[b.main]
    main_in = b.inputs[b.main]

    def fresh():
        return InputLayouts(main, topology, "loop")

    def to_slots(sb: InputLayouts, batch_axes: tuple[str, ...]) -> list[Spec | None]:
        out: list[Spec | None] = []
        for k, shape in enumerate(b.slots):
            if shape is None:
                out.append(None)
            elif b.fixed[k]:
                out.append(replicated(len(shape)))
            elif k in main_in:
                out.append(from_pspec(sb.input_specs[main_in.index(k)], len(shape)))
            elif not state[k] and shape and batch_axes:  # an operand only another body reads
                out.append(from_pspec(sb.dim_spec(shape, 0, batch_axes), len(shape)))
            else:
                out.append(replicated(len(shape)))
        return out

    hyps = []
    hyps.append(("replicated", to_slots(fresh(), ()), "keep"))
    for sub_axes in _axes_subsets(axes):
        sb = fresh()
        split_batch(sb, sub_axes)
        hyps.append((f"batch:{','.join(sub_axes)}", to_slots(sb, sub_axes), "keep"))
    sb = fresh()
    split_batch(sb, axes)
    shard_parameters(sb, axes)
    hyps.append(("fsdp", to_slots(sb, axes), "gather"))
    tp_sets = [(a,) for a in axes] + ([axes] if len(axes) > 1 else [])
    for model in tp_sets:
        sb = fresh()
        tensor_parallel(sb, model)
        hyps.append((f"megatron:{','.join(model)}", to_slots(sb, ()), "keep"))
        data = tuple(a for a in axes if a not in model)
        if data:
            sb = fresh()
            split_batch(sb, data)
            tensor_parallel(sb, model)
            hyps.append((f"dp_tp:{','.join(data)}|{','.join(model)}", to_slots(sb, data), "keep"))
    return hyps


# ---- planning the bodies -------------------------------------------------------------------------


def _complete(bcm, specs: Sequence[Spec], param_use: str, improve: bool,
              propagated: dict) -> list[int]:
    """The body completed from its input layouts, as a propagating partitioner would; with
    ``improve``, then each body operator re-chosen given the others (the boundary stays).
    ``propagated`` memoizes the propagation per body and input layouts (a hypothesis is
    completed without and then with ``improve``, from the same propagation)."""
    fixed = {grp.id: bcm.input_candidate(grp.id, specs[grp.inputs[0]])
             for grp in bcm.groups if grp.kind == INPUT}
    key = (id(bcm), tuple(fixed.items()), param_use)
    a = propagated.get(key)
    if a is None:
        a = propagated[key] = propagate(bcm, fixed, param_use=param_use)
    if improve:
        return coordinate_descent(bcm, a, [grp.id for grp in bcm.groups if grp.kind == LEADER])
    return list(a)  # (the caller may change it: _to_exits)


def _gradients(node: Node, graph: OpGraph, b: Boundary, state: list[bool]) -> dict[int, list[int]]:
    """``{body output: [operand, ...]}``: a backward scan's ``ys`` that are the per-layer
    gradients of stacked parameters, each with the stacked state operands of its per-iteration
    shape and dtype (the parameters it can be the gradient of)."""
    if b.kind != "scan" or not node.backward:
        return {}
    view = node.subgraphs[b.main]
    params: dict[tuple, list[int]] = {}
    for k, v in enumerate(node.inputs):
        if v is not None and state[k] and b.stacked[k] and b.slots[k]:
            params.setdefault((b.slots[k], graph.values[v].dtype), []).append(k)
    out = {}
    for kind, idx in b.results:
        vid = view.outputs[idx] if kind == "out" else None
        if vid is not None:
            val = view.values[vid]
            ks = params.get((tuple(val.shape), val.dtype))
            if ks:
                out[idx] = ks
    return out


def _to_exits(bcm, a: list[int], exits: dict[int, Spec]) -> list[int]:
    """Each result with an exit layout produced in it where that is cheaper than producing it
    otherwise and resharding after (a gradient reduce-scattered to its parameter's layout rather
    than all-reduced, as a partitioner does on request): the producing group takes, among its
    candidates that make the result in its exit layout, the one cheapest with its neighbours."""
    view = bcm.graph
    nb = None
    for i, spec in exits.items():
        vid = view.outputs[i]
        gid = None if vid is None else bcm.group_of_value.get(vid)
        if gid is None or bcm.groups[gid].kind != LEADER:
            continue
        now = bcm.spec(gid, a[gid], vid)
        if now is None or now == spec:
            continue
        nb = nb if nb is not None else neighbours(bcm)
        best = local_cost(bcm, nb, gid, a[gid], a) + \
            sum(bcm.comm_time(cm) for cm in bcm.reshard(vid, now, spec, direct=True))
        choice = a[gid]
        for c in range(len(bcm.groups[gid].candidates)):
            if c != a[gid] and bcm.spec(gid, c, vid) == spec:
                t = local_cost(bcm, nb, gid, c, a)
                if t < best - 1e-15:
                    best, choice = t, c
        a[gid] = choice
    return a


@dataclass
class _BodyCost:
    compute: float
    comms: list[Comm]
    program: list[Comm]
    memory: float
    time: float
    specs: dict[int, Spec]


def _body_cost(bcm, a: Sequence[int], exits: dict[int, Spec]) -> _BodyCost:
    """One execution of a body: compute, collectives (with the resharding of results to their exit
    layouts, ``{body output: spec}``), transient memory."""
    view = bcm.graph
    compute = sum(bcm.local(gid, c).compute for gid, c in enumerate(a))
    comms = bcm.assignment_comms(a)
    program = bcm.program_comm_list(a)
    specs = bcm.value_specs(a)
    for i, spec in exits.items():
        vid = view.outputs[i]
        if vid is None or specs.get(vid) is None or i in view.carried.values():
            continue  # carries are charged by the body's carried edges already
        extra = bcm.reshard(vid, specs[vid], spec, direct=True)
        comms.extend(extra)
        program.extend(extra)
    # One iteration's transient: the body's own liveness walk (the parameters it gathers, what
    # its backward part reads, fused chains as one buffer, values made from constants in the
    # layout their readers need) less the body's arguments, which are the loop's operands and
    # carry: held outside the loop, and counted there.
    walk = liveness(bcm, a)
    memory = walk.peak - sum(buf.bytes for buf in walk.live if buf.node is None)
    time = compute + sum(bcm.comm_time(cm) for cm in comms)
    return _BodyCost(compute, comms, program, memory, time, specs)


def _resolve(node: Node, graph: OpGraph, b: Boundary, views: list[OpGraph], bcms: list,
             slot_specs: list[Spec | None], param_use: str, label: str, mesh: Mesh,
             rep_compute: float | None, improve: bool, grads: dict[int, list[int]],
             propagated: dict, seen: set) -> LoopResolution | None:
    """The loop's candidate for one boundary hypothesis (``slot_specs``), or ``None`` where a
    layout does not divide its operand or (``seen``: the keys of the candidates made so far) it
    repeats one already made, its layouts and body plans alike: found before its bodies are
    costed. ``propagated``: :func:`_complete`'s memo."""
    if not all(s is None or divides(shape, s, mesh.sizes)
               for shape, s in zip(b.slots, slot_specs)):
        return None
    # A backward scan's parameter gradients leave the body in their parameters' layouts (where
    # every parameter of that shape has one, and it is split): the body reduce-scatters them as
    # its forward counterpart gathers the parameters, and the stacked gradients come out split
    # like them.
    to_params: dict[int, Spec] = {}
    for idx, ks in grads.items():
        found = {slot_specs[k] for k in ks if slot_specs[k] is not None}
        if len(found) == 1 and any(spec := found.pop()):  # replicated: as produced
            to_params[idx] = spec
    plans = []
    for bi, bcm in enumerate(bcms):
        ins = [slot_specs[k] if slot_specs[k] is not None else replicated(len(b.slots[k] or ()))
               for k in b.inputs[bi]]
        a = _complete(bcm, ins, param_use, improve, propagated)
        if bi == b.main and to_params:
            a = _to_exits(bcm, a, to_params)
        plans.append((ins, a))
    # Results: carries keep the carry-in layout; scan ys and cond results come out as produced
    # (a cond's: as its main branch produces them).
    specs = [bcm.value_specs(a) for bcm, (_, a) in zip(bcms, plans)]
    out_specs: list[Spec] = []
    exits: list[dict[int, Spec]] = [{} for _ in views]
    for r, (kind, idx) in enumerate(b.results):
        rank = len(graph.values[node.outputs[r]].shape)
        if kind == "carry":
            spec = slot_specs[idx] or replicated(rank)
            out_specs.append(spec)
            for bi, carries in enumerate(b.carries):
                for o, k in carries:
                    if k == idx:
                        exits[bi][o] = spec
            continue
        main_vid = views[b.main].outputs[idx]
        s = specs[b.main].get(main_vid) if main_vid is not None else None
        if b.kind == "scan":
            if idx in to_params:
                s = to_params[idx]
            spec = ((),) + s if s is not None else replicated(rank)
            exits[0][idx] = spec[1:]
        else:
            spec = s if s is not None else replicated(rank)
            for bi in range(len(views)):
                exits[bi][idx] = spec
        out_specs.append(spec)
    in_specs = []
    for k, v in enumerate(node.inputs):
        s = slot_specs[k]
        if v is None:
            in_specs.append(None)
        elif s is None:
            in_specs.append(replicated(len(graph.values[v].shape)))
        else:
            in_specs.append(((),) + s if b.stacked[k] else s)
    key = (tuple(in_specs), tuple(out_specs), tuple(tuple(a) for _, a in plans))
    if key in seen:
        return None
    seen.add(key)
    costs = [_body_cost(bcm, a, ex) for bcm, (_, a), ex in zip(bcms, plans, exits)]
    trips = max(int(node.trip_count), 1)
    if b.kind == "cond":
        worst = max(range(len(costs)), key=lambda i: costs[i].time)
        compute, comms = costs[worst].compute, costs[worst].comms
        iteration = [cm for c in costs for cm in c.program]  # every branch is in the program
        program, trips = iteration, 1
        memory = max(c.memory for c in costs)
    else:
        compute = trips * sum(c.compute for c in costs)
        comms = [cm for c in costs for cm in c.comms] * trips
        iteration = [cm for c in costs for cm in c.program]
        program = iteration * trips
        memory = max(c.memory for c in costs)
    bodies = tuple(
        LoopBody(graph=view, cost_model=bcm, assignment=tuple(a), inputs=tuple(ins),
                 outputs=tuple(ex.get(i) for i in range(len(view.outputs))))
        for view, bcm, (ins, a), ex in zip(views, bcms, plans, exits))
    shards = 1 if not compute or rep_compute is None else max(1, round(rep_compute / compute))
    return LoopResolution(in_specs=tuple(in_specs), out_specs=tuple(out_specs), comms=tuple(comms),
                          shards=shards, label=label, compute=compute, memory=memory,
                          program_comms=tuple(program), iteration_comms=tuple(iteration),
                          trips=trips, bodies=bodies)


def loop_candidates(node: Node, graph: OpGraph, mesh: Mesh, topology) -> list[Resolution]:
    """A loop node's candidates: the replicated body first, then one per distinct body plan of
    the boundary hypotheses, then (a loop that reads another loop's results: the backward scan
    of a forward one) one mirroring each of that loop's candidates (``[]`` for a node without
    a loop rule or bodies). Memoized on the graph: the loop it mirrors is planned once."""
    memo = graph.memo.setdefault("loop_candidates", {})
    key = (node.id, mesh, topology)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _loop_candidates(node, graph, mesh, topology)
    return hit


def _partner(node: Node, graph: OpGraph) -> Node | None:
    """The loop whose results this loop reads most (a backward scan: its forward scan, whose
    stacked ``ys`` are the residuals it consumes), or ``None``."""
    count: dict[int, int] = {}
    for v in node.inputs:
        p = None if v is None else graph.values[v].producer
        if p is not None and p != node.id and graph.nodes[p].primitive == node.primitive \
                and graph.nodes[p].subgraphs:
            count[p] = count.get(p, 0) + 1
    if not count:
        return None
    return graph.nodes[max(count, key=lambda p: (count[p], -p))]


def _mirrors(node: Node, graph: OpGraph, b: Boundary, base: dict, mesh: Mesh, topology):
    """``[(label, spec per operand, param_use)]``: for each candidate of the loop this one reads
    (:func:`_partner`), this loop's boundary in the layouts that candidate leaves: its results
    (the residuals) as it produces them, the operands both loops read (stacked parameters) as it
    reads them, the others (the cotangent carry) as the same-named hypothesis of this loop has
    them. Planned with this loop's body search, such a candidate is the backward body that
    mirrors a forward body plan, ``+search`` ones included: the pair meets without resharding
    the residuals, which candidates built from each loop's hypotheses alone rarely do."""
    partner = _partner(node, graph)
    if partner is None:
        return []
    outs = {v: r for r, v in enumerate(partner.outputs)}
    ins = {v: k for k, v in enumerate(partner.inputs) if v is not None}
    hyps = []
    for rf in loop_candidates(partner, graph, mesh, topology):
        if not isinstance(rf, LoopResolution):
            continue
        name = rf.label.removesuffix("+search")
        if name not in base:
            continue
        own, param_use = base[name]
        slots: list[Spec | None] = []
        for k, v in enumerate(node.inputs):
            spec = rf.out_specs[outs[v]] if v in outs else \
                rf.in_specs[ins[v]] if v in ins else None
            if spec is not None and b.stacked[k]:  # per iteration: without the stacked dim
                spec = spec[1:] if not spec[0] else None
            slots.append(own[k] if spec is None else spec)
        if slots != list(own):  # else: this loop's own hypothesis, planned already
            hyps.append((f"mirror({rf.label})", slots, param_use))
    return hyps


def _loop_candidates(node: Node, graph: OpGraph, mesh: Mesh, topology) -> list[Resolution]:
    b = boundary(node, graph)
    if b is None:
        return []
    state = [_from_state(graph, v) for v in node.inputs]
    views, bcms = [], []
    for bi, sub in enumerate(node.subgraphs):
        roles = tuple(PARAMETER if state[k] else DATA for k in b.inputs[bi])
        carries = tuple((o, b.inputs[bi].index(k)) for o, k in b.carries[bi])
        view = _body_view(sub, roles, carries)
        views.append(view)
        bcms.append(cost_model(view, topology))
    out: list[Resolution] = []
    seen = set()
    rep_compute = None
    hyps = _hypotheses(b, views, state, topology)
    tries = [(h, improve) for h in hyps for improve in (False, True)]
    mirrors = _mirrors(node, graph, b, {label: (slots, use) for label, slots, use in hyps},
                       mesh, topology)
    tries += [(h, improve) for h in mirrors for improve in (False, True)]
    grads = _gradients(node, graph, b, state)
    own = 0  # candidates of this loop's own hypotheses (mirrors have a budget of their own)
    propagated: dict = {}
    for (label, slots, param_use), improve in tries:
        if improve and label == "replicated":
            continue
        mirror = label.startswith("mirror(")
        if not mirror and own >= MAX_LOOP_CANDIDATES:
            continue
        r = _resolve(node, graph, b, views, bcms, slots, param_use,
                     label + ("+search" if improve else ""), mesh, rep_compute, improve, grads,
                     propagated, seen)
        if r is None:
            continue
        if rep_compute is None:  # the first hypothesis is the replicated body
            rep_compute = r.compute
        out.append(r)
        own += not mirror
    return out


# ---- plans of the bodies, for the emitter ------------------------------------------------------


def body_plans(cm: CostModel, assignment) -> dict:
    """``{loop node id: (BodyPlan per sub-graph, ...)}`` for the loop leaders of an assignment."""
    out = {}
    for grp in cm.groups:
        if grp.kind != LEADER:
            continue
        r = grp.candidates[assignment[grp.id]]
        if isinstance(r, LoopResolution):
            out[grp.leader] = tuple(_body_plan(body) for body in r.bodies)
    return out


def _body_plan(body: LoopBody) -> BodyPlan:
    g, bcm, a = body.graph, body.cost_model, body.assignment
    operands, results = bcm.pinned_layouts(a)
    operand_specs, result_specs = (
        {key: to_pspec(s) for key, s in specs.items()} for specs in (operands, results))
    operand_paths = {key: tuple(to_pspec(s) for s in via)
                     for key, via in bcm.pinned_paths(a, operands).items()}
    inputs = {j: to_pspec(s) for j, (v, s) in enumerate(zip(g.inputs, body.inputs))
              if g.values[v].shape}
    outputs = {i: to_pspec(s) for i, (v, s) in enumerate(zip(g.outputs, body.outputs))
               if s is not None and v is not None and g.values[v].shape}
    return BodyPlan(inputs=inputs, outputs=outputs, operand_specs=operand_specs,
                    result_specs=result_specs, bodies=body_plans(bcm, a),
                    operand_paths=operand_paths)
