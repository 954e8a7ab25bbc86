"""Local search over a cost model's groups: complete a partial assignment, improve one.

Used by the baselines (their input layouts fixed, operators completed in program order as a
propagating partitioner would: :func:`propagate`; ``expert``'s sequence parallelism on top:
:func:`sequence_parallel`) and by ``auto`` (coordinate descent from the
GNN's prior: :func:`coordinate_descent`; the neighbourhood of its plan that its next exact solve
searches: :func:`widen`).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from hulkjax.cost.model import INPUT, LEADER, CostModel
from hulkjax.plan.specs import dim_of
from hulkjax.rules.loops import LoopResolution


def neighbours(cm: CostModel) -> dict[int, list[tuple[int, bool]]]:
    """``{group: [(other group, other is the producer), ...]}``. A state result going back to
    its own group's input layout is an edge of the group to itself: listed once, as
    ``(group, True)``."""
    nb: dict[int, list[tuple[int, bool]]] = defaultdict(list)
    for (gp, gc), _ in cm.edge_items():
        nb[gc].append((gp, True))
        if gp != gc:
            nb[gp].append((gc, False))
    return nb


def local_cost(cm: CostModel, nb, gid: int, c: int, assignment) -> float:
    """The part of the objective that depends on group ``gid``'s candidate: its table, its
    edges (without the shared values' readers) and the shared values it makes or reads, whose
    changes are charged once per layout (:meth:`CostModel.shared_time`)."""
    t = cm.table_time(gid, c)
    for other, is_producer in nb.get(gid, ()):
        if other == gid:  # its own state result, back to its input's layout: both ends are c
            t += cm.edge_time(gid, c, gid, c, shared=False)
        elif is_producer:
            t += cm.edge_time(other, assignment[other], gid, c, shared=False)
        else:
            t += cm.edge_time(gid, c, other, assignment[other], shared=False)
    for v in cm.shared_of_group.get(gid, ()):
        t += cm.shared_time(v, assignment, gid, c)
    return t


def local_costs(cm: CostModel, nb, gid: int, assignment, cands=None, *,
                exact: bool = True) -> np.ndarray:
    """:func:`local_cost` of each of ``cands`` (every candidate by default) of group ``gid``, the
    other groups on their ``assignment`` candidates: an edge is a column of its matrix
    (:meth:`CostModel.edge_matrix`, cached per edge class, so repeated layers share it).
    ``exact=False`` charges a shared value's layout changes per reader, as a heuristic that looks
    at one edge at a time does (an upper bound of the shared terms, several times cheaper to
    compute: a ranking, not the objective's part)."""
    cands = list(range(len(cm.groups[gid].candidates))) if cands is None else list(cands)
    t = np.array([cm.table_time(gid, c) for c in cands])
    for other, is_producer in nb.get(gid, ()):
        if other == gid:  # its own state result, back to its input's layout: both ends are c
            t += [cm.edge_time(gid, c, gid, c, shared=not exact) for c in cands]
        elif is_producer:
            t += cm.edge_matrix(other, gid, [assignment[other]], cands, shared=not exact)[0]
        else:
            t += cm.edge_matrix(gid, other, cands, [assignment[other]], shared=not exact)[:, 0]
    if exact:
        for v in cm.shared_of_group.get(gid, ()):
            t += cm.shared_times(v, assignment, gid, cands)
    return t


def axis_roles(cm: CostModel, gid: int) -> list[tuple | None]:
    """Per candidate of group ``gid``, what it does on each mesh axis: the dimension the axis
    splits (an input's layout), or for an operator the dimension it splits of each operand and
    result and the collectives it runs over the axis (``None``: a loop's body plan, or a group
    without choices). Two candidates a plan could swap one axis at a time differ in one entry."""
    grp = cm.groups[gid]
    axes = cm.mesh.axis_names
    if grp.kind == INPUT:
        return [tuple(dim_of(c, a) for a in axes) for c in grp.candidates]
    if grp.kind != LEADER or isinstance(grp.candidates[0], LoopResolution):
        return [None] * len(grp.candidates)
    out = []
    for r in grp.candidates:
        out.append(tuple(
            (tuple(None if x is None else dim_of(x, a) for x in r.in_specs),
             tuple(None if x is None else dim_of(x, a) for x in r.out_specs),
             tuple(sorted(m.kind for m in r.comms if a in m.axes)))
            for a in axes))
    return out


def widen(cm: CostModel, assignment: list[int], options: dict[int, list[int]], *, extra: int,
          nb=None, roles: dict | None = None) -> tuple[dict[int, list[int]], int]:
    """``options`` (each group's shortlist; a group without an entry has its ``assignment``
    candidate only) widened around ``assignment``: the neighbourhood of a plan that an exact solve
    over it searches (large-neighbourhood search). Each group keeps its shortlist and
    ``assignment`` candidate and gets

    * its ``extra`` cheapest candidates by :func:`local_costs` given the others at
      ``assignment`` (shared values' changes charged per reader): what its neighbours' layouts
      make cheap;
    * every candidate that lays out all mesh axes as its ``assignment`` candidate does but one
      (:func:`axis_roles`): on a mesh of several axes an optimum can use one axis differently
      everywhere at once (the second axis of a tensor-parallel split, a weight gradient's extra
      split), a move no group makes alone, and one the solve can make when every group may.

    ``roles`` memoizes :func:`axis_roles` across calls (repeated layers share candidate lists).
    Returns the widened options and how many candidates were added.
    """
    nb = neighbours(cm) if nb is None else nb
    roles = {} if roles is None else roles
    out, added = {}, 0
    for grp in cm.groups:
        have = sorted({*options.get(grp.id, ()), assignment[grp.id]})
        if len(grp.candidates) <= len(have):
            out[grp.id] = list(have)
            continue
        new = set(have)
        if extra:
            t = local_costs(cm, nb, grp.id, assignment, exact=False)
            new.update(int(c) for c in np.argsort(t, kind="stable")[:extra])
        key = id(grp.candidates)
        rs = roles.get(key)
        if rs is None:
            rs = roles[key] = (grp.candidates, axis_roles(cm, grp.id))  # (kept alive for the id)
        rs = rs[1]
        mine = rs[assignment[grp.id]]
        if mine is not None:
            new.update(c for c, r in enumerate(rs)
                       if sum(x != y for x, y in zip(r, mine)) <= 1)
        added += len(new) - len(have)
        out[grp.id] = sorted(new)
    return out, added


def best_option(cm, nb, gid: int, a, options) -> int:
    """The candidate among ``options`` that makes group ``gid``'s local cost least with the other
    groups at ``a`` (its current one unless another is cheaper by more than rounding). Every
    option's local cost at once (its edges are columns of cached matrices): the others'
    candidates do not change while this group's are compared."""
    cands = [a[gid], *(c for c in options if c != a[gid])]
    costs = local_costs(cm, nb, gid, a, cands)
    best_c, best_t = a[gid], costs[0]
    for c, t in zip(cands[1:], costs[1:]):
        if t < best_t - 1e-15:
            best_c, best_t = c, t
    return best_c


def coordinate_descent(cm: CostModel, assignment: list[int], free: list[int], *,
                       sweeps: int = 4, candidates: dict[int, list[int]] | None = None) -> list[int]:
    """Re-pick each free group's best candidate given the others, until nothing improves."""
    nb = neighbours(cm)
    a = list(assignment)
    # A group's local costs read its neighbours' candidates and those of the groups sharing a
    # value with it (:func:`local_cost`). A group none of whose changed since it was last
    # evaluated would compute the same costs and keep its candidate (the one it took then):
    # it is evaluated again only after one of them changes. The sweeps make the same moves.
    watchers: dict[int, set[int]] = defaultdict(set)  # group -> groups whose costs read it
    for gid in free:
        for other, _ in nb.get(gid, ()):
            watchers[other].add(gid)
        for key in cm.shared_of_group.get(gid, ()):
            for other in cm.shared_groups(key):
                watchers[other].add(gid)
    stale = set(free)
    for _ in range(sweeps):
        changed = False
        for gid in free:
            if gid not in stale:
                continue
            stale.discard(gid)
            options = (candidates or {}).get(gid) or range(len(cm.groups[gid].candidates))
            best_c = best_option(cm, nb, gid, a, options)
            if best_c != a[gid]:
                a[gid] = best_c
                changed = True
                stale.update(watchers.get(gid, ()))
        if not changed:
            break
    return a


def finish_sums(cm: CostModel, assignment: list[int]) -> list[int]:
    """Each split operator's sum finished the cheapest way given its neighbours (all-reduce, or
    reduce-scatter onto any dimension: candidates with the same operand layouts), every other
    choice kept: a distributed optimizer's gradients reduce-scattered onto the shards of its
    state, where :func:`propagate`, deciding in program order, all-reduces them before it meets
    the state."""
    options: dict[int, list[int]] = {}
    for grp in cm.groups:
        if grp.kind != LEADER or isinstance(grp.candidates[0], LoopResolution):
            continue  # (a loop's candidates are whole body plans)
        mine = grp.candidates[assignment[grp.id]].in_specs
        same = [c for c, r in enumerate(grp.candidates) if r.in_specs == mine]
        if len(same) > 1:
            options[grp.id] = same
    return coordinate_descent(cm, assignment, sorted(options), sweeps=2, candidates=options)


def propagate(cm: CostModel, fixed: dict[int, int], *, param_use: str = "keep",
              gather_axes: tuple[str, ...] | None = None) -> list[int]:
    """Complete fixed input layouts the way a propagating partitioner does.

    Operators are visited in program order; each takes, among the candidates that change the
    layouts of its operands least (a partitioner propagates shardings: it neither undoes nor
    invents them; counted first, then their cost), the
    one cheapest in its own cost plus the layout changes into fixed groups it feeds (so a gradient
    is reduced to its parameter's layout). No global optimization: that is the ILP's job. Parameters keep the strategy's intent: with
    ``param_use="keep"`` an operator uses a parameter at the parameter's layout (no resharding of
    weights); with ``"gather"`` (ZeRO-3) it uses the whole parameter, gathered right before use.

    Repeated layers decide once: an operator whose group is of the table class of one decided
    before, with its operands arriving in the same layouts and its decided neighbours on the same
    candidates over edges of the same class (:meth:`CostModel.decision_key`), takes that group's
    candidate, which is what its own decision would compute (every number it compares is the
    same, added in the same order).
    """
    return _propagate(cm, fixed, param_use=param_use, gather_axes=gather_axes, share=True)


def _propagate(cm: CostModel, fixed: dict[int, int], *, param_use: str,
               gather_axes: tuple[str, ...] | None, share: bool) -> list[int]:
    """:func:`propagate`; ``share=False`` decides every group on its own (the tests' reference)."""
    a = cm.replicated_assignment()
    for gid, c in fixed.items():
        a[gid] = c
    decided = set(fixed) | {grp.id for grp in cm.groups if grp.kind not in (INPUT, LEADER)}
    nb = neighbours(cm)
    g = cm.graph
    decisions: dict[tuple, int] = {}  # decision_key -> the candidate taken
    for grp in sorted((x for x in cm.groups if x.kind == LEADER and x.id not in fixed),
                      key=lambda x: x.leader):
        node = g.nodes[grp.leader]
        wanted: dict[int, tuple] = {}
        for k, v in enumerate(node.inputs):
            if v is None:
                continue
            src = cm.group_of_value[v]
            sgrp = cm.groups[src]
            if sgrp.kind == INPUT and src in fixed and g.input_roles[sgrp.inputs[0]] == "parameter":
                spec = cm.spec(src, a[src], v)
                # A loop gathers parameter slices inside its body: it takes them as they are.
                gather = param_use == "gather" and not node.subgraphs
                if spec is not None:
                    wanted[k] = _gathered(spec, gather_axes) if gather else spec
        alike = None
        if share:
            alike = (cm.decision_key(grp.id, a, nb.get(grp.id, ()), decided, fixed),
                     tuple(sorted(wanted.items())))
            hit = decisions.get(alike)
            if hit is not None:
                a[grp.id] = hit
                decided.add(grp.id)
                continue
        scatter = _ScatterCheck(cm, nb, grp, fixed, a)
        # Fewest layout changes first, decided on the candidates alone; only those get costed.
        # (Among the candidates at the wanted layouts that the scatter check allows; it is asked
        # level by level, fewest changes first: it costs edges.)
        matching = [c for c, r in enumerate(grp.candidates)
                    if all(r.in_specs[k] == s for k, s in wanted.items())]
        made: list[bool] = []
        changes = dict(zip(matching, cm.operand_changes_of(grp.id, matching, node.id, a, made)))
        invents = dict(zip(matching, made))
        options = []
        for fewest in sorted(set(changes.values())):
            options = [c for c in matching if changes[c] == fewest and scatter.allowed(c)]
            if options:
                break
        if not options:
            options = list(range(len(grp.candidates)))
            rest = [c for c in options if c not in changes]
            made = []
            changes.update(zip(rest, cm.operand_changes_of(grp.id, rest, node.id, a, made)))
            invents.update(zip(rest, made))
            fewest = min(changes.values())
            options = [c for c in options if changes[c] == fewest]
        # A split that only constant-made operands take (a scatter's zeros cut to its rows) is
        # made where it saves moving what arrives (the rest of its group is split already), not
        # for its own cheaper work: what reads it later would have to gather it.
        best_c, best_key = options[0], (float("inf"), float("inf"), True, float("inf"))
        for c in options:
            arriving, rest = 0.0, cm.table_time(grp.id, c)
            for other, is_producer in nb.get(grp.id, ()):
                if other not in decided:
                    continue
                if is_producer:
                    arriving += cm.edge_time(other, a[other], grp.id, c)
                else:
                    rest += cm.edge_time(grp.id, c, other, a[other])
            key = (fewest, round(arriving, 15), invents.get(c, False), rest)
            if key[:3] < best_key[:3] or (key[:3] == best_key[:3] and key[3] < best_key[3] - 1e-15):
                best_c, best_key = c, key
        a[grp.id] = best_c
        decided.add(grp.id)
        if alike is not None:
            decisions[alike] = best_c
    return a


def sequence_parallel(cm: CostModel, assignment: list[int], axes: tuple[str, ...]
                      ) -> tuple[list[int], int]:
    """Megatron's sequence parallelism on a tensor-parallel ``assignment`` over ``axes``.

    Tensor parallelism leaves the regions between a row-parallel matmul and the next
    column-parallel one (residual adds, norms) replicated over the tensor-parallel axes: every
    device of a group computes and stores them whole. Sequence parallelism (Korthikanti et al.,
    2022; NeMo's ``sequence_parallel``) splits them along the sequence instead: the row-parallel
    matmul's partial sums are reduce-scattered onto the sequence rather than all-reduced, and the
    next column-parallel matmul all-gathers its input (the same bytes on the wire as the
    all-reduce; the norms' work and activations divided by the group).

    From what the operators are: a leader whose candidate all-reduces partial sums over exactly
    ``axes`` (a row-parallel matmul forward; a column-parallel one's input gradient backward)
    with a rank-3 result ``(batch, sequence, features)`` takes the same operand layouts with the
    sum reduce-scattered onto dimension 1 (the sequence: between the batch, split by the data
    axes, and the features), where ``axes`` divide it. Then the leaders whose results meet those
    sums in that shape (the residual stream's: the embedding lookup's group, which the residual
    adds follow) are split on it too, with the fewest operand layouts changed. Every other group
    keeps its candidate: what reads the split activations pays the all-gather on its edge, as
    the recipe's program does. Layers inside a loop (one ``scan``) keep the loop's candidate.

    Returns ``(assignment, reductions reduce-scattered)``; the assignment is a new list.
    """
    a = list(assignment)
    want = frozenset(axes)
    n_axes = math.prod(cm.mesh.sizes[ax] for ax in axes)
    g = cm.graph

    def target(spec, shape) -> tuple | None:
        if len(shape) != 3 or spec[1] or shape[1] % n_axes or any(
                x in want for e in spec for x in e):
            return None
        return (spec[0], tuple(axes), spec[2])

    def split(gid: int, tgt: tuple, *, same_operands: bool = False) -> int | None:
        """The candidate of group ``gid`` with result layout ``tgt`` that changes the fewest
        operand layouts of its current one (``same_operands``: none)."""
        grp = cm.groups[gid]
        r = grp.candidates[a[gid]]
        changes = {c: sum(x != y for x, y in zip(o.in_specs, r.in_specs))
                   for c, o in enumerate(grp.candidates) if o.out_specs[0] == tgt}
        if same_operands:
            changes = {c: n for c, n in changes.items() if n == 0}
        return min(changes, key=lambda c: (changes[c], c), default=None)

    pinned: dict[int, tuple[int, ...]] = {}  # group -> the shape of its split result
    for grp in cm.groups:
        if grp.kind != LEADER or isinstance(grp.candidates[0], LoopResolution):
            continue
        r = grp.candidates[a[grp.id]]
        if len(r.comms) != 1 or r.comms[0].kind != "all-reduce" or set(r.comms[0].axes) != want:
            continue
        shape = g.values[g.nodes[grp.leader].outputs[0]].shape
        tgt = target(r.out_specs[0], shape)
        if tgt is None:
            continue
        # The same operands, the result split where the sum was whole: the reduce-scatter.
        c = split(grp.id, tgt, same_operands=True)
        if c is not None and grp.candidates[c].scatters:
            a[grp.id] = c
            pinned[grp.id] = shape
    reduced = len(pinned)
    # The residual stream: leaders whose results meet the split sums in their shape, through
    # the followers of either (a residual add follows one of its operands' groups).
    stream: dict[int, tuple[int, ...]] = {}
    for gid, shape in pinned.items():
        grp = cm.groups[gid]
        for nid in (grp.leader, *grp.members):
            node = g.nodes[nid]
            near = [v for v in node.inputs if v is not None]
            near += [v for o in node.outputs for c, _ in g.consumers(o)
                     for v in g.nodes[c].inputs if v is not None]
            for v in near:
                other = cm.group_of_value.get(v)
                if other is None or other in pinned or cm.groups[other].kind != LEADER or \
                        isinstance(cm.groups[other].candidates[0], LoopResolution):
                    continue
                if g.values[v].shape == shape:
                    stream.setdefault(other, shape)
    for gid, shape in stream.items():
        grp = cm.groups[gid]
        if g.values[g.nodes[grp.leader].outputs[0]].shape != shape:
            continue
        tgt = target(grp.candidates[a[gid]].out_specs[0], shape)
        c = None if tgt is None else split(gid, tgt)
        if c is not None:
            a[gid] = c
    return a, reduced


def _gathered(spec: tuple, axes: tuple[str, ...] | None) -> tuple:
    """``spec`` gathered over ``axes`` (``None``: over every axis, i.e. replicated)."""
    if axes is None:
        return tuple(() for _ in spec)
    return tuple(tuple(x for x in e if x not in axes) for e in spec)


class _ScatterCheck:
    """Partial sums are all-reduced unless a fixed layout downstream (a parameter's) receives the
    scattered result more cheaply: a partitioner reduce-scatters only on request."""

    def __init__(self, cm: CostModel, nb, grp, fixed, a):
        self.cm, self.grp, self.a = cm, grp, a
        self.consumers = [o for o, is_producer in nb.get(grp.id, ()) if not is_producer and o in fixed]
        self._ar: dict[tuple, int] = {}
        self._out: dict[int, float] = {}
        for k, r in enumerate(grp.candidates):
            if not r.scatters and any(x.kind == "all-reduce" for x in r.comms):
                self._ar.setdefault(r.in_specs, k)

    def _out_cost(self, cand: int) -> float:
        t = self._out.get(cand)
        if t is None:
            t = self._out[cand] = sum(self.cm.edge_time(self.grp.id, cand, o, self.a[o])
                                      for o in self.consumers)
        return t

    def allowed(self, c: int) -> bool:
        r = self.grp.candidates[c]
        if not r.scatters:
            return True
        sibling = self._ar.get(r.in_specs)
        if sibling is None:
            return True
        return bool(self.consumers) and self._out_cost(c) < self._out_cost(sibling) - 1e-15


def polish_memory(cm: CostModel, assignment: list[int], *, rel: float = 1e-12,
                  candidates: dict[int, list[int]] | None = None) -> list[int]:
    """Among candidates that leave the objective unchanged, take the smallest memory footprint
    (over ``candidates[group]`` when given, else every candidate)."""
    nb = neighbours(cm)
    a = list(assignment)
    for grp in cm.groups:
        gid = grp.id
        options = (candidates or {}).get(gid)
        if options is None:
            options = range(len(grp.candidates))
        here = local_cost(cm, nb, gid, a[gid], a)
        tol = rel * max(here, 1e-30) + 1e-18
        best, best_mem = a[gid], cm.table(gid, a[gid]).memory
        for c in options:
            mem = cm.table(gid, c).memory
            if mem < best_mem and local_cost(cm, nb, gid, c, a) <= here + tol:
                best, best_mem = c, mem
        a[gid] = best
    return a
