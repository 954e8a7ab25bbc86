"""``strategy="ilp"``: the exact optimum of the cost model (Alpa-style integer program).

Variables: for each group class (repeated layers share one), a one-hot choice ``x_G`` over its
candidates; for each pair of classes joined by tensors, a coupling ``y_GH`` with marginals ``x_G``
and ``x_H`` (so ``y_GH[a, b] = x_G[a] x_H[b]`` at integral points); for each layout change of a
value that several operators of other groups read (:meth:`CostModel.shared_items`) and that two
of them can need, a ``z`` at least each reader's indicator of needing it (a sum of ``y``
entries), so the change is charged once however many need it (:func:`_shared_terms`); written
as its excess over its first reading, one row fewer per change.
Objective: the cost model's step time, ``sum_G t_G . x_G + sum_GH E_GH . y_GH + sum w_z z``,
exactly the sum :meth:`CostModel.objective` computes. The shared changes make the program larger
(GPT-2 small on two DGX-H100 nodes: 5,539 ``z``), but a pairwise program charges a change once
per reader, which the compiled program does not.

Constraint: per-device memory ``sum_G m_G . x_G <= capacity``. Among plans of equal step
time, a polishing pass then moves each group to its smallest-footprint candidate that leaves the
objective unchanged.

A coupling's rows and columns are parts of candidates, not candidates (:func:`_parts`): an edge's
cost depends on the layouts of a few tensors, which many candidates share, so candidates with
equal costs to every candidate of the other class, that the shared changes' readings also select
alike, form one part, and the marginals are the parts' sums of ``x``. The relaxation stays as
tight as the candidate-by-candidate one (a parts solution splits into pairs in proportion to
``x``, with the same marginals and cost), from a program 4-8x smaller. On the third-party
families of ``tests/realmodels`` (small, 2 x 4 mesh and two DGX-H100 nodes) the relaxation is
integral in 13 of 14 cells, where HiGHS proves the optimum at its root node in 0.2-2.3 s on a
loaded machine (T5 on 2 x 4 needs cuts: 0.04% from its bound at 10 s); the pairwise program
stopped at that 10 s limit in 6 of the 14, 11-18% from a bound (``benchmarks/ILP.md``).

The program always has a plan. Memory is the only constraint between classes and it is a sum over
them, so the program is feasible exactly when the leanest candidate of every class together fits
(otherwise :class:`~hulkjax.errors.InfeasiblePlanError` names the cause), and then that choice is a
solution. The sum counts every group's bytes at once, which usually overstates the liveness peak a
plan reports (:func:`hulkjax.cost.memory.liveness`; not where a combined gradient reduction holds
its operands and results at once): when it rules every layout out, the program is solved without
it. Either way the peak decides (the optimum if it fits, else the fastest of the leanest choice
and the baselines that fit; only when none does is the plan infeasible, and then no
exhaustiveness is claimed). HiGHS (``highspy``) starts from the cheapest known solution: the best baseline that fits
(every baseline's assignment is in the untied program's space; one that shards repeated layers
differently starts the tied program tied, each class on its layers' most common candidate), or
that leanest choice. Stopped by its
time limit, it returns its best solution so far, never worse than that start, with the gap to the
best proven bound in the plan's notes and in ``plan.solver`` (:class:`ILPResult`). HiGHS runs on
one thread with a fixed seed, so a plan does not change from run to run.

Groups with more than ``max_candidates`` candidates (3-axis meshes) are pruned to the cheapest by
their own time, always keeping the replicated one and every candidate a baseline uses, so the
optimum is never worse than any baseline (their assignments are in the search space); the notes say
when pruning happened. Tying repeated layers (``tie_layers=True``) shrinks the program; it makes
the optimum the best plan in which repeated layers are sharded alike (if a baseline that shards
them differently is cheaper, the untied program is solved).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import highspy
import numpy as np
import scipy.sparse as sp

from hulkjax.cost.model import INPUT, LEADER, CostModel
from hulkjax.errors import InvalidOptionError
from hulkjax.plan.records import Plan
from hulkjax.strategies.baselines import baseline_assignments
from hulkjax.strategies.feasibility import infeasible_error
from hulkjax.strategies.realize import cost_model, plan_from_assignment
from hulkjax.strategies.registry import get_strategy, make_options, register_strategy
from hulkjax.strategies.search import polish_memory
from hulkjax.strategies.stages import device_groups, spmd_or_staged
from hulkjax.trace.graph import OpGraph

log = logging.getLogger("hulkjax.ilp")

# HiGHS's presolve rule 15 (``presolve_rule_off`` bit), probing: it tentatively fixes binary
# variables to learn implications. These programs are one-hot choices per class coupled through
# continuous edge and shared-change variables, and presolve removes almost nothing from them
# (GPT-2 small on two DGX nodes: 9 of 9,177 rows), but probing their thousands of binaries was
# the largest part of a solve: 1.4 -> 0.8 s on LLaMA-8B on 64 H100, and 54.7 -> 46.2 CPU s over
# the 52 distinct programs of ILP.md's `auto` cells (each solved alone, without its start),
# every one 0.56-0.99x the time, at the same optimum (presolve switched off entirely was faster
# on most and 1.2-1.9x slower on the UNet's).
_NO_PROBING = 1 << 15


@dataclass(frozen=True, kw_only=True)
class ILPOptions:
    """Options of ``strategy="ilp"``.

    Attributes:
      time_limit: seconds HiGHS may spend (over both programs when the tied one is solved
        again untied); it then returns its best plan so far (never worse than the best
        baseline) and the notes give the gap to the optimum.  # float
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
      start_from_auto: also start HiGHS from ``auto``'s SPMD plan (its network prior, shortlist
        optimum and descent; costs auto's planning time on top), so that a plan stopped by the
        time limit is never worse than auto's. Off by default: on the third-party families the
        program's relaxation closes at the root in a few seconds, where the start does not
        matter (``benchmarks/ILP.md``); it pays on programs HiGHS cannot finish (3-axis meshes,
        untied layers of large models).  # bool
      optimizer_apart: decide each optimizer state's layout apart from its parameter's (the
        distributed optimizer: state sharded where its parameter is whole, the update on the
        shards); the ILP's classes tie a state with the states of its parameter's repeated
        layers. The space holds every plan without it, and ``zero``'s. The staged search's
        stages decide it so too (each stage's state sharded over its group), and the staged
        search with state tied runs as well, the faster staged plan kept (that search is not
        exhaustive: either can find the faster plan).  # bool
    """

    time_limit: float = 60.0
    mip_rel_gap: float = 1e-4
    max_candidates: int = 256
    tie_layers: bool = True
    memory_limit: float | None = None
    stages: bool = True
    stage_time_limit: float = 10.0
    start_from_auto: bool = False
    optimizer_apart: bool = False

    def __post_init__(self):
        _check_limits(self.time_limit, self.mip_rel_gap)
        if not isinstance(self.max_candidates, int | np.integer) or self.max_candidates < 1:
            raise InvalidOptionError(f"max_candidates={self.max_candidates!r}: use an int >= 1")
        if self.memory_limit is not None and not self.memory_limit > 0:
            raise InvalidOptionError(f"memory_limit={self.memory_limit!r}: use bytes per device (> 0) or "
                             f"None for the smallest device's memory")


def _check_limits(time_limit, mip_rel_gap) -> None:
    # HiGHS ignores an option value out of its range (keeping its default, no time limit), so
    # a negative time limit would run unbounded: refuse it here.
    if not time_limit >= 0:
        raise InvalidOptionError(f"time_limit={time_limit!r}: use seconds >= 0 (0 returns the starting "
                         f"plan, the best baseline that fits)")
    if not mip_rel_gap >= 0:
        raise InvalidOptionError(f"mip_rel_gap={mip_rel_gap!r}: use a relative gap >= 0 (default 1e-4)")


@register_strategy("ilp", options=ILPOptions)
def ilp(graph: OpGraph, topology, options: ILPOptions) -> Plan:
    """The optimum of the cost model: the SPMD ILP, and with ``stages`` the staged optimum of
    :func:`hulkjax.strategies.stages.search` when it is faster (see :class:`ILPOptions`)."""
    if not options.stages or not device_groups(topology):
        return spmd_ilp(graph, topology, options)
    return spmd_or_staged(graph, topology, lambda: spmd_ilp(graph, topology, options),
                          strategy="ilp", solver=solve, time_limit=options.stage_time_limit,
                          optimizer_apart=options.optimizer_apart)


def spmd_ilp(graph: OpGraph, topology, options: ILPOptions) -> Plan:
    """The SPMD optimum of the cost model (the integer program of the module docstring)."""
    apart = options.optimizer_apart
    cm = cost_model(graph, topology, optimizer_apart=apart)
    seeds = baseline_assignments(graph, topology, optimizer_apart=apart)
    if options.start_from_auto:
        # Looked up by name (auto builds on this module's solver).
        auto = get_strategy("auto")
        seeds["auto"] = list(auto.fn(graph, topology, make_options(
            auto, {"stages": False, "optimizer_apart": apart})).assignment)
    kw = dict(seeds=seeds, time_limit=options.time_limit, mip_rel_gap=options.mip_rel_gap,
              max_candidates=options.max_candidates, memory_limit=options.memory_limit)
    limit = cm.capacity if options.memory_limit is None else options.memory_limit
    result = solve(cm, tie_layers=options.tie_layers, **kw)
    best_seed, best_name = min(((cm.objective(s), n) for n, s in seeds.items()
                                if cm.memory(s) <= limit), default=(np.inf, ""))
    notes = []
    if options.tie_layers and best_seed < result.objective * (1 - 1e-9):
        # A seed (a baseline, or auto's plan) shards repeated layers differently and beats the
        # tied program's plan: solve the untied program, whose space (and warm start) holds every
        # seed, in the time left.
        log.info("tied plan %.6g > %s %.6g: solving untied", result.objective, best_name,
                 best_seed)
        notes.append(f"ILP: with repeated layers tied, {result.objective * 1e3:.4g} ms > "
                     f"{best_name}'s {best_seed * 1e3:.4g} ms: solved with layers untied")
        kw["time_limit"] = max(0.0, options.time_limit - result.solve_time)
        result = solve(cm, tie_layers=False, **kw)
    notes.insert(0, result.summary())
    if result.pruned:
        notes.append(f"ILP: {result.pruned} group(s) had more than {options.max_candidates} "
                     f"candidates and were pruned to the cheapest; the optimum is over the kept "
                     f"ones")
    return plan_from_assignment(cm, result.assignment, "ilp", notes, solver=result)


@dataclass(kw_only=True)
class ILPResult:
    """What the solver did.

    Attributes:
      assignment: candidate index per group.  # list[int]
      objective: the cost model's step time of the assignment, seconds.  # float
      bound: the best lower bound on the program's optimum, seconds (HiGHS's, or the sum of every
        class's cheapest own time when HiGHS proved none).  # float
      gap: ``(objective - bound) / objective``; below ``mip_rel_gap`` when ``"optimal"``.  # float
      status: ``"optimal"``, ``"time limit"`` (the best plan found in time, gap reported), or
        another HiGHS stop reason.  # str
      start: the warm start HiGHS began from: a seed's name (a baseline's), or ``"leanest"`` (each
        class at its smallest-footprint candidate) when no seed fits.  # str
      start_objective: the warm start's step time, seconds.  # float
      solve_time, build_time: seconds in HiGHS / building the program.  # float
      variables, rows, classes: program size.  # int
      pruned: how many group classes had candidates pruned (0: the optimum is over all).  # int
      nodes: branch-and-bound nodes HiGHS explored (1: the root's LP relaxation, with HiGHS's
        cuts and heuristics, closed the gap).  # int
      iterations: simplex iterations, all nodes together.  # int
    """

    assignment: list[int]
    objective: float
    bound: float
    gap: float
    status: str
    start: str
    start_objective: float
    solve_time: float
    build_time: float
    variables: int
    rows: int
    classes: int
    pruned: int
    nodes: int = 0
    iterations: int = 0

    def __repr__(self) -> str:
        return (f"ILPResult({self.status}, objective={self.objective:.6g}, gap={self.gap:.2%}, "
                f"solve_time={self.solve_time:.2f}s)")

    def summary(self) -> str:
        """One line for the plan's notes."""
        line = (f"ILP: {self.status}, objective {self.objective * 1e3:.4g} ms, gap {self.gap:.2%} "
                f"(bound {self.bound * 1e3:.4g} ms), {self.variables} variables, {self.classes} "
                f"classes, {self.nodes} node{'s' * (self.nodes != 1)}, solved in "
                f"{self.solve_time:.2f} s")
        if self.status != "optimal":
            line += (f"; started from {self.start} ({self.start_objective * 1e3:.4g} ms). Raise "
                     f"time_limit to close the gap")
        return line


