"""``strategy="ilp"``: the exact optimum of the cost model (Alpa-style integer program).

Variables: for each group class (repeated layers share one), a one-hot choice ``x_G`` over its
candidates; for each pair of classes joined by tensors, a coupling ``y_GH`` with marginals ``x_G``
and ``x_H`` (so ``y_GH[a, b] = x_G[a] x_H[b]`` at integral points). Objective: the cost model's
step time, ``sum_G t_G . x_G + sum_GH E_GH . y_GH``, exactly the sum :meth:`CostModel.objective`
computes. Constraint: per-device memory ``sum_G m_G . x_G <= capacity``. Solved with HiGHS
(``scipy.optimize.milp``) under a time limit; the plan's notes give the optimality gap. Among
plans of equal step time, a polishing pass then moves each group to its smallest-footprint
candidate that leaves the objective unchanged.

Groups with more than ``max_candidates`` candidates (3-axis meshes) are pruned to the cheapest by
their own time, always keeping the replicated one and every candidate a baseline uses, so the
optimum is never worse than any baseline (their assignments are in the search space); the notes say
when pruning happened. If the solver stops at its time limit above a baseline, that baseline's
plan is returned (and the notes say so). Tying repeated layers
(``tie_layers=True``) shrinks the program; it makes the optimum the best plan in which repeated
layers are sharded alike.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from hulkjax.cost.model import INPUT, LEADER, CostModel
from hulkjax.errors import InfeasiblePlanError
from hulkjax.formatting import format_bytes
from hulkjax.plan.records import Plan
from hulkjax.strategies.baselines import baseline_assignments
from hulkjax.strategies.realize import cost_model, plan_from_assignment
from hulkjax.strategies.registry import register_strategy
from hulkjax.strategies.search import polish_memory
from hulkjax.strategies.stages import best_staged, device_groups
from hulkjax.trace.graph import OpGraph

log = logging.getLogger("hulkjax.ilp")


@dataclass(frozen=True, kw_only=True)
class ILPOptions:
    """Options of ``strategy="ilp"``.

    Attributes:
      time_limit: seconds HiGHS may spend.  # float
      mip_rel_gap: stop when the gap to the best bound is below this.  # float
      max_candidates: candidates kept per group (cheapest by own time, plus the baselines'); a
        group with more is pruned and the plan's notes say so (the optimum is then over the kept
        candidates). Meshes of one or two axes have fewer than 256 per group.  # int
      tie_layers: one decision for all groups of equal structure (repeated layers).  # bool
      memory_limit: bytes per device (``None``: the smallest device's memory).  # float | None
      stages: also solve the two-level model of staged plans (layers on device groups: regions,
        nodes, GPU kinds; :mod:`hulkjax.strategies.stages`) where the topology has such groups,
        and return the faster of the two optima.  # bool
      stage_time_limit: seconds for each intra-stage ILP of the staged search.  # float
    """

    time_limit: float = 60.0
    mip_rel_gap: float = 1e-4
    max_candidates: int = 256
    tie_layers: bool = True
    memory_limit: float | None = None
    stages: bool = True
    stage_time_limit: float = 10.0


@register_strategy("ilp", options=ILPOptions)
def ilp(graph: OpGraph, topology, options: ILPOptions) -> Plan:
    """The optimum of the cost model: the SPMD ILP, and with ``stages`` the staged optimum of
    :func:`hulkjax.strategies.stages.search` when it is faster (see :class:`ILPOptions`)."""
    if not options.stages or not device_groups(topology):
        return spmd_ilp(graph, topology, options)
    try:
        plan = spmd_ilp(graph, topology, options)
    except InfeasiblePlanError:
        staged, _ = best_staged(graph, topology, strategy="ilp", spmd_time=None, solver=solve,
                                time_limit=options.stage_time_limit)
        if staged is None:
            raise
        return staged
    staged, notes = best_staged(graph, topology, strategy="ilp",
                                spmd_time=plan.cost.step_time, solver=solve,
                                time_limit=options.stage_time_limit)
    if staged is not None:
        return staged
    plan.notes.extend(notes)
    return plan


def spmd_ilp(graph: OpGraph, topology, options: ILPOptions) -> Plan:
    """The SPMD optimum of the cost model (the integer program of the module docstring)."""
    time_limit, mip_rel_gap = options.time_limit, options.mip_rel_gap
    max_candidates, tie_layers = options.max_candidates, options.tie_layers
    memory_limit = options.memory_limit
    cm = cost_model(graph, topology)
    seeds = list(baseline_assignments(graph, topology).values())
    kw = dict(seeds=seeds, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
              max_candidates=max_candidates, memory_limit=memory_limit)
    limit = cm.capacity if memory_limit is None else memory_limit
    fitting_seeds = [s for s in seeds if cm.memory(s) <= limit]
    try:
        result = solve(cm, tie_layers=tie_layers, **kw)
    except _NoIncumbent as e:
        # The solver stopped at its time limit without a solution of its own; the baselines are
        # feasible plans already in hand (infeasible is kept for real memory infeasibility).
        if not fitting_seeds:
            raise InfeasiblePlanError(str(e)) from None
        best = min(fitting_seeds, key=cm.objective)
        return plan_from_assignment(cm, best, "ilp", [
            f"ILP: no solution within {time_limit:.0f} s; returned the best baseline's plan "
            f"({cm.objective(best) * 1e3:.4g} ms). Raise time_limit for the optimum."])
    best_seed = min((cm.objective(s) for s in fitting_seeds), default=np.inf)
    if tie_layers and best_seed < result.objective * (1 - 1e-9):
        # A baseline shards repeated layers differently and beats the tied optimum: solve the
        # untied program, whose space contains every baseline.
        log.info("tied optimum %.6g > baseline %.6g: solving untied", result.objective, best_seed)
        result = solve(cm, tie_layers=False, **kw)
    notes = [f"ILP: {result.status}, objective {result.objective * 1e3:.4g} ms, gap "
             f"{result.gap:.2%}, {result.variables} variables, {result.classes} classes, "
             f"solved in {result.solve_time:.2f} s"]
    if result.pruned:
        notes.append(f"ILP: {result.pruned} group(s) had more than {max_candidates} candidates "
                     f"and were pruned to the cheapest; the optimum is over the kept ones")
    assignment = result.assignment
    if best_seed < result.objective * (1 - 1e-9):
        # Only after a time limit (the seeds are in the program's space): keep the best baseline.
        best = min((s for s in seeds if cm.memory(s) <= limit), key=cm.objective)
        assignment = best
        notes.append(f"ILP: stopped at {result.status} above a baseline "
                     f"({best_seed * 1e3:.4g} ms); returned that baseline's plan")
    return plan_from_assignment(cm, assignment, "ilp", notes, solver=result)


class _NoIncumbent(InfeasiblePlanError):
    """The solver stopped without any solution (time limit); not a proof of infeasibility."""


class ILPResult:
    """What the solver did.

    Attributes:
      assignment: candidate index per group.
      objective: the cost model's step time of the assignment, seconds.
      bound: the best lower bound HiGHS proved (== objective when optimal).
      gap: ``(objective - bound) / objective``.
      status: ``"optimal"`` or ``"time limit"`` (feasible, gap reported).
      solve_time, build_time: seconds.  variables, classes: program size.
      pruned: how many group classes had candidates pruned (0: the optimum is over all).
    """

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __repr__(self) -> str:
        return (f"ILPResult({self.status}, objective={self.objective:.6g}, gap={self.gap:.2%}, "
                f"solve_time={self.solve_time:.2f}s)")


def solve(cm: CostModel, *, seeds=(), time_limit: float = 60.0, mip_rel_gap: float = 1e-4,
          max_candidates: int = 256, tie_layers: bool = True,
          memory_limit: float | None = None,
          restrict: dict[int, list[int]] | None = None, polish: bool = True) -> ILPResult:
    """Minimize :meth:`CostModel.objective` subject to the memory limit.

    ``restrict`` limits each group to the given candidates (``auto`` passes the network's most
    likely ones): the optimum over that smaller space. ``polish`` moves each group to its
    smallest-footprint candidate of equal cost afterwards (``auto`` polishes its final choice).
    """
    t0 = time.perf_counter()
    groups = cm.groups
    capacity = cm.capacity if memory_limit is None else memory_limit

    # Classes: groups of equal structure share a decision.
    cls_of: list[int] = []
    reps: list[int] = []
    index: dict = {}
    for grp in groups:
        key = (grp.signature, _cand_key(grp)) if tie_layers and grp.kind in (INPUT, LEADER) else grp.id
        if key not in index:
            index[key] = len(reps)
            reps.append(grp.id)
        cls_of.append(index[key])
    members: dict[int, list[int]] = defaultdict(list)
    for gid, c in enumerate(cls_of):
        members[c].append(gid)

    # Candidates kept per class: the cheapest by own time, the replicated one, the seeds'.
    keep: list[list[int]] = []
    pruned = 0
    for c, gid in enumerate(reps):
        n = len(groups[gid].candidates)
        if restrict is not None:
            chosen = {0}
            for g2 in members[c]:
                chosen.update(restrict.get(g2, ()))
        else:
            pruned += n > max_candidates
            times = np.array([cm.local(gid, k).time for k in range(n)])
            chosen = set(np.argsort(times, kind="stable")[:max_candidates].tolist()) | {0}
        for seed in seeds:
            for g2 in members[c]:
                chosen.add(seed[g2])
        keep.append(sorted(chosen))

    # Node costs and memory per class (summed over the class's groups).
    node_cost = [np.array([sum(cm.local(g2, k).time for g2 in members[c]) for k in keep[c]])
                 for c in range(len(reps))]
    node_mem = [np.array([sum(cm.local(g2, k).memory for g2 in members[c]) for k in keep[c]])
                for c in range(len(reps))]

    # Edge costs between classes (an edge inside one class only sees equal choices).
    edge_cost: dict[tuple[int, int], np.ndarray] = {}
    for (gp, gc), _ in cm.edge_items():
        cp, cc = cls_of[gp], cls_of[gc]
        m = cm.edge_matrix(gp, gc, keep[cp], keep[cc])
        if cp == cc:
            node_cost[cp] = node_cost[cp] + np.diag(m)
            continue
        if not np.any(m):
            continue
        key = (cp, cc) if cp < cc else (cc, cp)
        mm = m if cp < cc else m.T
        edge_cost[key] = edge_cost.get(key, 0) + mm

    # Variables: x blocks, then y blocks.
    offsets, n_x = [], 0
    for c in range(len(reps)):
        offsets.append(n_x)
        n_x += len(keep[c])
    y_off, n = {}, n_x
    for key, m in edge_cost.items():
        y_off[key] = n
        n += m.size
    cost = np.zeros(n)
    for c in range(len(reps)):
        cost[offsets[c]:offsets[c] + len(keep[c])] = node_cost[c]
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for c in range(len(reps)):  # one candidate per class
        k = len(keep[c])
        rows += [r] * k
        cols += list(range(offsets[c], offsets[c] + k))
        vals += [1.0] * k
        lo.append(1.0)
        hi.append(1.0)
        r += 1
    for (a, b), m in edge_cost.items():
        base = y_off[(a, b)]
        ka, kb = m.shape
        cost[base:base + m.size] = m.ravel()
        for i in range(ka):  # sum_j y[i, j] = x_a[i]
            rows += [r] * (kb + 1)
            cols += [base + i * kb + j for j in range(kb)] + [offsets[a] + i]
            vals += [1.0] * kb + [-1.0]
            lo.append(0.0)
            hi.append(0.0)
            r += 1
        for j in range(kb):  # sum_i y[i, j] = x_b[j]
            rows += [r] * (ka + 1)
            cols += [base + i * kb + j for i in range(ka)] + [offsets[b] + j]
            vals += [1.0] * ka + [-1.0]
            lo.append(0.0)
            hi.append(0.0)
            r += 1
    mem_row = np.zeros(n)
    for c in range(len(reps)):
        mem_row[offsets[c]:offsets[c] + len(keep[c])] = node_mem[c]
    min_mem = sum(float(node_mem[c].min()) for c in range(len(reps)))
    if min_mem > capacity:
        raise _infeasible(cm, keep, node_mem, reps, capacity, min_mem)
    A = sp.csr_array((vals, (rows, cols)), shape=(r, n))
    constraints = [LinearConstraint(A, lo, hi), LinearConstraint(mem_row[None, :], -np.inf, capacity)]
    integrality = np.zeros(n)
    integrality[:n_x] = 1
    build_time = time.perf_counter() - t0
    t1 = time.perf_counter()
    res = milp(cost, integrality=integrality, bounds=Bounds(0, 1), constraints=constraints,
               options={"time_limit": time_limit, "mip_rel_gap": mip_rel_gap, "disp": False})
    solve_time = time.perf_counter() - t1
    if res.x is None:
        raise _NoIncumbent(
            f"the ILP found no plan within {time_limit:.0f} s ({res.message}). Raise time_limit, "
            f"or lower max_candidates to shrink the program.")
    x = res.x
    assignment = [0] * len(groups)
    for c in range(len(reps)):
        k = int(np.argmax(x[offsets[c]:offsets[c] + len(keep[c])]))
        for gid in members[c]:
            assignment[gid] = keep[c][k]
    if polish:
        assignment = polish_memory(cm, assignment)
    objective = cm.objective(assignment)
    bound = getattr(res, "mip_dual_bound", None)
    bound = objective if bound is None or not np.isfinite(bound) else min(float(bound), objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    status = "optimal" if res.status == 0 else "time limit"
    return ILPResult(assignment=assignment, objective=objective, bound=bound, gap=gap,
                     status=status, solve_time=solve_time, build_time=build_time, variables=n,
                     classes=len(reps), pruned=pruned)


def _cand_key(grp) -> tuple:
    return tuple(grp.candidates) if grp.kind == INPUT else len(grp.candidates)


def _infeasible(cm, keep, node_mem, reps, capacity, need) -> InfeasiblePlanError:
    g = cm.graph
    biggest = sorted(((g.values[v].nbytes, p) for v, p in zip(g.inputs, g.input_paths)),
                     reverse=True)[:3]
    tensors = ", ".join(f"{p} ({format_bytes(b)})" for b, p in biggest)
    return InfeasiblePlanError(
        f"no plan fits: even the most memory-saving layouts need {format_bytes(need)} per device "
        f"and the smallest device has {format_bytes(capacity)}. Largest tensors: {tensors}. Use "
        f"more devices, a smaller batch, rematerialization (jax.checkpoint), or bfloat16.")
