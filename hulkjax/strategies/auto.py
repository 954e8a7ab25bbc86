"""``strategy="auto"`` (default): the planner network's prior, then search against the cost model.

TAG-style: the network (:mod:`hulkjax.gnn`) scores every candidate of every group of the joined
operator + device graph and shortlists each group's ``top_k`` most likely candidates (plus the
replicated one and the baselines' choices). The search judges only with the cost model: the exact
optimum of the integer program restricted to the shortlist (repeated layers tied, so it is small),
then coordinate descent from it over the shortlist with layers untied. Then large-neighbourhood
rounds: the shortlist widened around that plan (each group's cheapest candidates given it, and
the layouts one mesh axis away from its own), solved exactly again and descended, while that
improves: on meshes of three axes the network's top candidates miss layouts of the optimum.
``auto`` returns the best of these and the baselines' plans that fits in memory, so it is never
worse than any baseline. Where the whole program is small (a mesh of at most
:data:`FULL_PROGRAM_AXES` axes, at most ``full_program`` candidate pairs), ``auto`` solves it
instead of the shortlist's, then descends over the shortlist from its optimum; the rounds run
only if that solve stops at its time limit (with nothing left out, they have nothing to find).

Without shipped weights (or with ``prior_kind="uniform"``, the ablation), the shortlist is
``top_k`` candidates per group drawn uniformly: the same search budget with no learned prior.

Where the topology has device groups, staged plans compete (:mod:`hulkjax.strategies.stages`):
the device-group head (:mod:`hulkjax.gnn.groups`) proposes ``head_orders`` orders of the groups
for the staged search to run its dynamic program along, on top of its own; the search costs
their layouts after its own, so they can only make the staged plan faster. Its shipped weights
are trained, but on held-out labels its orders are no better than random ones (1.0066x the best
order with the search's own, against 1.0043x with a random order; README, "The learned
planner"): what it adds is one more dynamic program per microbatch count searched and two or
three more exact costs.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from hulkjax.cost.model import LEADER
from hulkjax.errors import InfeasiblePlanError
from hulkjax.formatting import format_spec
from hulkjax.gnn import features as F
from hulkjax.gnn.groups import group_log_probs, propose_orders, stage_features
from hulkjax.gnn.infer import log_probs
from hulkjax.gnn.weights import load
from hulkjax.plan.records import Plan
from hulkjax.plan.specs import to_pspec
from hulkjax.rules.loops import LoopResolution
from hulkjax.strategies.baselines import baseline_assignments
from hulkjax.strategies.feasibility import infeasible_error
from hulkjax.strategies.ilp import program_pairs, solve
from hulkjax.strategies.realize import cost_model, plan_from_assignment
from hulkjax.strategies.registry import register_strategy
from hulkjax.strategies.search import coordinate_descent, neighbours, polish_memory, widen
from hulkjax.strategies.stages import device_groups, microbatch_counts, spmd_or_staged
from hulkjax.trace.graph import OpGraph

log = logging.getLogger("hulkjax.auto")
# Candidates per group the network shortlists. With 16 the shortlist held the ILP's choice for
# 92-100% of groups on held-out graphs (4: 42-100%, 8: 83-100%); see benchmarks/gnn_eval.py.
TOP_K = 16
# ``auto`` solves the whole integer program instead of the network's shortlist on meshes of at
# most two axes where it couples at most this many candidate pairs (ilp.program_pairs). On every
# family of benchmarks/ILP.md there (48-770 thousand pairs) the program over parts proves its
# optimum in 0.1-6 s of HiGHS; against the shortlist and its neighbourhood rounds it reached the
# same 16 plans in about the same time in all (47.9 against 47.2 CPU s; 0.70-0.81x where the
# shortlist needed a round or its descent, 1.06-1.27x where it did not, 1.6-1.8x on LLaMA and
# Gemma on 2x4, whose relaxations are not integral; 40.0 against 44.3 since HiGHS runs without
# probing), and LLaMA-70B on 256 H100 (two rounds there) in 8.5 CPU s instead of 11.2
# (benchmarks/PLANNING.md). On 2x2x2 meshes the same families' programs (0.9-3.6
# million pairs) took 12 s to over 60 s, where the shortlist keeps auto at a few seconds.
FULL_PROGRAM_PAIRS = 800_000
FULL_PROGRAM_AXES = 2
HEAD_ORDERS = 1  # orders of the device groups the device-group head proposes by default


def stage_graph(part, topology, groups):
    """The device-group head's :class:`~hulkjax.gnn.groups.StageGraph` of a partitioned step
    (:class:`~hulkjax.strategies.partition.Partition`) on ``groups`` of ``topology``."""
    counts = microbatch_counts(part, len(groups))
    return stage_features(part.graph, part.phase, part.unit, part.home,
                          [u.label for u in part.units], topology, groups,
                          microbatches=max(counts))


def head_orders(n: int = HEAD_ORDERS, *, weights: str | None = None):
    """The staged search's ``propose`` hook (:func:`hulkjax.strategies.stages.search`): the
    ``n`` orders of the groups the shipped device-group head makes likeliest
    (:func:`~hulkjax.gnn.groups.propose_orders`), for levels of as many groups as it was
    trained on (3-4, ``groups.json``); ``None`` without its weights or with ``n`` 0.

    >>> propose = head_orders()
    >>> propose is None or callable(propose)
    True
    """
    loaded = load(weights, name="groups") if n > 0 else None
    if loaded is None:
        return None

    lo, hi = loaded.meta.get("groups", (2, 8))

    def propose(part, topology, level, groups):
        if len(part.units) < 2 or not lo <= len(groups) <= hi:
            return []  # where it was not trained
        logp = group_log_probs(loaded.params, stage_graph(part, topology, groups),
                               layers=loaded.layers)
        return propose_orders(logp, n)

    return propose


def prior(cm, *, weights: str | None = None) -> np.ndarray | None:
    """Log-probabilities ``[groups, K]`` of every candidate under the shipped network (or None)."""
    loaded = load(weights)
    if loaded is None or len(cm.mesh.axis_names) > F.MAX_AXES:
        return None
    # The network in NumPy: one call per plan is not worth a compilation.
    return log_probs(loaded.params, F.build(cm), layers=loaded.layers)


def shortlist(cm, logp: np.ndarray | None, *, top_k: int = TOP_K, seed: int = 0,
              seeds: dict[str, list[int]] | None = None) -> tuple[list[int], dict[int, list[int]]]:
    """Each group's ``top_k`` most likely candidates under ``logp`` (uniformly drawn without it),
    the replicated candidate, whatever the ``seeds`` assignments use, and for a split operator
    every way of finishing the split (all-reduce, or reduce-scatter onto any dimension).

    Returns the most likely assignment (the replicated one without a prior) and the shortlist.
    """
    rng = np.random.default_rng(seed)
    start, options = [], {}
    for grp in cm.groups:
        n = len(grp.candidates)
        if logp is not None:
            scores = logp[grp.id, :min(n, logp.shape[1])]
            order = list(np.argsort(-scores, kind="stable"))
            start.append(int(order[0]))
        else:
            order = list(rng.permutation(n))
            start.append(0)
        chosen = {0, *[int(c) for c in order[:top_k]]}
        for a in (seeds or {}).values():
            chosen.add(a[grp.id])
        if grp.kind == LEADER and isinstance(grp.candidates[0], LoopResolution):
            # A loop's candidates are whole body plans, few, and they pair across loops (a
            # backward scan mirrors its forward one), which no per-group score sees: all kept.
            chosen.update(range(n))
        elif grp.kind == LEADER:
            # With a split, every way of finishing it: all-reduce, or reduce-scatter along any
            # result dimension (candidates with the same operand layouts). Which is best depends
            # on where the result goes, which the search sees and a per-group score does not.
            siblings = defaultdict(list)
            for c, r in enumerate(grp.candidates):
                siblings[r.in_specs].append(c)
            for c in list(chosen):
                chosen.update(siblings[grp.candidates[c].in_specs])
        options[grp.id] = sorted(chosen)
    return start, options


def search(cm, logp: np.ndarray | None, *, top_k: int = TOP_K, sweeps: int = 4, seed: int = 0,
           seeds: dict[str, list[int]] | None = None) -> tuple[list[int], dict[int, list[int]]]:
    """Coordinate descent over the :func:`shortlist`, from the prior's choice and from each seed.

    Returns the best assignment found and the candidates searched per group.
    """
    start, options = shortlist(cm, logp, top_k=top_k, seed=seed, seeds=seeds)
    free = [grp.id for grp in cm.groups if len(options[grp.id]) > 1]
    best = None
    for init in [start, *(seeds or {}).values()]:
        a = coordinate_descent(cm, init, free, sweeps=sweeps, candidates=options)
        if best is None or cm.objective(a) < cm.objective(best):
            best = a
    return best, options


@dataclass(frozen=True, kw_only=True)
class AutoOptions:
    """Options of ``strategy="auto"``.

    Attributes:
      top_k: candidates per group the network shortlists (plus the replicated one and the
        baselines' choices; a loop keeps all its candidates).  # int
      sweeps: coordinate-descent passes after the exact solve (or from each start without it).
      prior_kind: ``"gnn"`` (the shipped network) or ``"uniform"`` (ablation: no learned prior).
      weights: a directory with other trained weights (``hulkjax train-gnn --out``).  # str | None
      seed: seed of the uniform shortlist.  # int
      exact: solve the integer program over the shortlist (repeated layers tied, so it is small),
        within ``time_limit`` seconds, then let coordinate descent untie layers where that helps.
        Without it (or if no plan over the shortlist fits): coordinate descent from the network's
        choice and from each baseline.  # bool
      full_program: with ``exact``, solve the whole program (every candidate, as ``ilp`` does)
        instead of the shortlist where it is small: a mesh of at most
        :data:`FULL_PROGRAM_AXES` axes and at most this many candidate pairs
        (:func:`~hulkjax.strategies.ilp.program_pairs`). Descent over the shortlist follows, and
        no neighbourhood rounds where the solve proves its optimum (nothing is left out to find);
        stopped by ``time_limit`` first, the rounds run from its plan as from the shortlist's.
        0: always the shortlist.  # int
      time_limit: seconds for the first integer program, the shortlist's or the whole one
        (it then keeps its best plan so far, which starts from the best of the network's choice
        and the baselines), and as much again for the neighbourhood rounds together.  # float
      widen: candidates per group each neighbourhood round adds to the shortlist: the cheapest
        given the plan found so far (0: only the layouts that differ from the plan's on one mesh
        axis, which every round adds).  # int
      rounds: neighbourhood rounds at most (each an exact solve over the shortlist widened
        around the best plan so far, then descent); they stop at the first that finds no better
        plan (0: none, the shortlist's optimum and descent only).  # int
      stages: also consider staged plans where the topology has device groups (regions, nodes,
        GPU kinds): the staged search of :mod:`hulkjax.strategies.stages` and the ``pipeline``
        baseline; a staged plan is returned only where it beats the SPMD one.  # bool
      head_orders: orders of the device groups the device-group head (Hulk's distribution
        over groups per layer, :mod:`hulkjax.gnn.groups`) proposes to the staged search, on
        top of its own three (0: none; each order costs one more dynamic program per
        microbatch count; the head's weights are read from ``weights`` too).  # int
      optimizer_apart: decide each optimizer state's layout apart from its parameter's (the
        distributed optimizer; see :class:`~hulkjax.strategies.ilp.ILPOptions`). The network
        was trained with state tied to its parameter: it scores the state's own layouts as it
        scores an argument's. The staged search's stages decide it so too (see
        :class:`~hulkjax.strategies.ilp.ILPOptions`).  # bool
    """

    top_k: int = TOP_K
    sweeps: int = 2
    prior_kind: str = "gnn"
    weights: str | None = None
    seed: int = 0
    exact: bool = True
    full_program: int = FULL_PROGRAM_PAIRS
    time_limit: float = 10.0
    widen: int = 8
    rounds: int = 4
    stages: bool = True
    head_orders: int = HEAD_ORDERS
    optimizer_apart: bool = False

    def __post_init__(self):
        if self.prior_kind not in ("gnn", "uniform"):
            raise ValueError(f"prior_kind={self.prior_kind!r}: use 'gnn' or 'uniform'")
        if not self.time_limit >= 0:
            raise ValueError(f"time_limit={self.time_limit!r}: use seconds >= 0")
        for name, zero in (("widen", "only the one-axis changes"),
                           ("rounds", "no neighbourhood search"),
                           ("full_program", "always the shortlist")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
                raise ValueError(f"{name}={v!r}: use an int >= 0 (0: {zero})")
        if not (isinstance(self.head_orders, int) and self.head_orders >= 0):
            raise ValueError(f"head_orders={self.head_orders!r}: use an int >= 0 (0: no "
                             "proposals from the device-group head)")


@register_strategy("auto", options=AutoOptions)
def auto(graph: OpGraph, topology, options: AutoOptions) -> Plan:
    """Plan with the network's prior and cost-model search; never worse than a baseline. With
    ``stages``, staged plans compete where the topology has device groups: the staged search
    (its dynamic program and intra-stage ILPs, along its own orders of the device groups and
    the device-group head's ``head_orders``) and the ``pipeline`` baseline; ``auto`` returns a
    staged plan only where it is faster."""
    if not options.stages or not device_groups(topology):
        return spmd_auto(graph, topology, options)
    return spmd_or_staged(graph, topology, lambda: spmd_auto(graph, topology, options),
                          strategy="auto", solver=solve, time_limit=options.time_limit,
                          propose=head_orders(options.head_orders, weights=options.weights),
                          optimizer_apart=options.optimizer_apart)


def spmd_auto(graph: OpGraph, topology, options: AutoOptions) -> Plan:
    """The SPMD part of ``auto``: network prior, shortlist, exact solve and descent."""
    top_k, sweeps, seed = options.top_k, options.sweeps, options.seed
    cm = cost_model(graph, topology, optimizer_apart=options.optimizer_apart)
    t0 = time.perf_counter()
    logp = prior(cm, weights=options.weights) if options.prior_kind == "gnn" else None
    t_prior = time.perf_counter() - t0
    baselines = baseline_assignments(graph, topology, optimizer_apart=options.optimizer_apart)
    start, options_ = shortlist(cm, logp, top_k=top_k, seed=seed, seeds=baselines)
    candidates = dict(baselines)
    solved = whole = False
    if options.exact:
        whole = len(cm.mesh.axis_names) <= FULL_PROGRAM_AXES \
            and program_pairs(cm) <= options.full_program
        label = "optimum" if whole else "shortlist optimum"
        try:
            res = solve(cm, seeds=[start, *baselines.values()],
                        restrict=None if whole else options_,
                        time_limit=options.time_limit, polish=False)
            if whole:  # descent (and memory polish) may keep what the whole program chose
                options_ = {g: sorted({*o, res.assignment[g]}) for g, o in options_.items()}
            free = [g.id for g in cm.groups if len(options_[g.id]) > 1]
            candidates[label] = res.assignment  # within the memory limit
            candidates[f"{label} + descent"] = coordinate_descent(
                cm, res.assignment, free, sweeps=sweeps, candidates=options_)
            solved = True
            if not (whole and res.status == "optimal"):
                found = _neighbourhood_search(cm, candidates[f"{label} + descent"],
                                              res.assignment, options_, options)
                if found is not None:
                    candidates["neighbourhood optimum + descent"], options_ = found
        except InfeasiblePlanError:
            pass
    if not solved:
        found, _ = search(cm, logp, top_k=top_k, sweeps=max(sweeps, 4), seed=seed, seeds=baselines)
        candidates["search"] = found
    # The fastest candidate whose liveness peak fits (walked in order of speed: usually one walk).
    peaks = {}
    for name in sorted(candidates, key=lambda k: cm.objective(candidates[k])):
        peaks[name] = cm.peak_memory(candidates[name])
        if peaks[name] <= cm.capacity:
            best = name
            break
    else:
        raise infeasible_error(cm, min(peaks.values()), planner="auto", exhaustive=False, also=(
            "strategy='ilp' (it searches every layout under the memory limit, not a shortlist)"))
    chosen = candidates[best]
    chosen = polish_memory(cm, chosen,
                           candidates={g: sorted({*o, chosen[g]}) for g, o in options_.items()})
    source = "network prior + search" if logp is not None else "uniform prior + search"
    if whole and solved:
        source += " (the whole program solved: it is small)"
    notes = [f"auto: {source}; best of search and baselines: {best!r} "
             f"({cm.objective(chosen) * 1e3:.4g} ms); prior {t_prior:.2f} s"]
    return plan_from_assignment(cm, chosen, "auto", notes, source=best)


def _neighbourhood_search(cm, incumbent: list[int], tied: list[int],
                          options_: dict[int, list[int]], options: AutoOptions):
    """Large-neighbourhood search around ``incumbent`` (the shortlist optimum after descent;
    ``tied``: the shortlist optimum, layers tied): each round adds to every group's shortlist its
    ``options.widen`` cheapest candidates given the incumbent and the candidates one mesh axis
    away from the incumbent's (:func:`widen`), solves the integer program over the wider
    shortlist (layers tied) from the incumbent, then descends; it stops when a round finds
    nothing better, after ``options.rounds``, or when the rounds have spent
    ``options.time_limit`` seconds together.

    Where the network ranks an optimum's layouts low (on 3-axis meshes a weight gradient's
    second split axis, ranked 35th-65th of 138 on ViT), the shortlist misses them; they are
    cheap given the incumbent's neighbours or one axis away from its layouts, and the rounds
    take them in (on the 2x2x2 mesh of ``benchmarks/ilp.py`` they close auto's 2.5-3.0% gap to
    the ILP's optimum on GPT-2 and ViT).

    Returns ``(the best plan found, the shortlist it was found in)``, or None if no round
    improved on the incumbent.
    """
    nb, roles = neighbours(cm), {}
    best, best_t, found = incumbent, cm.objective(incumbent), None
    deadline = time.perf_counter() + options.time_limit
    for _ in range(options.rounds):
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        wider, added = widen(cm, best, options_, extra=options.widen, nb=nb, roles=roles)
        if not added:
            break
        try:
            res = solve(cm, seeds=[best, tied], restrict=wider, time_limit=left, polish=False)
        except InfeasiblePlanError:
            break
        free = [g for g, o in wider.items() if len(o) > 1]
        a = coordinate_descent(cm, res.assignment, free, sweeps=options.sweeps, candidates=wider)
        options_ = wider
        t = cm.objective(a)
        log.debug("neighbourhood round: %d candidates added, %.6g -> %.6g", added, best_t, t)
        if not t < best_t * (1 - 1e-9):
            break
        best, best_t, tied, found = a, t, res.assignment, (a, wider)
    return found


def predict(graph: OpGraph, topology, *, top: int = 3, weights: str | None = None) -> list[dict]:
    """The network's most likely candidates for every group that has a choice.

    Returns one row per group: ``{"group", "kind", "op", "layer", "candidates": [(label, p, index)]}``
    where ``label`` names the layout (a spec for inputs, a split description for operators) and
    ``index`` is the candidate's index, comparable with a plan's ``assignment[group]``.

    >>> import hulkjax as hj, jax.numpy as jnp
    >>> g = hj.trace(lambda w, x: (w, x @ w), jnp.ones((64, 64)), jnp.ones((32, 64)))
    >>> rows = predict(g, hj.Topology.grid((4,), ("x",)))
    >>> 0 < rows[0]["candidates"][0][1] <= 1
    True
    """
    cm = cost_model(graph, topology)
    logp = prior(cm, weights=weights)
    if logp is None:
        raise FileNotFoundError("no trained weights found in hulkjax/gnn/weights; run "
                                "hulkjax train-gnn")
    rows = []
    for grp in cm.groups:
        n = min(len(grp.candidates), logp.shape[1])
        if n < 2:
            continue
        p = np.exp(logp[grp.id, :n])
        order = np.argsort(-p)[:top]
        if grp.kind == "input":
            op, layer = graph.input_paths[grp.inputs[0]], ""
            label = lambda c: format_spec(to_pspec(c))  # noqa: E731
        else:
            node = graph.nodes[grp.leader]
            op, layer = node.name, node.layer
            label = lambda c: c.label  # noqa: E731
        rows.append({"group": grp.id, "kind": grp.kind, "op": op, "layer": layer,
                     "candidates": [(label(grp.candidates[int(c)]), float(p[c]), int(c))
                                    for c in order]})
    return rows