def solve(cm: CostModel, *, seeds: Mapping[str, Sequence[int]] | Sequence[Sequence[int]] = (),
          time_limit: float = 60.0, mip_rel_gap: float = 1e-4, max_candidates: int = 256,
          tie_layers: bool = True, memory_limit: float | None = None,
          restrict: dict[int, list[int]] | None = None, polish: bool = True,
          aggregate: bool = True) -> ILPResult:
    """Minimize :meth:`CostModel.objective` subject to the memory limit.

    ``seeds`` are known assignments (a list, or ``{name: assignment}``): their candidates stay in
    the program, and the cheapest that fits (and, with ``tie_layers``, shards repeated layers
    alike) is HiGHS's starting solution. ``restrict`` limits each group to the given candidates
    (``auto`` passes the network's most likely ones): the optimum over that smaller space.
    ``polish`` moves each group to its smallest-footprint candidate of equal cost afterwards
    (``auto`` polishes its final choice). ``aggregate=False`` builds the program as it was at
    f5a9d0b (every pair of candidates coupled, not parts of them; a shared change's variable at
    least each of its readings, not its excess over the first): the same optimum and relaxation
    from a program several times larger, for comparisons.

    Returns a plan whenever one fits: on a time limit, the best found so far (never worse than the
    starting solution) with ``status="time limit"`` and its gap.

    Raises:
      InfeasiblePlanError: no assignment fits the memory limit (the message names the cause).
    """
    _check_limits(time_limit, mip_rel_gap)
    t0 = time.perf_counter()
    named = list(seeds.items()) if isinstance(seeds, Mapping) else \
        [(f"seed {i}", s) for i, s in enumerate(seeds)]
    capacity = cm.capacity if memory_limit is None else memory_limit
    prog = _Program(cm, [s for _, s in named], tie_layers=tie_layers, restrict=restrict,
                    max_candidates=max_candidates, aggregate=aggregate)
    # The program's memory is additive (every group's bytes at once), which usually overstates
    # the peak of the liveness walk (what a plan reports). When that sum rules every layout out,
    # the program is solved without it. Either way the liveness peak decides: the optimum if it
    # fits, else the fastest of the leanest layout and the seeds that fit (the sum can understate
    # the walk: a combined gradient reduction holds operands and results at once).
    limit = capacity if prog.min_memory <= capacity else np.inf
    start_name, start = prog.start(cm, named, limit)
    build_time = time.perf_counter() - t0

    t1 = time.perf_counter()
    run = _run_highs(prog, prog.vector(start), limit, time_limit=time_limit,
                     mip_rel_gap=mip_rel_gap)
    status, highs_bound = run.status, run.bound
    solve_time = time.perf_counter() - t1
    start_objective = cm.objective(start)
    assignment = start
    if run.found is not None:
        candidate = prog.decode(run.found)
        if cm.memory(candidate) <= limit and cm.objective(candidate) <= start_objective:
            assignment = candidate
        else:  # within HiGHS's tolerances only: the start is as good and surely fits
            log.debug("HiGHS's solution (%.6g s, %.6g B) kept the start (%.6g s)",
                      cm.objective(candidate), cm.memory(candidate), start_objective)
    if polish:
        assignment = polish_memory(cm, assignment)
    # (the sum is not a bound everywhere, below; no limit: no liveness walk to compare)
    if np.isfinite(capacity) and cm.peak_memory(assignment) > capacity:
        pool = [("leanest", prog.leanest()), *((n, list(a)) for n, a in named)]
        peaks = [cm.peak_memory(a) for _, a in pool]
        fits = [(cm.objective(a), i) for i, ((_, a), p) in enumerate(zip(pool, peaks))
                if p <= capacity]
        if not fits:
            raise infeasible_error(cm, min(peaks), planner="ilp", exhaustive=False)
        start_name, assignment = pool[min(fits)[1]]
        status = "memory-bound: the fastest fitting of the leanest layout and the seeds"
    objective = cm.objective(assignment)
    bound = max(prog.trivial_bound, highs_bound if np.isfinite(highs_bound) else -np.inf)
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    return ILPResult(assignment=assignment, objective=objective, bound=bound, gap=gap,
                     status=status, start=start_name, start_objective=start_objective,
                     solve_time=solve_time, build_time=build_time, variables=prog.n,
                     rows=prog.n_rows, classes=prog.n_classes, pruned=prog.pruned,
                     nodes=max(run.nodes, 0), iterations=run.iterations)


