"""A traced step cut into layers and phases: the units a staged plan places on device groups.

Where this sits::

    OpGraph --(trace.microbatch: what runs per microbatch)--> Partition: phase and layer unit of
    every node --> strategies.stages (a contiguous run of units per stage) --> Plan.stages

**Phases** (from the data flow, :mod:`hulkjax.trace.microbatch`): nodes reading per-example values
run once per microbatch; among them the *backward* ones are those of JAX's backward pass
(``Node.backward``, which includes the recomputation of rematerialized layers) and those whose
every use is backward; the rest is *forward*. Everything else (the optimizer, and what it computes
from gradients and the loss) is the *update*, run once per step on the combined microbatches.

**Layer units**: forward nodes in program order, grouped by their module scope cut to a depth
(``"GPT2/h_3"``); a scope that encloses its neighbours' (``"GPT2"`` between ``"GPT2/wte"`` and
``"GPT2/h_0"``: the position embedding, a residual add) and unscoped nodes (the loss) join the unit
before them. The depth is the deepest with at most ``max_units`` units (when that is much coarser,
the next depth with consecutive units merged in equal chunks). Contiguous runs of units in
program order are what stages take, so a stage's forward pass only needs earlier stages.

**Backward and update nodes** go to the unit of the layer they belong to: a backward node to the
unit of its module scope (JAX names a transposed operator, and the recomputation of a
rematerialized layer, with the scope of the forward operator; ``Node.layer``) where that scope
names one unit; otherwise, from the data flow, to the latest unit whose activations or parameters
it reads, else the earliest of the gradients it reads (a constant made in place goes to its uses);
then each is raised to the unit of its backward uses, so gradients only flow to earlier stages. Parameters live with the unit of their
first forward use (optimizer state with its parameter); an update node goes with the state it
updates, or the earliest unit that uses its result.

>>> import jax, jax.numpy as jnp, hulkjax as hj
>>> from hulkjax import zoo
>>> m = zoo.get("mlp", size="tiny")
>>> p = partition(hj.trace(m.step, *m.abstract()))
>>> [u.label for u in p.units]
['MLP/dense_0', 'MLP/dense_1', 'MLP/head']
>>> sorted(set(p.phase))
['B', 'F', 'U']
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hulkjax.cost.memory import host_copies
from hulkjax.errors import UnsupportedStepError
from hulkjax.trace.graph import DATA, OPTIMIZER, PARAMETER, OpGraph
from hulkjax.trace.microbatch import BatchSplit, analyze, batch_size, microbatch_graph
from hulkjax.trace.primitives import PASS_THROUGH

FORWARD, BACKWARD, UPDATE = "F", "B", "U"
MAX_UNITS = 48


@dataclass(frozen=True)
class Unit:
    """One layer unit: a contiguous run of the forward pass.

    Attributes:
      label: the module scope (``"GPT2/h_3"``).  # str
      index: its position.  # int
    """

    label: str
    index: int


@dataclass
class Partition:
    """Phases and layer units of every node of one step.

    Attributes:
      graph: the step's graph (full batch).
      split: the microbatch analysis (``None`` when the step has no batch to split).
      phase: ``"F" | "B" | "U"`` per node.  # list of str
      unit: layer unit index per node.  # list of int
      units: the units in forward order.  # list of Unit
      home: ``{input index: unit}`` of the state leaves (parameters, optimizer state).  # dict
      depth: the scope depth the units were cut at.  # int
    """

    graph: OpGraph
    split: BatchSplit | None
    phase: list[str]
    unit: list[int]
    units: list[Unit]
    home: dict[int, int]
    depth: int

    @property
    def exact(self) -> bool:
        """Whether microbatching reproduces the step exactly (``split.exact``)."""
        return self.split is not None and self.split.exact

    def problems(self) -> list[str]:
        """Why the step can only run as one microbatch (empty when it can be split)."""
        if self.split is None:
            return ["the step has no batch to split (no data argument with a leading "
                    "dimension, or a batch of 1)"]
        return list(self.split.problems)

    def stage_nodes(self, stage_of_unit) -> dict[tuple[int, str], tuple[int, ...]]:
        """``{(stage, phase): node ids}`` of every stage and phase that has nodes, each in
        program order, from one walk of the graph."""
        out: dict[tuple[int, str], list[int]] = {}
        for n in self.graph.nodes:
            out.setdefault((stage_of_unit[self.unit[n.id]], self.phase[n.id]), []).append(n.id)
        return {k: tuple(v) for k, v in out.items()}


def partition(graph: OpGraph, *, max_units: int = MAX_UNITS) -> Partition:
    """The phases and layer units of ``graph`` (cached on the graph per ``max_units``)."""
    key = ("partition", max_units)
    hit = graph.memo.get(key)
    if hit is not None:
        return hit
    split = _split(graph)
    phase = _phases(graph, split)
    depth, f_units, labels, scopes = _forward_units(graph, phase, max_units)
    home = _homes(graph, phase, f_units)
    unit = _assign_units(graph, phase, f_units, home, len(labels), _scope_units(scopes), depth)
    p = Partition(graph=graph, split=split, phase=phase, unit=unit,
                  units=[Unit(lab, k) for k, lab in enumerate(labels)], home=home, depth=depth)
    graph.memo[key] = p
    return p


def _split(graph: OpGraph) -> BatchSplit | None:
    b = batch_size(graph)
    if b is None or b < 2 or graph.fn is None:
        return None
    k = next(d for d in range(2, b + 1) if b % d == 0)
    try:
        return analyze(graph, microbatch_graph(graph, k))
    except UnsupportedStepError:
        return None


def _phases(g: OpGraph, split: BatchSplit | None) -> list[str]:
    if split is not None:
        per = set(split.per_microbatch)
    else:  # no batch: what the backward pass needs of the step, and the backward pass
        per = _backward_closure(g)
    # A step that cannot be microbatched may feed batch aggregates back into per-example work
    # (batch statistics): that work then runs with the update, after them (one microbatch).
    for n in g.nodes:
        if n.id in per and any(v is not None and (p := g.values[v].producer) is not None
                               and p not in per for v in n.inputs):
            per.discard(n.id)
    outputs = {v for v in g.outputs if v is not None}
    # Copies out of device memory into host memory (a remat policy's offload): only the
    # backward pass reads what they copy, but each runs where its operand is made, in the forward
    # pass (XLA's host offloader starts it after the operand's producer), so the value crosses
    # from the forward to the backward program in host memory, not in the device's.
    offloads = {n for n in host_copies(g)
                if any(o is not None and g.values[o].host for o in g.nodes[n].outputs)}
    phase = [UPDATE] * len(g.nodes)
    for n in reversed(g.nodes):
        if n.id not in per:
            continue
        uses = [c for o in n.outputs for c, _ in g.consumers(o)]
        only_backward = bool(uses) and all(c in per and phase[c] == BACKWARD for c in uses) \
            and not any(o in outputs for o in n.outputs) and n.id not in offloads
        phase[n.id] = BACKWARD if n.backward or only_backward else FORWARD
    # A forward node reading a backward result (a gradient penalty) runs in the backward pass.
    for n in g.nodes:
        if phase[n.id] == FORWARD and any(
                v is not None and (p := g.values[v].producer) is not None
                and phase[p] == BACKWARD for v in n.inputs):
            phase[n.id] = BACKWARD
    return phase


def _backward_closure(g: OpGraph) -> set[int]:
    """Backward nodes and their ancestors (the step's gradient computation)."""
    need = {n.id for n in g.nodes if n.backward}
    for n in reversed(g.nodes):
        if n.id in need:
            for v in n.inputs:
                p = None if v is None else g.values[v].producer
                if p is not None:
                    need.add(p)
    return need


# Scope components JAX's transformations add (a rematerialized layer's recomputation runs in
# "rematted_computation" under its own module's scope, repeated): not module scopes.
_TRANSFORM_SCOPES = frozenset({"rematted_computation", "checkpoint", "remat", "jvp", "transpose",
                               "vmap", "pjit", "jit"})


def _label(layer: str, depth: int) -> str:
    parts = []
    for p in layer.split("/"):
        if not p or "->" in p or p in _TRANSFORM_SCOPES or (parts and parts[-1] == p):
            continue
        parts.append(p)
    return "/".join(parts[:depth])


def _forward_units(g: OpGraph, phase, max_units: int):
    """``(depth, {forward node: unit}, labels)``."""
    fwd = [n for n in g.nodes if phase[n.id] == FORWARD]
    best = None
    for depth in range(1, 8):
        runs = _runs(fwd, depth)
        if best is not None and len(runs) > max_units:
            if len(best[1]) < max_units // 4:
                # Too coarse one level up (48 blocks under one model scope): this level's runs,
                # consecutive ones merged so that at most max_units remain.
                best = (depth, _merge_runs(runs, max_units))
            break
        best = (depth, runs)
        if depth > max((len(n.layer.split("/")) for n in fwd), default=0):
            break
    depth, runs = best if best is not None else (1, [])
    f_units, labels, scopes = {}, [], []
    for k, run in enumerate(runs):
        label, members = run[0], run[1]
        labels.append(label)
        scopes.append(run[2] if len(run) > 2 else [label])
        for nid in members:
            f_units[nid] = k
    if not labels:
        labels, scopes = ["(step)"], [["(step)"]]
    return depth, f_units, labels, scopes


def _runs(fwd, depth: int) -> list[tuple[str, list[int]]]:
    runs: list[list] = []
    for n in fwd:
        lab = _label(n.layer, depth)
        if runs and runs[-1][0] == lab:
            runs[-1][1].append(n.id)
        else:
            runs.append([lab, [n.id]])
    # Glue: unscoped runs and scopes enclosing a neighbour's join the run before them.
    out: list[list] = []
    for k, (lab, members) in enumerate(runs):
        nxt = runs[k + 1][0] if k + 1 < len(runs) else None
        prev = out[-1][0] if out else None
        glue = not lab or any(o is not None and o != lab and o.startswith(lab + "/")
                              for o in (prev, nxt))
        if glue and out:
            out[-1][1].extend(members)
        elif out and out[-1][0] == lab:
            out[-1][1].extend(members)
        else:
            out.append([lab if lab else "(step)", members])
    # A leading glue run (nothing before it) joins the run after it.
    if len(out) > 1 and (out[0][0] == "(step)" or out[1][0].startswith(out[0][0] + "/")):
        out[1][1][:0] = out[0][1]
        out.pop(0)
    return [(lab, members) for lab, members in out]


def _merge_runs(runs, max_units: int):
    """Consecutive runs merged in chunks of equal size, at most ``max_units`` of them (each
    keeps the scopes it merged, for :func:`_scope_units`)."""
    size = -(-len(runs) // max_units)
    out = []
    for k in range(0, len(runs), size):
        chunk = runs[k:k + size]
        label = chunk[0][0] if len(chunk) == 1 else f"{chunk[0][0]} + {len(chunk) - 1} more"
        out.append((label, [nid for _, members in chunk for nid in members],
                    [lab for lab, _ in chunk]))
    return out


def _homes(g: OpGraph, phase, f_units) -> dict[int, int]:
    """Unit of each input leaf: parameters and data at their first forward use (through casts
    and reshapes), optimizer state with its parameter, other state at its first use."""
    first: dict[int, int] = {}
    for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
        if role not in (PARAMETER, DATA, OPTIMIZER):
            continue
        todo, seen, best = [vid], {vid}, None
        while todo:
            v = todo.pop()
            for nid, _ in g.consumers(v):
                node = g.nodes[nid]
                if nid in f_units:
                    best = f_units[nid] if best is None else min(best, f_units[nid])
                elif node.primitive in PASS_THROUGH:
                    for o in node.outputs:
                        if o not in seen:
                            seen.add(o)
                            todo.append(o)
        if best is not None:
            first[i] = best
    homes = {}
    for i, role in enumerate(g.input_roles):
        if role == PARAMETER:
            homes[i] = first.get(i, 0)
        elif role == DATA and i in first:
            homes[i] = first[i]
    for i, role in enumerate(g.input_roles):
        if role == OPTIMIZER:
            owner = g.owners.get(i)
            homes[i] = homes.get(owner, first.get(i, 0)) if owner is not None else first.get(i, 0)
    return homes


def _scope_units(scopes: list[list[str]]) -> dict[str, int]:
    """``{module scope: unit}`` for the scopes that name exactly one unit."""
    seen: dict[str, list[int]] = defaultdict(list)
    for k, labs in enumerate(scopes):
        for lab in labs:
            seen[lab].append(k)
    return {lab: ks[0] for lab, ks in seen.items() if len(ks) == 1 and lab != "(step)"}


def _assign_units(g: OpGraph, phase, f_units, home, n_units: int, scopes=None,
                  depth: int = 0) -> list[int]:
    last = max(n_units - 1, 0)
    scopes = scopes or {}
    unit = [0] * len(g.nodes)
    input_home = {g.inputs[i]: u for i, u in home.items()}
    for nid, u in f_units.items():
        unit[nid] = u
    # Backward nodes: the latest layer whose activations or parameters they read; else the
    # earliest unit of the gradients they read; else (constants made in place, the seed of the
    # backward pass) the unit of their uses, found below.
    backward = [n for n in g.nodes if phase[n.id] == BACKWARD]
    for sweep in range(6):  # a few sweeps: gradients move when their producers are raised
        before = [unit[n.id] for n in backward]
        known: dict[int, int | None] = {}
        for n in backward:
            reads, grads = [], []
            for v in n.inputs:
                if v is None:
                    continue
                p = g.values[v].producer
                if p is None:
                    if v in input_home:
                        reads.append(input_home[v])
                elif phase[p] == FORWARD:
                    reads.append(unit[p])
                elif phase[p] == BACKWARD and known.get(p) is not None:
                    grads.append(max(known[p], unit[p]) if sweep else known[p])
            scope = scopes.get(_label(n.layer, depth)) if depth else None
            if scope is not None:  # JAX scopes a gradient as the forward operator it transposes
                known[n.id] = scope
            else:
                known[n.id] = max(reads) if reads else min(grads) if grads else None
        # Gradients flow to earlier units only: raise each backward node to its backward uses.
        for n in reversed(backward):
            uses = [unit[c] for o in n.outputs for c, _c in g.consumers(o)
                    if phase[c] == BACKWARD]
            mine = known[n.id]
            if mine is None:
                unit[n.id] = max(uses) if uses else last
            else:
                unit[n.id] = max(mine, max(uses)) if uses else mine
        if [unit[n.id] for n in backward] == before:
            break
    # Update nodes: with the state they update, else the earliest unit using their result, else
    # the latest unit of what they read.
    carried = {g.outputs[o]: i for i, o in g.carried.items() if g.outputs[o] is not None}
    done: dict[int, int] = {}
    for n in reversed(g.nodes):
        if phase[n.id] != UPDATE:
            continue
        state = [carried[o] for o in n.outputs if o in carried]
        if state:
            done[n.id] = home.get(state[0], 0)
            continue
        uses = [done[c] for o in n.outputs for c, _ in g.consumers(o) if c in done]
        if uses:
            done[n.id] = min(uses)
    for n in g.nodes:
        if phase[n.id] != UPDATE:
            continue
        if n.id not in done:
            reads = []
            for v in n.inputs:
                if v is None:
                    continue
                p = g.values[v].producer
                if p is None:
                    if v in input_home:
                        reads.append(input_home[v])
                else:
                    reads.append(done.get(p, unit[p]))
            done[n.id] = max(reads) if reads else 0
        unit[n.id] = done[n.id]
    return unit


def check(part: Partition, stage_of_unit) -> list[str]:
    """Violations of what a pipeline schedule needs from a stage assignment (empty: none).

    Forward values may only flow to the same or a later stage, gradients (backward to backward)
    to the same or an earlier one, and the forward pass never reads the backward pass.

    >>> import hulkjax as hj
    >>> from hulkjax import zoo
    >>> m = zoo.get("mlp", size="tiny")
    >>> p = partition(hj.trace(m.step, *m.abstract()))
    >>> check(p, [0, 1, 1])
    []
    """
    g = part.graph
    stage = [stage_of_unit[u] for u in part.unit]
    bad = []
    for n in g.nodes:
        for v in n.inputs:
            p = None if v is None else g.values[v].producer
            if p is None:
                continue
            a, b = part.phase[p], part.phase[n.id]
            if a == FORWARD and b == FORWARD and stage[n.id] < stage[p]:
                bad.append(f"forward value of node {p} (stage {stage[p]}) read by node {n.id} "
                           f"on earlier stage {stage[n.id]}")
            elif a == BACKWARD and b == BACKWARD and stage[n.id] > stage[p]:
                bad.append(f"gradient of node {p} (stage {stage[p]}) read by node {n.id} on "
                           f"later stage {stage[n.id]}")
            elif a == BACKWARD and b == FORWARD:
                bad.append(f"forward node {n.id} reads backward node {p}")
    return bad


def unit_layers(part: Partition) -> dict[int, list[str]]:
    """``{unit: [module scopes of its forward nodes]}``, the scopes cut one level below the unit."""
    out: dict[int, list[str]] = defaultdict(list)
    for n in part.graph.nodes:
        if part.phase[n.id] == FORWARD:
            lab = _label(n.layer, part.depth)
            if lab and lab not in out[part.unit[n.id]]:
                out[part.unit[n.id]].append(lab)
    return out