def relaxation_bound(cm: CostModel, *, seeds: Mapping[str, Sequence[int]] = (),
                     tie_layers: bool = True, max_candidates: int = 256,
                     memory_limit: float | None = None, aggregate: bool = True,
                     time_limit: float = 600.0) -> float:
    """The optimum of the program's LP relaxation (every choice fractional), in seconds: a lower
    bound on :func:`solve`'s optimum, equal to it where the relaxation is integral. How tight
    the formulation is (``benchmarks/ilp.py``); ``-inf`` if not solved within ``time_limit``.

    >>> import hulkjax as hj, jax.numpy as jnp
    >>> from hulkjax.strategies.realize import cost_model
    >>> g = hj.trace(lambda w, x: (w, x @ w), jnp.ones((64, 64)), jnp.ones((32, 64)))
    >>> cm = cost_model(g, hj.Topology.grid((4,), ("x",)))
    >>> relaxation_bound(cm) <= solve(cm).objective * (1 + 1e-9)
    True
    """
    named = list(seeds.items()) if isinstance(seeds, Mapping) else list(enumerate(seeds))
    capacity = cm.capacity if memory_limit is None else memory_limit
    prog = _Program(cm, [s for _, s in named], tie_layers=tie_layers, restrict=None,
                    max_candidates=max_candidates, aggregate=aggregate)
    limit = capacity if prog.min_memory <= capacity else np.inf
    return _run_highs(prog, None, limit, time_limit=time_limit, mip_rel_gap=0.0,
                      integral=False).bound


def program_pairs(cm: CostModel, *, tie_layers: bool = True, max_candidates: int = 256) -> int:
    """How many candidate pairs :func:`solve`'s program couples between joined classes, before
    they are merged into parts: the size of the candidate-by-candidate program (its ``x`` and
    ``y``; within 5% of the variables ``solve(..., aggregate=False)`` builds on the families of
    ``benchmarks/ILP.md``), from the groups and edges alone, no table built. ``auto`` reads it
    to decide whether the whole program is small enough to solve (:class:`~hulkjax.strategies.
    auto.AutoOptions`' ``full_program``).

    >>> import hulkjax as hj, jax.numpy as jnp
    >>> from hulkjax.strategies.realize import cost_model
    >>> g = hj.trace(lambda w, x: (w, x @ w), jnp.ones((64, 64)), jnp.ones((32, 64)))
    >>> program_pairs(cost_model(g, hj.Topology.grid((4,), ("x",)))) > 0
    True
    """
    cls_of, reps = _classes(cm, tie_layers)
    n = [min(len(cm.groups[g].candidates), max_candidates) for g in reps]
    joined = {(a, b) if a < b else (b, a) for (gp, gc), _ in cm.edge_items()
              if (a := cls_of[gp]) != (b := cls_of[gc])}
    return sum(n) + sum(n[a] * n[b] for a, b in joined)


def _classes(cm: CostModel, tie_layers: bool) -> tuple[list[int], list[int]]:
    """``(class of every group, first group of every class)``: with ``tie_layers``, input and
    leader groups of equal structure (repeated layers) share a class, and so one decision."""
    cls_of: list[int] = []
    reps: list[int] = []
    index: dict = {}
    for grp in cm.groups:
        key = (grp.signature, _cand_key(grp)) if tie_layers and grp.kind in (INPUT, LEADER) \
            else grp.id
        if key not in index:
            index[key] = len(reps)
            reps.append(grp.id)
        cls_of.append(index[key])
    return cls_of, reps


class _Program:
    """The integer program of a cost model: classes, kept candidates, costs, constraints."""

    def __init__(self, cm: CostModel, seeds, *, tie_layers: bool, restrict, max_candidates: int,
                 aggregate: bool = True):
        groups = cm.groups
        cls_of, reps = _classes(cm, tie_layers)
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
                times = np.array([cm.table_time(gid, k) for k in range(n)])
                chosen = set(np.argsort(times, kind="stable")[:max_candidates].tolist()) | {0}
            for seed in seeds:
                for g2 in members[c]:
                    chosen.add(seed[g2])
            keep.append(sorted(chosen))

        n_classes = len(reps)
        # Node costs and memory per class (summed over the class's groups).
        node_cost = [_class_times(cm, members[c], keep[c]) for c in range(n_classes)]
        # Memory is a table's (no program runs): groups of one table class share it, so each
        # class sums its table classes' memory times how many of its groups each has.
        node_mem = []
        for c in range(n_classes):
            reps_in = Counter(cm.table_rep[g2] for g2 in members[c])
            node_mem.append(np.array([sum(n * cm.local(r, k).memory for r, n in reps_in.items())
                                      for k in keep[c]]))

        # Edge costs between classes (an edge inside one class only sees equal choices), the
        # readers of shared values left out: they are charged once per layout below.
        edge_cost: dict[tuple[int, int], np.ndarray] = {}
        # Edges of one edge class between the same two classes have one matrix (repeated
        # layers, tied): fetched once (it is only read), added once per edge as before.
        matrices: dict[tuple[int, int, int], tuple[np.ndarray, bool]] = {}
        for (gp, gc), _ in cm.edge_items():
            cp, cc = cls_of[gp], cls_of[gc]
            ek = cm.edge_class(gp, gc, shared=False)
            hit = None if ek is None else matrices.get((ek, cp, cc))
            if hit is None:
                m = cm.edge_matrix(gp, gc, keep[cp], keep[cc], shared=False)
                hit = (m, bool(np.any(m)))
                if ek is not None:
                    matrices[(ek, cp, cc)] = hit
            m, nonzero = hit
            if cp == cc:
                node_cost[cp] = node_cost[cp] + np.diag(m)
                continue
            if not nonzero:
                continue
            key = (cp, cc) if cp < cc else (cc, cp)
            mm = m if cp < cc else m.T
            edge_cost[key] = edge_cost.get(key, 0) + mm
        hyper = _shared_terms(cm, cls_of, keep, node_cost, edge_cost)
        # The positions each shared change's readings select on either side of a pair of
        # classes (every such pair gets a y block, even with no edge cost of its own).
        cuts: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
        for row_keys in hyper:
            for rk in row_keys:
                if rk[0] == "y":
                    _, a_, b_, S, D = rk
                    if a_ > b_:
                        a_, b_, S, D = b_, a_, D, S
                    edge_cost.setdefault((a_, b_), np.zeros((len(keep[a_]), len(keep[b_]))))
                    cuts[(a_, b_)][0].append(S)
                    cuts[(a_, b_)][1].append(D)

        self.cls_of, self.members, self.keep, self.pruned = cls_of, members, keep, pruned
        self.n_classes, self.n_groups = n_classes, len(groups)
        self.node_mem = node_mem
        self.position = [{k: i for i, k in enumerate(kc)} for kc in keep]
        self.min_memory = float(sum(float(m.min()) for m in node_mem))
        # Every class's cheapest own time and every pair's cheapest edge bound the optimum (an
        # edge is negative only where it leaves out an all-reduce a merge drops: sum_sites).
        self.trivial_bound = float(sum(float(t.min()) for t in node_cost)) + float(sum(
            min(0.0, float(m.min())) for m in edge_cost.values() if np.size(m)))

        # Variables: x blocks (one per class), then y blocks (one per joined pair of classes).
        # A y block couples parts of the two classes' candidates, not candidates: candidates
        # whose edge costs agree (an edge's cost depends on the layouts of a few tensors, which
        # many candidates share) and that every shared change's readings select alike form one
        # part (:func:`_parts`). The coupling's marginals are the parts' sums of x, and the
        # relaxation is as tight as the candidate-by-candidate one: any part-level solution
        # splits into candidate pairs in proportion to their x with the same marginals and cost.
        # GPT-2 small on a 2 x 4 mesh: 184,785 y variables become 22,159.
        sizes = np.array([len(k) for k in keep], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.n_x = int(sizes.sum())
        # (a, b, base, parts of a, parts of b, part of each position of a, of b)
        self.blocks: list[tuple[int, int, int, int, int, np.ndarray, np.ndarray]] = []
        y_cost = []
        n = self.n_x
        for (a, b), m in edge_cost.items():
            rows_cut, cols_cut = cuts.get((a, b), ([], []))
            ra, reps_a = _parts(m, rows_cut, aggregate)
            rb, reps_b = _parts(m.T, cols_cut, aggregate)
            self.blocks.append((a, b, n, len(reps_a), len(reps_b), ra, rb))
            y_cost.append(m[np.ix_(reps_a, reps_b)].ravel())
            n += len(reps_a) * len(reps_b)
        # Shared changes (continuous variables, last): a change charged at the largest of its
        # readings, z >= every reading, is written z = (its first reading) + t with t >= 0 and
        # t >= (another reading) - (the first): the first reading's columns take the change's
        # cost, and the variable is the excess t. The same relaxation with one row fewer per
        # change (half the rows of a change two classes read): HiGHS's simplex took half the
        # iterations on the untied GPT-2 and Mixtral programs (Mixtral: 34 s, was 178 s).
        block_at = {(a, b): blk for a, b, *blk in self.blocks}
        self._part_memo: dict[tuple, np.ndarray] = {}
        self.z_rows: list[tuple[int, list[np.ndarray]]] = []
        z_cost = []
        for row_keys, w in hyper.items():
            self.z_rows.append((n, [self._columns(rk, block_at) for rk in row_keys]))
            z_cost.append(w)
            n += 1
        self.n = n
        self.cost = np.concatenate([*node_cost, *y_cost, np.asarray(z_cost, dtype=np.float64)]) \
            if n else np.zeros(0)
        self.excess = aggregate  # (without: z >= every reading, the program as it was)
        for (_, readings), w in zip(self.z_rows, z_cost):
            if self.excess:
                self.cost[readings[0]] += w

        # Rows: one candidate per class; the marginals of every y block; memory (last).
        rows, cols, vals = [np.repeat(np.arange(n_classes), sizes)], [np.arange(self.n_x)], \
            [np.ones(self.n_x)]
        r = n_classes
        for a, b, base, pa, pb, ra, rb in self.blocks:
            ys = base + np.arange(pa * pb)
            # sum_Q y[P, Q] = sum of x_a over part P
            rows += [r + np.repeat(np.arange(pa), pb), r + ra]
            cols += [ys, self.offsets[a] + np.arange(len(ra))]
            vals += [np.ones(pa * pb), -np.ones(len(ra))]
            r += pa
            # sum_P y[P, Q] = sum of x_b over part Q
            rows += [r + np.tile(np.arange(pb), pa), r + rb]
            cols += [ys, self.offsets[b] + np.arange(len(rb))]
            vals += [np.ones(pa * pb), -np.ones(len(rb))]
            r += pb
        r_eq = r
        # t + (the first reading) - (another) >= 0: one row per other reading, its entries
        # (t, the first reading's columns, the other's) laid out row by row, in one go
        z_cols, z_lens = [], []
        none = np.zeros(0, dtype=np.int64)
        for z, readings in self.z_rows:
            first = readings[0] if self.excess else none
            for c in readings[1:] if self.excess else readings:
                z_cols += [np.array([z]), first, c]
                z_lens += [1, len(first), len(c)]
        if z_lens:
            lens = np.array(z_lens, dtype=np.int64).reshape(-1, 3)
            n_z_rows = len(lens)
            rows.append(np.repeat(np.arange(r, r + n_z_rows), lens.sum(axis=1)))
            cols.append(np.concatenate(z_cols))
            vals.append(np.repeat(np.tile([1.0, 1.0, -1.0], n_z_rows), lens.ravel()))
            r += n_z_rows
        mem = np.concatenate(node_mem) if n_classes else np.zeros(0)
        rows.append(np.full(self.n_x, r))
        cols.append(np.arange(self.n_x))
        vals.append(mem)
        self.n_rows = r + 1
        self.row_lo = np.concatenate([np.ones(n_classes), np.zeros(r - n_classes), [-np.inf]])
        self.row_hi_wo_memory = np.concatenate([np.ones(n_classes), np.zeros(r_eq - n_classes),
                                                np.full(r - r_eq, np.inf)])
        self.matrix = sp.csc_array(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
            shape=(self.n_rows, n))
        del self._part_memo

    def _columns(self, rk: tuple, block_at: dict) -> np.ndarray:
        """The columns of one reading of a shared change (:func:`_shared_terms`)."""
        if rk[0] == "x":
            _, c, pos = rk
            return self.offsets[c] + np.asarray(pos, dtype=np.int64)
        _, a, b, S, D = rk
        if a > b:
            a, b, S, D = b, a, D, S
        base, _, pb, ra, rb = block_at[(a, b)]
        # S and D are unions of parts (the parts were cut along them): each part once. Many
        # readings select the same positions (one per target layout): memoized.
        P = self._part_memo.get((a, b, 0, S))
        if P is None:
            P = self._part_memo[(a, b, 0, S)] = np.unique(ra[np.asarray(S, dtype=np.int64)])
        Q = self._part_memo.get((a, b, 1, D))
        if Q is None:
            Q = self._part_memo[(a, b, 1, D)] = np.unique(rb[np.asarray(D, dtype=np.int64)])
        return (base + P[:, None] * pb + Q[None, :]).ravel()

    def representable(self, assignment) -> bool:
        """Whether every class's groups take one candidate the program kept."""
        for c, gids in self.members.items():
            k = assignment[gids[0]]
            if k not in self.position[c] or any(assignment[g] != k for g in gids):
                return False
        return True

    def vector(self, assignment) -> np.ndarray:
        """The program's variables (x and y) at a representable assignment."""
        x = np.zeros(self.n)
        pick = np.empty(self.n_classes, dtype=np.int64)
        for c, gids in self.members.items():
            pick[c] = self.position[c][assignment[gids[0]]]
        x[self.offsets + pick] = 1.0
        for a, b, base, _pa, pb, ra, rb in self.blocks:
            x[base + ra[pick[a]] * pb + rb[pick[b]]] = 1.0
        for z, readings in self.z_rows:  # the excess over the first reading
            x[z] = max(float(x[c].sum()) for c in readings) - \
                (float(x[readings[0]].sum()) if self.excess else 0.0)
        return x

    def decode(self, x: np.ndarray) -> list[int]:
        """The assignment of a solution's x blocks."""
        assignment = [0] * self.n_groups
        for c, gids in self.members.items():
            o = self.offsets[c]
            k = self.keep[c][int(np.argmax(x[o:o + len(self.keep[c])]))]
            for g in gids:
                assignment[g] = k
        return assignment

    def leanest(self) -> list[int]:
        """Every class at its smallest-footprint candidate (the cheaper one of equal footprint)."""
        assignment = [0] * self.n_groups
        for c, gids in self.members.items():
            k = self.keep[c][int(np.argmin(self.node_mem[c]))]
            for g in gids:
                assignment[g] = k
        return assignment

    def start(self, cm: CostModel, named, capacity: float) -> tuple[str, list[int]]:
        """The cheapest known solution: a fitting seed (a seed that shards repeated layers
        differently, tied: each class on its groups' most common kept candidate), or the
        leanest choice."""
        options = []
        for i, (name, s) in enumerate(named):
            if not self.representable(s):
                s, name = self.tied(s), f"{name} (layers tied)"
            if s is not None and cm.memory(s) <= capacity:
                options.append((cm.objective(s), i, name, list(s)))
        if options:
            _, _, name, s = min(options)
            return name, s
        return "leanest", self.leanest()

    def tied(self, assignment) -> list[int] | None:
        """``assignment`` with every class's groups on the candidate most of them take (of equal
        counts, the first group's); ``None`` where that candidate was not kept."""
        out = list(assignment)
        for c, gids in self.members.items():
            counts: dict[int, int] = {}
            for g in gids:
                counts[assignment[g]] = counts.get(assignment[g], 0) + 1
            k = max(counts, key=counts.get)  # the first of the most common (insertion order)
            if k not in self.position[c]:
                return None
            for g in gids:
                out[g] = k
        return out


@dataclass(frozen=True)
class _Run:
    """What one HiGHS run returned."""

    found: np.ndarray | None  # the best solution's variables (None: none found)
    status: str
    bound: float  # the dual bound, seconds (-inf: none proven)
    nodes: int  # branch-and-bound nodes
    iterations: int  # simplex iterations


def _run_highs(prog: _Program, start: np.ndarray | None, capacity: float, *, time_limit: float,
               mip_rel_gap: float, integral: bool = True) -> _Run:
    """Solve ``prog`` with HiGHS from ``start`` (``integral=False``: its LP relaxation, whose
    optimum is the bound)."""
    # Step times are seconds (1e-6 for a tiny model): HiGHS's absolute tolerances (mip_abs_gap
    # 1e-6, dual feasibility 1e-7) would call a plan 50% above the optimum "optimal". The program
    # is solved in units of its trivial bound, with no absolute gap.
    # A choice priced infinitely (a layout change XLA's partitioner fails on, made by one
    # constraint: CostModel.reshard) is ruled out: its variable fixed at 0.
    never = ~np.isfinite(prog.cost)
    cost = np.where(never, 0.0, prog.cost)
    positive = cost[cost > 0]
    unit = prog.trivial_bound if 0 < prog.trivial_bound < np.inf else \
        (float(positive.max()) if positive.size else 1.0)
    # Memory in units of its largest entry: bytes (a capacity of 1e10) beside the 0/1 rows made
    # HiGHS warn that the program is badly scaled for its tolerances. (In units of the capacity,
    # small tensors' bytes fell below HiGHS's matrix tolerance and were dropped.)
    values = prog.matrix.data.copy()
    on_memory = prog.matrix.indices == prog.n_rows - 1
    mem_unit = float(np.abs(values[on_memory]).max(initial=0.0)) or 1.0
    values[on_memory] /= mem_unit
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = prog.n, prog.n_rows
    lp.col_cost_ = cost / unit
    lp.col_lower_ = np.zeros(prog.n)
    lp.col_upper_ = np.where(never, 0.0, 1.0)
    lp.row_lower_ = np.where(np.isfinite(prog.row_lo), prog.row_lo, -highspy.kHighsInf)
    lp.row_upper_ = np.concatenate([prog.row_hi_wo_memory, [capacity / mem_unit]])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = prog.matrix.indptr
    lp.a_matrix_.index_ = prog.matrix.indices
    lp.a_matrix_.value_ = values
    if integral:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * prog.n_x + \
            [highspy.HighsVarType.kContinuous] * (prog.n - prog.n_x)
    solution = highspy.HighsSolution()
    if start is not None:
        solution.col_value = start
        solution.value_valid = True

    def run(threads: int):
        h = highspy.Highs()
        for option, value in (("output_flag", False), ("threads", threads), ("random_seed", 0),
                              ("time_limit", float(time_limit)),
                              ("mip_rel_gap", float(mip_rel_gap)), ("mip_abs_gap", 0.0),
                              ("presolve_rule_off", _NO_PROBING)):
            h.setOptionValue(option, value)
        h.passModel(lp)
        if start is not None:
            h.setSolution(solution)
        return h, h.run()

    # One thread: deterministic and polite on shared machines. HiGHS refuses a thread count other
    # than its process-wide scheduler's (set by an earlier solve elsewhere in the process); then
    # it runs on that scheduler.
    h, run_status = run(1)
    if run_status == highspy.HighsStatus.kError \
            and h.getModelStatus() == highspy.HighsModelStatus.kNotset:
        log.debug("HiGHS refused threads=1 (its scheduler was set up before); using its own")
        h, run_status = run(0)
    model_status = h.getModelStatus()
    info = h.getInfo()
    found = None
    if info.primal_solution_status == int(highspy.SolutionStatus.kSolutionStatusFeasible):
        found = np.asarray(h.getSolution().col_value)
    if model_status == highspy.HighsModelStatus.kOptimal:
        status = "optimal"
    elif model_status == highspy.HighsModelStatus.kTimeLimit:
        status = "time limit"
    else:
        status = h.modelStatusToString(model_status).lower()
        log.warning("HiGHS stopped with %r (run status %s); returning the best plan known",
                    status, run_status)
    if integral:
        bound = float(info.mip_dual_bound)
    else:
        bound = float(info.objective_function_value) if status == "optimal" else -np.inf
    return _Run(found=found, status=status, bound=bound * unit, nodes=int(info.mip_node_count),
                iterations=int(info.simplex_iteration_count))


def _class_times(cm: CostModel, gids: list[int], keep: list[int]) -> np.ndarray:
    """``sum(cm.table_time(g, k) for g in gids)`` for each ``k`` of ``keep``: the groups' times
    added in the same order (the same floats). Without program runs a group's time is its table
    class's (:meth:`CostModel.table`), looked up once per class, not once per group."""
    if not gids:
        return np.zeros(len(keep))
    by_rep: dict[int, np.ndarray] = {}
    out = None
    for g in gids:
        if cm.program_runs is None:
            row = by_rep.get(cm.table_rep[g])
            if row is None:
                row = by_rep[cm.table_rep[g]] = np.array([cm.table_time(g, k) for k in keep],
                                                         dtype=np.float64)
        else:
            row = np.array([cm.table_time(g, k) for k in keep], dtype=np.float64)
        # (0 + t) is t, as Python's sum starts: the first row is the first partial sum
        out = row.copy() if out is None else out + row
    return out


def _shared_terms(cm: CostModel, cls_of, keep, node_cost, edge_cost) -> dict[tuple, float]:
    """The layout changes of shared values (:meth:`CostModel.shared_items`) as the program
    charges them: once per (value, source layout, target layout), however many readers need it.

    A change only one reader can need is a pairwise term: added to ``node_cost`` (the reader in
    the producer's class) or ``edge_cost`` in place. A change several can need is a variable
    ``z`` at least each reading's indicator (``sum`` of the y entries where the producer's class
    has the source layout and the reader's class the target one; of x entries within one
    class), so ``z`` is their maximum at the optimum. Readers charged differently (a change
    deferred for some) are levels: ``z_j`` over the readers charged at least ``w_j``, costing
    ``w_j - w_(j+1)``, which adds up to the dearest reading's charge, as
    :meth:`CostModel.shared_time` charges it. Returns ``{readings: cost}`` with each reading
    ``("x", class, positions)`` or ``("y", producer class, reader class, source positions,
    target positions)``; equal readings (tied repeated layers) share one variable.
    """
    hyper: dict[int, float] = defaultdict(float)
    pairs: dict[int, float] = defaultdict(float)  # equal pairwise terms added up first
    memo: dict[tuple, list] = {}  # repeated layers' values have the same terms
    # A term's key (its readings, or (a, b, S, D): tuples of many positions) as a small id,
    # hashed once per value's terms rather than once per value: the sums are added in the
    # same order under either key.
    ids: dict[tuple, int] = {}
    # What the key reads, by table class (the value's and the readers' ids in their table
    # classes' first groups, the classes, the deferral and runs): equal for the values of
    # repeated layers, whose keys (layouts of every kept candidate) are then not made again.
    by_tables: dict[tuple, list] = {}
    for v, readers in cm.shared_items():
        gp = cm.group_of_value[v]
        a = cls_of[gp]
        val = cm.graph.values[v]
        ids_p = cm.table_ids(gp)
        pre = (a, cm.table_rep[gp], v if ids_p is None else ids_p[1].get(v, -1), val.shape,
               val.dtype, tuple(_reader_key(cm, cls_of, *r) for r in readers))
        terms = by_tables.get(pre)
        if terms is None:
            srcs = tuple(cm.spec(gp, k, v) for k in keep[a])
            dsts = tuple((cls_of[gc], nid in cm.tail, tuple(cm.required(gc, c, nid, k)
                                                             for c in keep[cls_of[gc]]))
                         for gc, nid, k in readers)
            key = (a, val.shape, val.dtype, srcs, dsts, tuple(cm.runs(r[1]) for r in readers))
            terms = memo.get(key)
            if terms is None:
                terms = memo[key] = [
                    (t[0] == "pair",
                     ids.setdefault(t[1:5] if t[0] == "pair" else t[1], len(ids)),
                     t[5] if t[0] == "pair" else t[2])
                    for t in _value_terms(cm, v, a, srcs, dsts, [r[1] for r in readers])]
            by_tables[pre] = terms
        for is_pair, i, w in terms:
            if is_pair:
                pairs[i] += w
            else:
                hyper[i] += w
    keys = list(ids)
    for i, w in pairs.items():
        _add_pairwise(*keys[i], w, keep, node_cost, edge_cost)
    return {keys[i]: w for i, w in hyper.items()}


def _reader_key(cm: CostModel, cls_of, gc: int, nid: int, k: int) -> tuple:
    """What :func:`_shared_terms`' key reads of a reader: its class, its group's table
    class, the node (or input) and operand there, its deferral and its runs."""
    ids = cm.table_ids(gc)
    if nid == -1:
        vin = cm.graph.inputs[k]
        where = (-1, vin if ids is None else ids[1].get(vin, -1))
    else:
        where = (nid if ids is None else ids[0][nid], k)
    return (cls_of[gc], cm.table_rep[gc], where, nid in cm.tail, nid < 0, cm.runs(nid))


def _value_terms(cm: CostModel, v: int, a: int, srcs: tuple, dsts: tuple, nids: list) -> list:
    """:func:`_shared_terms` of one value: ``("pair", a, b, S, D, w)`` and ``("z", readings,
    w)`` terms."""
    out: list = []
    src_pos = _positions(srcs)
    dst_pos = [(b, nid, _positions(d)) for (b, _, d), nid in zip(dsts, nids)]
    # reading_time of every (source, target) pair, reader by reader (0: no change)
    sources = list(src_pos)
    times = [cm.reading_matrix(v, nid, sources, list(pos)).tolist() for _, nid, pos in dst_pos]
    # One term per source layout: the sum over the producer's candidates of one layout is as
    # strong as the program gets (merging source layouts of equal charge into one term makes
    # fewer variables, but a weaker relaxation: HiGHS took several times longer).
    for i, (s, S) in enumerate(src_pos.items()):
        if s is None:
            continue
        need: dict = defaultdict(list)  # target layout -> [(reader's class, positions, s)]
        for (b, _nid, pos), rows in zip(dst_pos, times):
            for w, (d, D) in zip(rows[i], pos.items()):
                if w > 0:
                    need[d].append((b, D, w))
        _need_terms(a, S, need, out)
    return out


def _need_terms(a: int, S, need: dict, out: list) -> None:
    """Append the terms of one source layout (positions ``S`` of class ``a``) to ``out``:
    ``need`` maps each target layout to its readers' ``(class, positions, reading time)``.
    Each distinct time level is one term over the readers that need at least that much."""
    for entries in need.values():
        levels = sorted({w for *_, w in entries}, reverse=True)
        for j, wj in enumerate(levels):
            below = levels[j + 1] if j + 1 < len(levels) else 0.0
            # Readers in one class take one candidate: one reading, the union of their
            # positions. Readers in one class alone are a pairwise term.
            by_class: dict[int, set] = defaultdict(set)
            for b, D, w in entries:
                if w >= wj:
                    by_class[b].update(D)
            if a in by_class:
                by_class[a] &= set(S)
                if not by_class[a]:
                    del by_class[a]
            if len(by_class) == 1:
                (b, D), = by_class.items()
                out.append(("pair", a, b, tuple(S), tuple(sorted(D)), wj - below))
            elif by_class:
                readings = tuple(sorted(
                    ("x", a, tuple(sorted(D))) if b == a else
                    ("y", a, b, tuple(S), tuple(sorted(D)))
                    for b, D in by_class.items()))
                out.append(("z", readings, wj - below))


def _add_pairwise(a, b, S, D, w, keep, node_cost, edge_cost) -> None:
    """Charge ``w`` where class ``a`` takes a position of ``S`` and class ``b`` one of ``D``
    (within one class: a position of both)."""
    if a == b:
        node_cost[a][sorted(set(S) & set(D))] += w
        return
    key = (a, b) if a < b else (b, a)
    m = edge_cost.get(key)
    if m is None:
        m = edge_cost[key] = np.zeros((len(keep[key[0]]), len(keep[key[1]])))
    if a < b:
        m[np.ix_(S, D)] += w
    else:
        m[np.ix_(D, S)] += w


def _parts(m: np.ndarray, cuts: list, aggregate: bool = True) -> tuple[np.ndarray, list[int]]:
    """The parts of a y block's side: positions (rows of ``m``) with equal costs to every
    candidate of the other side and inside the same sets of ``cuts`` (the positions shared
    changes' readings select). Returns each position's part and each part's first position, parts
    in order of first position; ``aggregate=False`` gives every position a part of its own (the
    candidate-by-candidate program, which the tests compare)."""
    k = m.shape[0]
    if not aggregate or k < 2:
        return np.arange(k), list(range(k))
    sig = m
    cuts = list(dict.fromkeys(cuts))  # many readings select the same positions
    if cuts:
        inside = np.zeros((k, len(cuts)))
        for j, c in enumerate(cuts):
            inside[list(c), j] = 1.0
        sig = np.concatenate([m, inside], axis=1)
    _, first, label = np.unique(sig, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # parts numbered by first position
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[label.ravel()], sorted(first.tolist())


def _positions(items) -> dict:
    """``{item: [positions where it occurs]}``, in order of first occurrence."""
    out: dict = {}
    for i, it in enumerate(items):
        out.setdefault(it, []).append(i)
    return out


def _cand_key(grp) -> tuple:
    return tuple(grp.candidates) if grp.kind == INPUT else len(grp.candidates)
