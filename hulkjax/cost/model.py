"""One cost model for a (graph, topology): every planner is judged by :meth:`CostModel.evaluate`.

Where this sits::

    OpGraph + Topology --> CostModel: groups, candidates, cost tables --> evaluate(assignment) -> Cost
                                              |
                       planners choose one candidate per group (baselines, ILP, auto)

**Groups (the coarsened graph).** Leaders are the operators with real choices (matmuls,
convolutions, embedding gathers/scatters) and the graph inputs (a parameter together with its
optimizer state). Every other operator follows one fixed operand, its *lead*: an operand of the
result's shape that comes from state if there is one (optimizer updates follow their parameter),
else the largest before broadcasting (a broadcast statistic is not the data path), never a
constant-derived one (a mask) or a predicate when another exists. A follower belongs to the group its lead comes from and takes its layout from it
through the per-primitive follow rules (:mod:`hulkjax.rules.sharding`). What is computed from
constants alone stays replicated in the *free* group, unless one group alone reads it: then it
joins that group and is made in the layout its first reader needs (the zeros a scatter
accumulates into, cut to the scatter's split, as XLA's partitioner makes them).

**Cost of an assignment** (one candidate per group) is a sum, which is what makes the ILP exact:

* per group and candidate: roofline compute of its operators at the slowest device's pace, the
  collectives they imply (partial sums), layout changes inside the group, and its memory;
* per edge between groups: the layout change (all-gather / all-to-all; slicing is free) from the
  producer's layout to what the consumer needs, in alpha-beta time over the mesh axes it crosses.

Memory per device: parameters, their gradients, optimizer state, and saved activations (forward
values that the backward pass reads), each at its planned layout.

Compute is a roofline per operator at the slowest device's pace, with loop fusion: elementwise and
shape operators touch HBM only for tensors entering or leaving their fusion, and a reduction reads
its fused producers inside its own kernel. The roofline runs at the fractions of peak FLOP/s and
HBM bandwidth the device reaches (``DeviceSpec.flops_efficiency`` / ``memory_efficiency``), and
every kernel it counts (a matmul, a fusion root, any other operator that moves data) adds the
device's ``kernel_overhead``; the NVIDIA numbers are measured on an H100 (``benchmarks/GPU.md``:
unsharded training steps of third-party models within 1.12x, held-out shapes 1.06x).

**Loops.** ``scan``/``while``/``cond`` nodes are leaders whose candidates shard their bodies: the
layer that plans (:mod:`hulkjax.strategies.loops`) passes a loop planner in (``loop_planner=``);
each body is a graph planned by a cost model of its own, and a candidate's local cost is ``trip_count`` x (the body's compute at its local shapes + the collectives
its plan implies, carry resharding included); its collectives appear, repeated ``trip_count``
times, in the :class:`Cost` and in :meth:`program_collectives`. Its memory is the body's transient
(the peak of the body's own liveness walk less its arguments; its collectives' buffers are in it);
what a scan stacks (``ys``) are outer values, costed as such.

**Records.** :meth:`CostModel.breakdown` returns where an assignment's time and memory go,
operator by operator (:class:`Breakdown`), so an explanation reads the numbers the model summed
instead of re-deriving them. A cost model never changes after construction: its groups and
candidates are fixed, so every planner sees the same tables (tables are memoized, not altered).

Limits: a ``while`` loop's trip count is the tracer's (1 when not static); a loop body is one of
a few boundary hypotheses completed by propagation (replicated, batch split per mesh-axis subset,
parameter slices as fsdp / megatron / dp_tp shard them), not the body's own optimum; compute and
communication do not overlap in :meth:`CostModel.evaluate` (an additive upper bound, which the
ILP needs): :meth:`CostModel.overlapped` (:mod:`hulkjax.cost.overlap`) schedules the compiled
program's collectives against its compute as XLA's latency-hiding scheduler does, on request.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from hulkjax.cost.backends import PAGE_BYTES, Backend, backend_of
from hulkjax.cost.comm import (
    axis_bytes,
    collective_time,
    reshard_comms,
    reshard_intermediates,
)
from hulkjax.cost.dots import transposed_dots
from hulkjax.cost.memory import host_copies, liveness
from hulkjax.cost.unreduced import sum_producers, unreduced_sum
from hulkjax.errors import (
    InvalidOptionError,
    InvalidPlanError,
    InvalidTopologyError,
    UncompilableLayoutChangeError,
)
from hulkjax.plan.collectives import Comm
from hulkjax.plan.cost import Cost, PredictedCollective
from hulkjax.plan.specs import Spec, divides, local_shape, num_shards, replicated
from hulkjax.rules.leaders import LoopPlanner, is_leader, leader_candidates
from hulkjax.rules.loops import LoopResolution
from hulkjax.rules.sharding import (
    Mesh,
    Resolution,
    candidate_specs,
    follow,
    replicated_resolution,
)
from hulkjax.trace.graph import DATA, OPTIMIZER, PARAMETER, OpGraph, dtype_size
from hulkjax.trace.primitives import (
    BROADCAST_PATH,
    FUSIBLE,
    PASSTHROUGH,
    REDUCTIONS,
    SCATTERS,
    TOP_K,
)

INPUT, LEADER, FREE = "input", "leader", "free"


@dataclass
class Group:
    """A planning unit: one decision covers all its members.

    Attributes:
      id: index into ``CostModel.groups``.
      kind: ``"input"`` (a parameter with its optimizer state, or a data input), ``"leader"`` (an
        operator with candidates), or ``"free"`` (constants and what is computed from them alone,
        unless one group alone reads it: see :class:`CostModel`).
      inputs: graph-input indices it owns (input groups).
      leader: the leader node id (leader groups).
      members: follower node ids, in execution order.
      candidates: ``Spec`` per candidate for input groups; ``Resolution`` per candidate for leaders.
      signature: structure key; groups with equal signatures are repeated layers.
    """

    id: int
    kind: str
    inputs: tuple[int, ...] = ()
    leader: int | None = None
    members: list[int] = field(default_factory=list)
    candidates: list = field(default_factory=list)
    signature: tuple = ()


@dataclass(frozen=True)
class Move:
    """A layout change of an operand: ``value`` brought to what ``node`` (of ``group``) needs.

    ``node == -1``: a state result going back to its input's layout (``value`` is the result).
    ``step``: the collective's place in the layout change (a change can take several collectives,
    each reading the previous one's result; 0: the first). ``repeat``: another operator's change
    of the same value to the same layout is the one the program makes (XLA makes a change once
    per layout however many read it), so the cost does not charge this one: it is listed for
    what reads the copy (memory, a pipeline stage's own operators). ``target``: the layout a
    change between groups brings the value to (``None`` for changes inside a group): the
    readers of one value with one target share one change in one program.
    """

    value: int
    node: int
    group: int
    comm: Comm
    step: int = 0
    repeat: bool = False
    target: Spec | None = None


@dataclass(frozen=True)
class ProgramComm:
    """A collective of the compiled program and where it sits: it takes the result of node
    ``source`` (-1: a graph input) and node ``user`` uses what it returns (the number of nodes:
    the step's end). An operator's own collective (a partial sum) has ``source == user``.
    ``after``: the index, in the same list, of the collective whose result it takes instead of
    ``source``'s (-1: none): an operator's own collectives run in sequence (a partial sum over two
    dimensions is two all-reduces, the second reading the first's result), so do the steps of
    one layout change, and a layout change of an operator's result reads its last own
    collective's. ``value``: the value a layout change moves (-1: an operator's own collective);
    ``readers``: on the last step of a layout change, the other nodes that read its result (XLA
    computes the same layout change of a value once, however many operators read it)."""

    comm: Comm
    source: int
    user: int
    after: int = -1
    value: int = -1
    readers: tuple[int, ...] = ()


_COMMUTES_WITH_SUMS = ("transpose", "reshape", "squeeze", "copy")
"""Layout-only operators an all-reduce commutes with: ``op(all-reduce(x)) == all-reduce(op(x))``
(:meth:`CostModel._reassociated` looks through them)."""


@dataclass(frozen=True)
class SumSite:
    """Two partial sums added, where the objective prices a backend's reassociation
    (:meth:`CostModel.sum_sites`): ``add`` reads operand ``k`` (``value``) across the edge from
    group ``src``, made by ``far`` (that group's leader) through layout-only operators, and its
    other operand from its own group ``dst``, made likewise by ``near`` (``dst``'s leader).

    ``far_ids`` and ``near_ids`` are ``(producer, nodes after it up to the add, values from the
    producer's result to the add's operand)`` in the ids of ``src``'s and ``dst``'s tables
    (:meth:`CostModel.table`); ``near_ids``'s nodes include the add. ``drops_far``: the
    all-reduce the merge leaves out is ``far``'s (the add's second operand is ``value``), as
    :meth:`CostModel._reassociated` drops the second operand's.
    """

    add: int
    k: int
    value: int
    src: int
    dst: int
    far: int
    near: int
    far_ids: tuple
    near_ids: tuple
    drops_far: bool


@dataclass(frozen=True)
class CombinedCollective:
    """A collective of the compiled program after the backend's combiners: ``members`` are the
    indices of the :class:`ProgramComm` entries merged into it (one: left alone); ``bytes`` is
    theirs summed; ``kind`` is what the backend runs (:meth:`Backend.kind_of`)."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class CombinedProgram:
    """One computation (the step, or a loop body's iteration) with its collectives as XLA's
    combiners leave them (:meth:`CostModel.combined_program`).

    Instructions are numbered: the graph's nodes ``0 .. n-1``, the combined collectives
    ``n + j`` (``collectives[j]``), the computation's result ``n + len(collectives)`` (its
    operands: the computation's outputs). A combined collective reads the union of its members'
    operands and feeds the union of their users.

    Attributes:
      nodes: the number of graph nodes ``n``.  # int
      entries: the collectives before combining, as :meth:`CostModel.program_entries` lists them
        (a loop body's: with its results' layout changes on exit).  # list of ProgramComm
      collectives: after combining.  # tuple of CombinedCollective
      operands: per instruction, its operands in order.  # list of list of int
      order: XLA's post-order of the instructions (``MakeInstructionPostOrder``).  # list of int
      exits: how many of ``entries`` (the last ones) are a loop body's results' layout changes
        on exit.  # int
      reassociated: the all-reduces the backend merged into another, of a sum of partial sums
        (:meth:`CostModel._reassociated`): charged by the cost, not in the program.  # tuple of
        Comm
    """

    nodes: int
    entries: list[ProgramComm]
    collectives: tuple[CombinedCollective, ...]
    operands: list[list[int]]
    order: list[int]
    exits: int = 0
    reassociated: tuple[Comm, ...] = ()


@dataclass(frozen=True)
class MemoryUse:
    """Per-device bytes of one kind (``parameters``, ``gradients``, ``optimizer``, ``data``,
    ``activations``) held for ``node`` (``None``: a graph input's) in ``group``."""

    node: int | None
    group: int
    kind: str
    bytes: float


@dataclass
class Local:
    """What choosing one candidate for a group means inside the group.

    Attributes:
      specs: value id -> layout, for the values the group produces (or owns).
      res: node id -> how it runs (a :class:`~hulkjax.rules.sharding.Resolution`).
      time: compute + own collectives + in-group layout changes, seconds.
      compute: seconds.
      comms: every collective the group's cost charges (own and in-group moves).
      memory / memory_parts: per-device bytes, total and by kind.
      program_comms: comms as the program has them (a loop: its body's, deduplicated).
      node_compute: seconds per member node.  # dict[int, float]
      node_comms: collectives each node implies itself (partial sums).  # dict[int, tuple]
      moves: in-group layout changes.  # list of Move
      memory_uses: the bytes of ``memory_parts``, node by node.  # list of MemoryUse
    """

    specs: dict[int, Spec]
    res: dict[int, Resolution]
    time: float
    compute: float
    comms: list[Comm]
    memory: float
    memory_parts: dict[str, float]
    program_comms: list[Comm]
    node_compute: dict[int, float] = field(default_factory=dict)
    node_comms: dict[int, tuple[Comm, ...]] = field(default_factory=dict)
    moves: list[Move] = field(default_factory=list)
    memory_uses: list[MemoryUse] = field(default_factory=list)


@dataclass
class Breakdown:
    """Where an assignment's time and memory go, operator by operator (:meth:`CostModel.breakdown`).

    The sums equal :meth:`CostModel.evaluate`: compute adds up to ``compute_time``, the collectives
    of ``own`` but those ``merged`` and of the ``moves`` that are not a ``repeat`` to the
    communication, ``memory`` to ``peak_memory``.

    Attributes:
      assignment: the candidate per group it describes.  # list of int
      specs: planned layout of every value.  # dict[int, Spec]
      compute: predicted compute seconds per node.  # list of float
      own: collectives each operator implies itself.  # dict[int, tuple of Comm]
      moves: layout changes of operands (inside groups and on edges between groups).
      memory: the buffers live at the peak of memory, node by node (they add up to
        ``peak_memory``; see :func:`hulkjax.cost.memory.liveness`).  # list of MemoryUse
      merged: of ``own``, the all-reduces the step does not make, merged into another's of a
        sum of partial sums (:meth:`CostModel.sum_sites`): the communication leaves them out.
        # dict[int, tuple of Comm]
    """

    assignment: list[int]
    specs: dict[int, Spec]
    compute: list[float]
    own: dict[int, tuple[Comm, ...]]
    moves: list[Move]
    memory: list[MemoryUse]
    merged: dict[int, tuple[Comm, ...]] = field(default_factory=dict)

    def made(self) -> dict[int, tuple[Comm, ...]]:
        """``own`` less ``merged``: the collectives each operator's program makes."""
        out = {}
        for nid, comms in self.own.items():
            mine = list(comms)
            for c in self.merged.get(nid, ()):
                mine.remove(c)
            out[nid] = tuple(mine)
        return out


_BREAKDOWNS_KEPT = 8  # assignments whose breakdown a cost model keeps (CostModel.breakdown)
_COMBINER_ORDER = ("all-gather", "all-reduce", "reduce-scatter")
"""The order XLA runs its combiners in (its "post-fusion optimization" pipeline)."""


class CostModel:
    """Cost tables of one (graph, topology).

    >>> import jax.numpy as jnp, hulkjax as hj
    >>> from hulkjax.cost import CostModel
    >>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)))
    >>> cm = CostModel(g, hj.Topology.grid((8,), ("d",)))
    >>> cm.evaluate(cm.replicated_assignment()).comm_time
    0.0

    Groups: each argument is a group (its layout is decided once), except optimizer state, which
    by default shares its parameter's group (``graph.owners``: Adam's moments laid out as their
    parameter is). With ``optimizer_apart``, optimizer state is a group of its own, so a plan may
    shard it where its parameter is whole: ZeRO's distributed optimizer, the update then computed
    on the state's shards, the gradient reduced onto them and the parameter gathered back (what
    the move and reading costs charge). A plan made so is evaluated by a cost model made so
    (:attr:`~hulkjax.plan.Plan.optimizer_apart`).
    """

    def __init__(self, graph: OpGraph, topology, *, loop_planner: LoopPlanner | None = None,
                 optimizer_apart: bool = False):
        self.graph = graph
        self.optimizer_apart = bool(optimizer_apart)
        self.topology = topology
        self.loop_planner = loop_planner
        self.mesh = Mesh(tuple(topology.axis_names), tuple(topology.shape))
        self.sizes = self.mesh.sizes
        dev = topology.slowest_device()
        self.hbm = dev.hbm_bandwidth * dev.memory_efficiency  # what a streaming kernel reaches
        self.kernel_overhead = max(s.kernel_overhead for s in topology.device_specs())
        self.fresh_page_time = max(s.fresh_page_time for s in topology.device_specs())
        # matmuls with both operands transposed run at this share of the matmul rate
        self.transposed_dot_efficiency = min(
            s.transposed_dot_efficiency for s in topology.device_specs())
        self.capacity = min(d.memory for d in topology.device_specs())
        self.backend: Backend = backend_of(topology)
        self._flops_by_dtype: dict[str, float] = {}
        self._follow_cache: dict = {}
        self._reshard_cache: dict = {}
        self._sig_cache: dict[int, tuple] = {}
        # node -> a small id equal for nodes of equal _node_sig (the follow cache's key: a
        # signature is a deep tuple, hashed anew on every lookup)
        self._sig_ids: dict[int, int] = {}
        self._sig_index: dict[tuple, int] = {}
        self._comm_cache: dict[Comm, float] = {}
        self._edge_cache: dict[tuple[int, int, int, int], float] = {}
        self._edge_classes: dict[tuple[int, int], int | None] = {}  # edge -> edge_class
        self._edge_class_ids: dict[tuple, int] = {}
        self._edge_class_time: dict[tuple[int, int, int], float] = {}
        self._deferred: dict[tuple[Comm, ...], tuple[Comm, ...]] = {}
        self._move_time: dict[tuple, float] = {}
        # (move_time's key less the layouts, runs, source layouts, target layouts) -> matrix
        self._reading_matrices: dict[tuple, np.ndarray] = {}
        self._matrix_cache: dict[tuple, np.ndarray] = {}
        self._input_index: dict[int, dict[Spec, int]] = {}
        self._axes_cache: dict[Spec, frozenset[str]] = {}
        # breakdown(memory=False) of the last few assignments (a pipeline stage's liveness walks
        # and node costs ask for the same assignment once per stage): (specs, compute, own, moves)
        self._breakdowns: dict[tuple[int, ...], tuple] = {}
        self._table_weights: dict[int, float | None] = {}  # table_time's, per group
        # What depends on the graph (and backend) alone is made once (the staged search builds
        # cost models of one graph on several device groups).
        key = ("cost graph facts", self.backend.name)
        memo = graph.memo.get(key)
        if memo is None:
            copies = host_copies(graph) if self.backend.host_offload else {}
            memo = graph.memo[key] = (
                frozenset(self._saved_activations(copies)), *self._fused_traffic(),
                frozenset(self._tail_nodes()), copies)
        self.saved_activations: frozenset[int] = memo[0]
        self.traffic: list[float] = memo[1]
        self.launches: list[bool] = memo[2]
        self.tail: frozenset[int] = memo[3]
        # Copies between device and host memory the backend makes (node -> whole value's bytes),
        # over the slowest host link of the devices.
        self.host_copies: dict[int, float] = memo[4]
        self.host_bandwidth = self._host_bandwidth(topology) if self.host_copies else math.inf
        self.transposed_dots: frozenset[int] = frozenset()
        if self.transposed_dot_efficiency < 1.0:
            tkey = ("transposed dots",)
            if tkey not in graph.memo:
                graph.memo[tkey] = transposed_dots(graph)
            self.transposed_dots = graph.memo[tkey]
        self._build_groups()
        self._locals: dict[tuple[int, int], Local] = {}
        self._seq_cache: dict[int, tuple[list[int], list[int]]] = {}
        self._rep_maps: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
        self.table_rep: list[int] = self._table_reps()
        self._edges = self._cross_edges()
        self.program_of: tuple | None = None  # node -> program (None: one program)
        self.program_runs: dict | None = None  # program -> runs per step (None: once each)
        self.split = None  # by_programs: the microbatch analysis (sums left unreduced)
        self._sum_producers: frozenset[int] = frozenset()
        self._sum_sites: dict | None = None  # sum_sites, made when first asked for
        self._finishing_memo: dict[tuple, Comm | None] = {}
        self._share_readers()

    def by_programs(self, program_of, runs=None, split=None) -> CostModel:
        """This cost model for a step run as several programs (a pipeline stage's forward,
        backward and update), ``program_of[node]`` naming each operator's, and ``runs`` (if
        given) how many times each program runs per step (``{program: count}``; a stage runs its
        forward and backward once per microbatch, its update once).

        ``split`` (the step's microbatch analysis, with ``runs``): the boundary sums a
        candidate lets the stage accumulate unreduced (:func:`~hulkjax.cost.unreduced.
        unreduced_sum`) are charged as the staged step makes them: their all-reduces over the
        batch axes once per step (the float32 accumulator's), not once per run.

        A shared layout change is made once per program that reads it (XLA's partitioner
        dedupes reshards within one program, not across programs), so its readers are grouped
        per (value, program). With ``runs``, :meth:`objective` (and what the ILP and the descent
        price: :meth:`table_time`, :meth:`edge_time`, :meth:`edge_matrix`,
        :meth:`reading_time`, :meth:`shared_time`) charges each operator's time and each
        reading's layout change times its program's runs: the step's time. :meth:`evaluate` and
        :meth:`breakdown` stay one run of each program.

        The view shares this model's groups, tables and the caches that do not depend on the
        grouping or the runs."""
        program_of = tuple(program_of)
        if len(program_of) != len(self.graph.nodes):
            raise InvalidOptionError(
                f"by_programs: program_of names {len(program_of)} programs for a step of "
                f"{len(self.graph.nodes)} operators; give one per operator (node id order)")
        bad = sorted(set(runs or {}) - set(program_of), key=str)
        if bad or any(not n > 0 for n in (runs or {}).values()):
            raise InvalidOptionError(
                f"by_programs: runs={runs!r} must map programs of program_of "
                f"({sorted(set(program_of), key=str)}) to positive counts"
                + (f"; {bad} name none" if bad else ""))
        view = copy.copy(self)
        view.program_of = program_of
        view.program_runs = None if runs is None else {p: float(n) for p, n in runs.items()}
        view.split = split if runs is not None else None
        view._sum_producers = sum_producers(self.graph, view.split)
        view._sum_sites = {}  # a program's merges are its own (sum_sites)
        view._edge_cache = {}
        view._edge_classes = {}
        view._breakdowns = {}
        view._table_weights = {}
        if runs is not None:  # entries keyed by content, priced once per run count
            view._edge_class_time = {}
            view._matrix_cache = {}
            view._table_times = {}
        view._share_readers()
        return view

    def runs(self, nid: int) -> float:
        """How many times per step node ``nid``'s program runs (:meth:`by_programs`; ``-1``,
        a carried state result brought back to its input's layout: once)."""
        if self.program_runs is None or nid < 0:
            return 1.0
        return self.program_runs.get(self.program_of[nid], 1.0)

    def table_time(self, gid: int, c: int) -> float:
        """``table(gid, c).time`` per step: each of the group's operators and in-group layout
        changes times its program's :meth:`runs`."""
        if self.program_runs is None:
            loc = self._locals.get((self.table_rep[gid], c))
            return (loc if loc is not None else self.table(gid, c)).time
        hit = self._table_times.get((gid, c))
        if hit is None:
            # (per group, whatever the candidate: the one weight of all its operators, or None)
            w = self._table_weights.get(gid, -1.0)
            if w == -1.0:
                nodes = self._sequence_of(gid)[0]
                ws = {self.runs(n) for n in nodes}
                w = self._table_weights[gid] = (ws.pop() if ws else 1.0) \
                    if len(ws) <= 1 and not self._sum_producers.intersection(nodes) else None
            if w is not None:
                hit = w * self.table(gid, c).time
            else:
                loc = self.local(gid, c)
                ct = self.comm_time
                hit = (sum(self.runs(n) * t for n, t in loc.node_compute.items())
                       + sum(self._own_time(n, xs, loc) for n, xs in loc.node_comms.items())
                       + sum(self.runs(m.node) * ct(m.comm) for m in loc.moves))
            self._table_times[(gid, c)] = hit
        return hit

    def _own_time(self, nid: int, comms, loc: Local) -> float:
        """Seconds per step of node ``nid``'s own collectives ``comms``: each times its
        program's :meth:`runs`, except those of a sum the stage leaves unreduced, made once
        per step on its float32 accumulator (:meth:`by_programs`' ``split``)."""
        runs = self.runs(nid)
        un = None
        if runs > 1 and nid in self._sum_producers:
            un = unreduced_sum(self, nid, loc.res.get(nid), self.split)
        if un is None:
            return sum(runs * self.comm_time(x) for x in comms)
        return self.comm_time(un.reduction) + sum(
            runs * self.comm_time(x) for i, x in enumerate(comms) if i not in un.deferred)

    def _sequence_of(self, gid: int) -> tuple[list[int], list[int]]:
        """:meth:`_sequence`, memoized."""
        hit = self._seq_cache.get(gid)
        if hit is None:
            hit = self._seq_cache[gid] = self._sequence(gid)
        return hit

    def reading_time(self, vid: int, src: Spec, dst: Spec, nid: int) -> float:
        """:meth:`move_time` times the reader's program's :meth:`runs`."""
        t = self.move_time(vid, src, dst, nid)
        return t if self.program_runs is None else t * self.runs(nid)

    def _share_readers(self) -> None:
        self._shared_readers, self._pair_edges, self.shared_of_group = self._shared_values()
        self._shared_reader_groups = {s: tuple(dict.fromkeys(r[0] for r in rs))
                                      for s, rs in self._shared_readers.items()}
        self._shared_memo: dict[tuple, list] = {}

    def _share_key(self, vid: int, nid: int):
        """The key of value ``vid``'s readers sharing a change with reader ``nid``: the value,
        or (value, program) under :meth:`by_programs`."""
        return vid if self.program_of is None else (vid, self.program_of[nid])

    def shared_value(self, key) -> int:
        """The value of a shared key (:attr:`shared_of_group`'s entries)."""
        return key if self.program_of is None else key[0]

    # ---- structure -----------------------------------------------------------------------
    def _build_groups(self) -> None:
        g = self.graph
        self.groups: list[Group] = []
        self.group_of_value: dict[int, int] = {}
        self.group_of_node: dict[int, int] = {}
        self.lead: dict[int, int | None] = {}
        state_origin: set[int] = set()  # values derived (through leads) from state inputs
        data_origin: set[int] = {v for v, r in zip(g.inputs, g.input_roles) if r == DATA}
        self.aliases: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        self._state_of: dict[int, int] = {}  # optimizer_apart: state group -> owner's input
        owner_of = {} if self.optimizer_apart else {j: i for j, i in g.owners.items()}
        for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
            if i in owner_of and g.values[vid].shape == g.values[g.inputs[owner_of[i]]].shape:
                continue
            owned = (i,) + tuple(j for j, o in owner_of.items() if o == i
                                 and g.values[g.inputs[j]].shape == g.values[vid].shape)
            shape = g.values[vid].shape
            grp = Group(len(self.groups), INPUT, inputs=owned,
                        candidates=candidate_specs(shape, self.mesh),
                        signature=("in", role, shape, g.values[vid].dtype, len(owned)))
            if self.optimizer_apart and i in g.owners:
                # Repeated layers' state ties with repeated layers' state (the integer program's
                # classes): the owner's input is named by its group's structure below.
                self._state_of[grp.id] = g.owners[i]
            self.groups.append(grp)
            for j in owned:
                self.group_of_value[g.inputs[j]] = grp.id
                if g.input_roles[j] != DATA:
                    state_origin.add(g.inputs[j])
        free = Group(len(self.groups), FREE, signature=("free",))
        self.groups.append(free)
        self._free = free.id
        self.free_group = free.id  # constants and what is computed from them alone
        for vid in g.constants:
            self.group_of_value[vid] = free.id
        for node in g.nodes:
            if is_leader(node):
                grp = Group(len(self.groups), LEADER, leader=node.id)
                self.groups.append(grp)
                self.group_of_node[node.id] = grp.id
                self.lead[node.id] = None
            else:
                lead = self._choose_lead(node, state_origin, data_origin)
                self.lead[node.id] = lead
                gid = free.id if lead is None else self.group_of_value[node.inputs[lead]]
                self.groups[gid].members.append(node.id)
                self.group_of_node[node.id] = gid
                if lead is not None and node.inputs[lead] in state_origin:
                    state_origin.update(node.outputs)
            if any(v in data_origin for v in node.inputs if v is not None):
                data_origin.update(node.outputs)
            for k, o in enumerate(node.outputs):
                src = node.inputs[k] if node.primitive in PASSTHROUGH and k < len(node.inputs) \
                    else None
                if src is not None and k != self.lead.get(node.id):
                    # Result k *is* operand k: it lives in that operand's group, in its layout.
                    self.group_of_value[o] = self.group_of_value[src]
                    self.aliases[self.group_of_value[src]].append((node.id, o, src))
                    if src in state_origin:
                        state_origin.add(o)
                else:
                    self.group_of_value[o] = self.group_of_node[node.id]
        self._sink_constants(free)
        by_sig: dict[tuple, list] = {}
        for grp in self.groups:
            if grp.kind == LEADER:
                sig = self._node_sig(grp.leader)  # repeated layers enumerate once
                if sig not in by_sig:
                    by_sig[sig] = leader_candidates(g.nodes[grp.leader], g, self.mesh,
                                                    loop_planner=self.loop_planner)
                grp.candidates = by_sig[sig]
                grp.signature = ("lead", self._node_sig(grp.leader),
                                 tuple(self._node_sig(n) for n in grp.members))
            elif grp.kind == INPUT:
                grp.signature = grp.signature + (tuple(self._node_sig(n) for n in grp.members),)
            else:
                grp.candidates = [None]
        # Apart, a parameter's group no longer holds its state's update, so two parameters the
        # default model tells apart by their states could look alike: each parameter's
        # signature names its states' structures, and each state's names its parameter's, so
        # the integer program's classes are never coarser than the default model's.
        states: dict[int, list[tuple]] = defaultdict(list)
        for gid, owner in self._state_of.items():  # (after every parameter's signature is made)
            states[self.group_of_value[g.inputs[owner]]].append(self.groups[gid].signature)
        for pid, sigs in states.items():
            self.groups[pid].signature = self.groups[pid].signature + ("states", tuple(sigs))
        for gid, owner in self._state_of.items():
            grp = self.groups[gid]
            grp.signature = grp.signature + (
                "state of", self.groups[self.group_of_value[g.inputs[owner]]].signature)

    def _sink_constants(self, free: Group) -> None:
        """Move what is computed from constants alone and read by one group only (the zeros a
        scatter accumulates into, a mask one attention reads) into that group, made in the layout
        its first reader needs: a partitioner propagates the reader's sharding onto it, so each
        device makes its own piece (XLA's SPMD partitioner cuts a broadcast of a constant to the
        consumer's sharding). Left in the free group, it would be costed replicated: every device
        writing the whole buffer (the (batch, sequence, vocabulary) zeros of a cross-entropy's
        gradient cost a quarter of an 8B LLaMA's predicted step that way).

        ``self.made_at[reader] = [(operand, maker), ...]`` and ``self.made_by[maker] = reader``;
        the maker's resolution is built when its reader's is (:meth:`_build_local`)."""
        g = self.graph
        self.made_at: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.made_by: dict[int, int] = {}
        outputs = {v for v in g.outputs if v is not None}
        kept = []
        for nid in free.members:
            node = g.nodes[nid]
            target = None
            if len(node.outputs) == 1 and not node.subgraphs and node.outputs[0] not in outputs \
                    and g.values[node.outputs[0]].shape:
                readers = g.consumers(node.outputs[0])
                gids = {self.group_of_node[c] for c, _ in readers}
                if len(gids) == 1 and free.id not in gids and not any(
                        g.nodes[c].primitive in PASSTHROUGH for c, _ in readers):
                    target = gids.pop()
            if target is None:
                kept.append(nid)
                continue
            reader, k = min(readers)  # the first reader: the layout it is made in
            bisect.insort(self.groups[target].members, nid)  # members stay in execution order
            self.group_of_node[nid] = target
            self.group_of_value[node.outputs[0]] = target
            self.made_at[reader].append((k, nid))
            self.made_by[nid] = reader
        free.members[:] = kept

    def _choose_lead(self, node, state_origin, data_origin) -> int | None:
        """The operand a follower takes its layout from.

        An optimizer update follows its parameter (state of the result's shape, not broadcast).
        Otherwise the operand on the data path: one derived from the batch rather than from
        parameters or constants alone (a mask or a position bias broadcast into the scores must
        not decide their layout: the batch split would be gathered away), then the largest before
        broadcasting (a broadcast statistic is not the data path), never a constant-derived operand
        or a predicate when another exists.
        """
        g = self.graph
        ops = [(k, v) for k, v in enumerate(node.inputs) if v is not None]
        if not ops or not node.outputs:
            return None
        out_shape = g.values[node.outputs[0]].shape
        free = self._free  # constants, iota, masks: what no layout decision reaches
        data = [(k, v) for k, v in ops if self.group_of_value.get(v) != free]
        ops = data or ops
        values = [(k, v) for k, v in ops if g.values[v].dtype != "bool"]  # predicates don't lead
        ops = values or ops
        same = [(k, v) for k, v in ops if g.values[v].shape == out_shape]
        pool = same or ops
        state = [(k, v) for k, v in pool if v in state_origin
                 and self._source_size(v) == g.values[v].size]  # not a broadcast parameter
        if state and same:
            return state[0][0]
        batch = [(k, v) for k, v in pool if v in data_origin]
        pool = batch or pool
        return max(pool, key=lambda kv: (self._source_size(kv[1]), g.values[kv[1]].size, -kv[0]))[0]

    def _source_size(self, vid: int) -> int:
        """Size of a value before broadcasting: a broadcast statistic is no data path to follow."""
        g = self.graph
        v = vid
        while True:
            p = g.values[v].producer
            if p is None or g.nodes[p].primitive not in BROADCAST_PATH:
                return g.values[v].size
            nxt = g.nodes[p].inputs[0]
            if nxt is None:
                return 1
            v = nxt

    def _node_sig(self, nid: int) -> tuple:
        sig = self._sig_cache.get(nid)
        if sig is None:
            n = self.graph.nodes[nid]
            params = tuple(sorted((k, repr(v)) for k, v in n.params.items()
                                  if "jaxpr" not in k and k not in ("branches",)))
            sig = (n.name, tuple(None if v is None else (self.graph.values[v].shape,
                                                         self.graph.values[v].dtype)
                                 for v in n.inputs),
                   tuple(self.graph.values[o].shape for o in n.outputs), params, self.lead.get(nid))
            if n.subgraphs:  # loops: equal only with equal bodies
                sig += (n.trip_count, tuple(b.fingerprint() for b in n.subgraphs))
            self._sig_cache[nid] = sig
        return sig

    def _saved_activations(self, host_copies) -> set[int]:
        """Forward values a backward operator reads, less those in host memory where the
        backend offloads (``host_copies`` made them: the device holds them only while it copies
        them out, and from when it copies them back)."""
        g = self.graph
        saved = set()
        for n in g.nodes:
            if not n.backward:
                continue
            for v in n.inputs:
                if v is None:
                    continue
                p = g.values[v].producer
                if p is not None and not g.nodes[p].backward:
                    saved.add(v)
        if host_copies:
            saved = {v for v in saved if not g.values[v].host}
        return saved

    def _host_bandwidth(self, topology) -> float:
        """The slowest device's host link (``DeviceSpec.host_bandwidth``), for a step that
        copies values to host memory."""
        unknown = [s.kind for s in topology.device_specs() if s.host_bandwidth is None]
        if unknown:
            g = self.graph
            first = g.nodes[min(self.host_copies)]
            raise InvalidTopologyError(
                f"this step moves {len(self.host_copies)} value(s) between device and host "
                f"memory (the first: {first.name} at {first.source or 'an unknown place'}, as "
                f"jax.checkpoint's offloading policies emit), and the host link of device kind(s) "
                f"{unknown} is not known. Give it: DeviceSpec(..., host_bandwidth=...) in bytes "
                f"per second per direction, e.g. 32e9 for PCIe Gen4 x16 (JSON: "
                f"devices.kinds.<kind>.host_bandwidth).", where="DeviceSpec.host_bandwidth")
        return min(s.host_bandwidth for s in topology.device_specs())

    def _tail_nodes(self) -> set[int]:
        """Nodes from which only light operators (no matmul, convolution, gather or loop; a
        scatter is light: it adds a gradient into a table) lead to the step's results: the
        optimizer update, a parameter's gradient once made (an embedding's or a position bias's
        through its scatter-add too), the loss's last reduction. Collectives there are deferred:
        no other collective waits for them, so compilers combine them (a gradient of the
        activations, in contrast, feeds the next layer's backward matmuls)."""
        g = self.graph
        outputs = {v for v in g.outputs if v is not None}
        tail: set[int] = set()
        for n in reversed(g.nodes):
            used = [c for o in n.outputs for c, _ in g.consumers(o)]
            if not used and not any(o in outputs for o in n.outputs):
                continue
            if all(c in tail and (g.nodes[c].primitive in SCATTERS or not is_leader(g.nodes[c]))
                   for c in used):
                tail.add(n.id)
        return tail

    def _on_wire(self, comms, node) -> tuple[Comm, ...]:
        """An operator's own collectives (on its results) with the bytes the backend moves:
        widened where it has no collectives of the results' dtype (bf16 on CPU)."""
        if not comms or not node.outputs:
            return tuple(comms)
        f = self.backend.wire_factor(self.graph.values[node.outputs[0]].dtype)
        if f == 1.0:
            return tuple(comms)
        return tuple(replace(c, bytes=int(c.bytes * f)) for c in comms)

    def _deferred_at(self, nid: int) -> bool:
        """Whether layout changes read by node ``nid`` are deferred: it is a tail node, or
        ``-1`` (a state result going back to its input's layout, at the step's end), except in
        a loop body, where a carry goes back for the next iteration and is never deferred."""
        return nid in self.tail if nid != -1 else not self.graph.loop_body

    def _defer(self, comms, nid: int) -> tuple[Comm, ...]:
        """``comms`` marked deferred where :meth:`_deferred_at` says so."""
        if not self._deferred_at(nid):
            return tuple(comms)
        return tuple(c if c.deferred else replace(c, deferred=True) for c in comms)

    def _defer_shared(self, comms, nid: int) -> tuple[Comm, ...]:
        """:meth:`_defer`, memoized: equal comms give the same objects. Only for layout changes
        on edges: an operator's own collectives must stay distinct objects (the liveness walk
        tells their reductions apart by identity)."""
        if not self._deferred_at(nid):
            return tuple(comms)
        if not comms:
            return ()
        key = tuple(comms)
        hit = self._deferred.get(key)
        if hit is None:
            hit = self._deferred[key] = tuple(c if c.deferred else replace(c, deferred=True)
                                              for c in comms)
        return hit

    def _fused_traffic(self) -> tuple[list[float], list[bool]]:
        """HBM bytes per node with loop and input fusion, and which nodes launch a kernel.

        An elementwise or shape operator reads only the operands that come from outside its
        fusion and writes only results that leave it; a reduction reads its fusible producers'
        results inside its own kernel (XLA's input fusion: ``x * y`` then ``sum`` is one kernel
        that reads ``x`` and ``y``). A node launches a kernel when it is a matmul, any other
        operator outside a fusion that moves data, or a fusion's root (it writes a result)."""
        g = self.graph
        fusible = [n.primitive in FUSIBLE for n in g.nodes]
        absorbs = [fusible[n.id] or n.primitive in REDUCTIONS for n in g.nodes]
        outputs = {o for o in g.outputs if o is not None}
        traffic, launches = [], []
        for n in g.nodes:
            if n.primitive in PASSTHROUGH:  # results are the operands: nothing is read or written
                traffic.append(0.0)
                launches.append(False)
                continue
            if not absorbs[n.id] or n.subgraphs:
                traffic.append(n.bytes)
                launches.append(not n.subgraphs and (n.bytes > 0 or bool(n.flops)))
                continue
            t = 0.0
            for v in n.inputs:
                if v is None:
                    continue
                p = g.values[v].producer
                if p is None or not fusible[p]:
                    t += g.values[v].nbytes
            writes = False
            for o in n.outputs:
                if not fusible[n.id] or o in outputs or any(
                        not absorbs[c] for c, _ in g.consumers(o)):
                    t += g.values[o].nbytes
                    writes = True
            traffic.append(t)
            launches.append(writes)
        return traffic, launches

    # ---- per-group tables ----------------------------------------------------------------
    def local(self, gid: int, c: int) -> Local:
        """Specs, resolutions, time and memory of group ``gid`` under candidate ``c``.

        Groups of one *table class* (:meth:`table_class`: repeated layers, alike in everything
        the table reads) share one computation: the first group's table, with its value and
        node ids renamed (:meth:`_renamed`)."""
        key = (gid, c)
        hit = self._locals.get(key)
        if hit is not None:
            return hit
        rep = self.table_rep[gid]
        if rep != gid:
            loc = self._renamed(self.local(rep, c), rep, gid)
        else:
            loc = self._build_local(gid, c)
        self._locals[key] = loc
        return loc

    def table(self, gid: int, c: int) -> Local:
        """The table :meth:`local` renames for group ``gid``: its times and memory are the
        group's (its value and node ids are those of the group's table class's first group;
        :meth:`spec`, :meth:`required` read it without renaming)."""
        return self.local(self.table_rep[gid], c)

    def spec(self, gid: int, c: int, vid: int) -> Spec | None:
        """``local(gid, c).specs.get(vid)``: the layout of value ``vid`` of group ``gid``."""
        rep = self.table_rep[gid]
        if rep != gid:
            ids = self._rep_maps.get(gid)
            vid = (ids if ids is not None else self._rep_ids(gid))[1].get(vid, -1)
        loc = self._locals.get((rep, c))
        return (loc if loc is not None else self.local(rep, c)).specs.get(vid)

    def resolution(self, gid: int, c: int, nid: int) -> Resolution | None:
        """``local(gid, c).res.get(nid)``: how node ``nid`` of group ``gid`` runs."""
        rep = self.table_rep[gid]
        if rep != gid:
            nid = self._rep_ids(gid)[0].get(nid, -1)
        return self.local(rep, c).res.get(nid)

    def table_ids(self, gid: int) -> tuple[dict[int, int], dict[int, int]] | None:
        """``({node: ...}, {value: ...})``: group ``gid``'s node and value ids as its table
        class's first group (:attr:`table_rep`) has them, which :meth:`spec` and
        :meth:`required` look up; ``None`` for that first group itself."""
        return None if self.table_rep[gid] == gid else self._rep_ids(gid)

    def _rep_ids(self, gid: int) -> tuple[dict[int, int], dict[int, int]]:
        """``({node: its table class representative's}, {value: ...})`` of a shared group."""
        hit = self._rep_maps.get(gid)
        if hit is None:
            (rn, rv), (gn, gv) = self._sequence_of(self.table_rep[gid]), self._sequence_of(gid)
            hit = self._rep_maps[gid] = (dict(zip(gn, rn)), dict(zip(gv, rv)))
        return hit

    # ---- shared tables of repeated layers -----------------------------------------------------
    def _sequence(self, gid: int) -> tuple[list[int], list[int]]:
        """The nodes and values of a group's table, in the order :meth:`_build_local` meets them
        (``(nodes, values)``: leader, members and pass-through nodes; owned inputs, results)."""
        g, grp = self.graph, self.groups[gid]
        nodes, values = [], []
        if grp.kind == INPUT:
            values.extend(g.inputs[i] for i in grp.inputs)
        elif grp.kind == LEADER:
            nodes.append(grp.leader)
            values.extend(g.nodes[grp.leader].outputs)
        for nid, is_member, alias in self._events(gid):
            nodes.append(nid)
            values.extend(g.nodes[nid].outputs if is_member else (alias[0],))
        return nodes, values

    def _events(self, gid: int) -> list:
        grp = self.groups[gid]
        return sorted([(nid, 1, None) for nid in grp.members]
                      + [(nid, 0, (o, src)) for nid, o, src in self.aliases.get(gid, ())])

    def table_class(self, gid: int):
        """A key equal for groups whose tables are equal up to renaming value and node ids (the
        group's structural signature, and what its table reads beyond it: fused memory traffic,
        deferral, FLOPs and bytes of each node, which operands come from inside the group, the
        saved activations, the roles of owned inputs); ``None`` for a group that shares nothing
        (the free group)."""
        g, grp = self.graph, self.groups[gid]
        if grp.kind not in (INPUT, LEADER):
            return None
        nodes, values = self._sequence(gid)
        pos = {v: k for k, v in enumerate(values)}
        events = tuple((is_member, None if alias is None else
                        (g.values[alias[0]].shape, g.values[alias[0]].dtype, pos.get(alias[1], -1)))
                       for _, is_member, alias in self._events(gid))
        per_node = tuple((self._node_sig(n), self.traffic[n], self.launches[n], n in self.tail,
                          g.nodes[n].flops,
                          g.nodes[n].bytes, tuple(None if v is None else pos.get(v, -1)
                                                  for v in g.nodes[n].inputs))
                         for n in nodes)
        npos = {n: k for k, n in enumerate(nodes)}
        per_value = tuple((g.values[v].shape, g.values[v].dtype, v in self.saved_activations,
                           npos.get(g.values[v].producer, -1), g.values[v].host) for v in values)
        return (grp.kind, grp.signature, tuple(g.input_roles[i] for i in grp.inputs), events,
                per_node, per_value)

    def _table_reps(self) -> list[int]:
        """Per group, the first group of its :meth:`table_class` (itself when unshared)."""
        first: dict = {}
        reps = []
        for grp in self.groups:
            key = self.table_class(grp.id)
            reps.append(grp.id if key is None else first.setdefault(key, grp.id))
        return reps

    def _renamed(self, loc: Local, rep: int, gid: int) -> Local:
        """Group ``rep``'s table ``loc`` as group ``gid``'s (same table class): its value and node
        ids renamed. An operator's deferred collectives are new objects per group, as when
        built (the liveness walk tells reductions apart by identity)."""
        (rn, rv), (gn, gv) = self._sequence_of(rep), self._sequence_of(gid)
        nmap = dict(zip(rn, gn))
        vmap = dict(zip(rv, gv))
        fresh: dict[int, Comm] = {}

        def cp(c: Comm) -> Comm:
            if not c.deferred:
                return c
            n = fresh.get(id(c))
            if n is None:
                n = fresh[id(c)] = replace(c)
            return n

        comms = [cp(c) for c in loc.comms]
        program = comms if loc.program_comms is loc.comms else [cp(c) for c in loc.program_comms]
        return Local(
            {vmap[v]: s for v, s in loc.specs.items()},
            {nmap[n]: r for n, r in loc.res.items()},
            loc.time, loc.compute, comms, loc.memory, dict(loc.memory_parts), program,
            {nmap[n]: t for n, t in loc.node_compute.items()},
            {nmap[n]: tuple(cp(c) for c in cs) for n, cs in loc.node_comms.items()},
            [Move(vmap[m.value], nmap[m.node], gid, cp(m.comm), m.step) for m in loc.moves],
            [MemoryUse(None if u.node is None else nmap[u.node], gid, u.kind, u.bytes)
             for u in loc.memory_uses])

    def _build_local(self, gid: int, c: int) -> Local:
        g, grp = self.graph, self.groups[gid]
        specs: dict[int, Spec] = {}
        res: dict[int, Resolution] = {}
        time = compute = 0.0
        comms: list[Comm] = []
        program: list[Comm] | None = None
        mem: dict[str, float] = defaultdict(float)
        node_compute: dict[int, float] = {}
        node_comms: dict[int, tuple[Comm, ...]] = {}
        moves: list[Move] = []
        uses: list[MemoryUse] = []

        def use(node, kind, nb):
            mem[kind] += nb
            uses.append(MemoryUse(node, gid, kind, nb))

        if grp.kind == INPUT:
            spec = grp.candidates[c]
            for i in grp.inputs:
                vid = g.inputs[i]
                specs[vid] = spec
                # (an argument kept in host memory holds none of an offloading device's)
                nb = 0.0 if self.host_copies and g.values[vid].host else self._nbytes(vid, spec)
                role = g.input_roles[i]
                if role == PARAMETER:
                    use(None, "parameters", nb)
                    use(None, "gradients", nb)
                elif role == OPTIMIZER:
                    use(None, "optimizer", nb)
                else:
                    use(None, "data", nb)
        elif grp.kind == LEADER:
            r = grp.candidates[c]
            node = g.nodes[grp.leader]
            res[node.id] = r
            for o, s in zip(node.outputs, r.out_specs):
                specs[o] = s
            if isinstance(r, LoopResolution):
                t = r.compute
                use(node.id, "activations", r.memory)
                program = list(r.program_comms)
            else:
                t = self.compute_time(node, r.shards)
            compute += t
            node_compute[node.id] = t
            compute += self._make_in_place(node.id, r, specs, res, node_compute)
            own = self._defer(self._on_wire(r.comms, node), node.id)
            node_comms[node.id] = own
            comms.extend(own)
            for nb in self._waiting_partial_sums(own):
                use(node.id, "gradients", nb)
        else:
            for vid in g.constants:
                specs[vid] = replicated(len(g.values[vid].shape))
        made_at = self.made_at
        for nid, is_member, alias in self._events(gid):
            if not is_member:  # a pass-through result: the operand's layout
                o, src = alias
                src_spec = specs.get(src)
                specs[o] = src_spec if src_spec is not None else \
                    replicated(len(g.values[o].shape))
                continue
            if nid in self.made_by:  # made with its reader, in the layout the reader needs
                continue
            node = g.nodes[nid]
            lead = self.lead[nid]
            if lead is None:
                r = replicated_resolution(node, g)
            else:
                r = self._follow(node, lead, specs.get(node.inputs[lead]))
            res[nid] = r
            for o, s in zip(node.outputs, r.out_specs):
                if s is not None:
                    specs[o] = s
            t = self.compute_time(node, r.shards)
            compute += t
            node_compute[nid] = t
            if nid in made_at:  # (otherwise it adds 0.0)
                compute += self._make_in_place(nid, r, specs, res, node_compute)
            if r.comms:
                own = self._defer(self._on_wire(r.comms, node), nid)
                node_comms[nid] = own
                comms.extend(own)
                for nb in self._waiting_partial_sums(own):
                    use(nid, "gradients", nb)
                if program is not None:
                    program.extend(own)
            else:
                node_comms[nid] = ()
            for k, v in enumerate(node.inputs):  # layout changes inside the group
                if v is None:
                    continue
                have, need = specs.get(v), r.in_specs[k]
                if have is not None and need is not None and have != need:
                    moved = self._defer(self.reshard(v, have, need), nid)
                    comms.extend(moved)
                    moves.extend(Move(v, nid, gid, m, k) for k, m in enumerate(moved))
                    if program is not None:
                        program.extend(moved)
        for v, s in specs.items():
            if v in self.saved_activations:
                use(g.values[v].producer, "activations", self._nbytes(v, s))
        time = compute + sum(self.comm_time(cm) for cm in comms)
        return Local(specs, res, time, compute, comms, float(sum(mem.values())), dict(mem),
                     comms if program is None else program, node_compute, node_comms, moves, uses)

    def _make_in_place(self, reader: int, r: Resolution, specs, res, node_compute) -> float:
        """Resolve the constant-made operands of ``reader`` (:meth:`_sink_constants`) in the
        layout its resolution ``r`` needs them in; returns their compute time."""
        t = 0.0
        for k, maker in self.made_at.get(reader, ()):
            node = self.graph.nodes[maker]
            need = r.in_specs[k]
            if need is None:  # the reader states no layout for it: made replicated
                need = replicated(len(self.graph.values[node.outputs[0]].shape))
            shards = num_shards(need, self.sizes)
            rm = Resolution(
                in_specs=tuple(None if v is None else replicated(len(self.graph.values[v].shape))
                               for v in node.inputs),
                out_specs=(need,), shards=shards, label="made in place")
            res[maker] = rm
            specs[node.outputs[0]] = need
            tm = self.compute_time(node, shards)
            node_compute[maker] = tm
            t += tm
        return t

    def _waiting_partial_sums(self, comms) -> list[float]:
        """Bytes of the partial sums among ``comms`` that the additive memory model must hold
        next to the reduced gradient: deferred reductions a backend combines all into one and
        does not run in place (XLA:CPU) keep every partial sum until the combined collective, so
        its peak holds both (:func:`~hulkjax.cost.memory.liveness`). Where groups are bounded
        (GPUs: 30 MiB) or all-reduces run in place, at most one group waits: not charged."""
        be = self.backend
        out = []
        for c in comms:
            if not c.deferred or c.kind not in ("all-reduce", "reduce-scatter"):
                continue
            if math.isinf(be.combine_threshold.get(be.kind_of(c.kind), 0.0)) \
                    and not be.in_place(c.kind):
                out.append(float(c.bytes))
        return out

    def _follow(self, node, lead, lead_spec) -> Resolution:
        if lead_spec is None:
            return replicated_resolution(node, self.graph)
        sid = self._sig_ids.get(node.id)
        if sid is None:
            sid = self._sig_ids[node.id] = self._sig_index.setdefault(
                self._node_sig(node.id), len(self._sig_index))
        key = (sid, lead, lead_spec)
        r = self._follow_cache.get(key)
        if r is None:
            r = follow(node, self.graph, lead, lead_spec, self.mesh)
            self._follow_cache[key] = r
        return r

    def compute_time(self, node, shards: int) -> float:
        """Roofline seconds of ``node`` split ``shards`` ways, at the slowest device's pace
        (FLOPs against the FLOP/s its operands' dtype reaches, fused memory traffic against the
        HBM bandwidth a streaming kernel reaches), plus the device's kernel overhead when the
        node launches a kernel (it does not shrink with sharding). A matmul whose operands are
        both stored transposed (:func:`~hulkjax.cost.dots.transposed_dots`) runs at
        ``DeviceSpec.transposed_dot_efficiency`` of the matmul rate."""
        shards = max(shards, 1)
        copied = self.host_copies.get(node.id)
        if copied is not None:  # a DMA over the host link: no kernel, no HBM roofline
            return copied / shards / self.host_bandwidth
        flops = 0.0
        if node.flops:
            flops = node.flops / shards / self._peak(self._compute_dtype(node))
            if node.id in self.transposed_dots:
                flops /= self.transposed_dot_efficiency
        t = max(flops, self.traffic[node.id] / shards / self.hbm)
        return t + self.kernel_overhead if self.launches[node.id] else t

    def page_time(self, nbytes: float) -> float:
        """Seconds a program call spends on the pages of a ``nbytes`` buffer it allocates anew
        (its temporaries): ``DeviceSpec.fresh_page_time`` per 4 KiB page of what the backend
        maps afresh every call (:meth:`~hulkjax.cost.backends.Backend.fresh_bytes`: XLA:CPU's
        buffers above glibc's mmap threshold), at the slowest device's cost."""
        if not self.fresh_page_time:
            return 0.0
        return self.backend.fresh_bytes(nbytes) / PAGE_BYTES * self.fresh_page_time

    def _compute_dtype(self, node) -> str:
        """The dtype an operator computes in: a matmul's narrowest operand (bf16 inputs run on
        bf16 tensor cores whatever they accumulate in), else its first result's."""
        g = self.graph
        if node.name in ("dot_general", "conv_general_dilated"):
            dts = [g.values[v].dtype for v in node.inputs if v is not None]
            return min(dts, key=lambda d: dtype_size(d) or 8) if dts else "float32"
        return g.values[node.outputs[0]].dtype if node.outputs else "float32"

    def _peak(self, dtype: str) -> float:
        peak = self._flops_by_dtype.get(dtype)
        if peak is None:
            peak = self._flops_by_dtype[dtype] = min(
                s.flops_for(dtype) * s.flops_efficiency for s in self.topology.device_specs())
        return peak

    def _nbytes(self, vid: int, spec: Spec) -> float:
        v = self.graph.values[vid]
        # math.prod of ints is exact, as np.prod in float64 is below 2**53 elements
        return float(math.prod(local_shape(v.shape, spec, self.sizes))) * dtype_size(v.dtype)

    def reshard(self, vid: int, src: Spec, dst: Spec, *, direct: bool = False
                ) -> tuple[Comm, ...]:
        """The collectives that bring value ``vid`` from layout ``src`` to ``dst``: XLA's
        partitioner's own change (:func:`~hulkjax.cost.comm.reshard_comms`), or where it is
        dearer, the change through the intermediate layouts :meth:`reshard_via` names (the
        emitter constrains an operand to each in turn, :meth:`pinned_paths`). ``direct``: XLA's
        own change only, for changes the emitter makes by one constraint (a loop body's results
        on exit, the step's results)."""
        if src == dst:
            return ()
        return self._reshard_path(vid, src, dst, direct)[1]

    def reshard_via(self, vid: int, src: Spec, dst: Spec) -> tuple[Spec, ...]:
        """The layouts :meth:`reshard` passes through from ``src`` to ``dst`` (``()``: XLA's
        direct change). The partitioner makes some changes by gathering the whole value and
        slicing it ("involuntary full rematerialization": one axis leaving a dimension while
        another moves from it) or by dearer exchanges than two steps take; each step through a
        layout of :func:`~hulkjax.cost.comm.reshard_intermediates` is one the partitioner makes
        directly, so the program makes the collectives priced here
        (``tests/cost/test_reshard.py``)."""
        if src == dst:
            return ()
        return self._reshard_path(vid, src, dst, False)[0]

    def _reshard_path(self, vid: int, src: Spec, dst: Spec, direct: bool):
        """``(via, comms, steps)``: the layouts passed through, every collective of the change,
        and how many of them each step (``len(via) + 1`` of them) takes."""
        v = self.graph.values[vid]
        key = (v.shape, v.dtype, src, dst, direct)
        hit = self._reshard_cache.get(key)
        if hit is not None:
            return hit
        dtype = self.backend.wire_dtype(v.dtype)
        try:
            comms = reshard_comms(v.shape, dtype, src, dst, self.sizes)
            hit, best = ((), comms, (len(comms),)), sum(self.comm_time(cm) for cm in comms)
        except UncompilableLayoutChangeError:
            # XLA's partitioner fails on the change (jaxlib dies compiling it): a planner must
            # make it in two steps (through the replicated layout at worst, a gather then a
            # slice) or, where it is one constraint, never choose it: an infinite price.
            axes = tuple(sorted({a for spec in (src, dst) for ax in spec for a in ax}))
            never = (Comm("all-to-all", axes, math.inf),)
            hit, best, comms = ((), never, (1,)), math.inf, None
        if not direct and (comms is None or comms):
            mids = reshard_intermediates(src, dst)
            if comms is None:
                mids = (*mids, tuple(() for _ in src))
            for mid in dict.fromkeys(mids):
                if not divides(v.shape, mid, self.sizes):
                    continue  # uneven: XLA pads, which the partitioner's model leaves out
                try:
                    first = reshard_comms(v.shape, dtype, src, mid, self.sizes)
                    steps = first + reshard_comms(v.shape, dtype, mid, dst, self.sizes)
                except UncompilableLayoutChangeError:
                    continue
                t = sum(self.comm_time(cm) for cm in steps)
                if t < best * (1 - 1e-9):
                    best, hit = t, ((mid,), steps, (len(first), len(steps) - len(first)))
        self._reshard_cache[key] = hit
        return hit

    def comm_time(self, cm: Comm) -> float:
        """Seconds of one collective on this topology (summed over the axes it crosses), as the
        backend runs it (:mod:`hulkjax.cost.backends`): its algorithm, its reduce-scatter, and for a
        deferred collective its share of the latency of the combined one."""
        t = self._comm_cache.get(cm)
        if t is None:
            t = self._comm_cache[cm] = sum(self.comm_time_by_axis(cm).values())
        return t

    def comm_time_by_axis(self, cm: Comm) -> dict[str, float]:
        """:meth:`comm_time` per mesh axis."""
        kind = self.backend.kind_of(cm.kind)
        share = self.backend.latency_share(kind, cm.bytes) if cm.deferred else 1.0
        return collective_time(kind, cm.bytes, cm.axes, self.topology,
                               hierarchical=self.backend.hierarchical, latency_scale=share)

    # ---- edges between groups ----------------------------------------------------------------
    def _cross_edges(self) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
        """``{(producer group, consumer group): [(value, node, operand), ...]}``; carried state
        results are edges back to their input's group (node ``-1``: layout of the next step)."""
        g = self.graph
        edges: dict[tuple[int, int], list] = defaultdict(list)
        for n in g.nodes:
            gc = self.group_of_node[n.id]
            for k, v in enumerate(n.inputs):
                if v is None:
                    continue
                gp = self.group_of_value[v]
                if gp != gc:
                    edges[(gp, gc)].append((v, n.id, k))
        for i, o in g.carried.items():
            vid = g.outputs[o]
            gp, gc = self.group_of_value[vid], self.group_of_value[g.inputs[i]]
            edges[(gp, gc)].append((vid, -1, i))
        return dict(edges)

    def _shared_values(self):
        """The values operators of other groups read more than once (two operators, or two
        operands of one), whose layout changes the program makes once per layout however many
        read it: ``({key: ((group, node, operand), ...)}, the edges' other items, {group:
        [key, ...]})``, the last naming for each group the shared keys of values it produces or
        reads. A key is the value (:meth:`_share_key`; with its readers' program under
        :meth:`by_programs`). A carried state result going back to its input's layout (node
        ``-1``) is a constraint of its own, made directly: it stays on its edge. So does a value
        no layout can split (a scalar, every dimension of size 1): it is never changed, whoever
        reads it (the scalars an optimizer's update reads hundreds of times, left out, make the
        local searches several times faster)."""
        readers: dict = defaultdict(list)
        vals = self.graph.values
        for (_, gc), items in self._edges.items():
            for v, nid, k in items:
                if nid >= 0 and any(d > 1 for d in vals[v].shape):
                    readers[self._share_key(v, nid)].append((gc, nid, k))
        shared = {s: tuple(sorted(rs, key=lambda r: (r[1], r[2])))
                  for s, rs in readers.items() if len(rs) > 1}
        pair = {}
        for e, items in self._edges.items():
            rest = [it for it in items if it[1] < 0 or self._share_key(it[0], it[1]) not in shared]
            if rest:
                pair[e] = rest
        of_group: dict[int, list] = defaultdict(list)
        for s, rs in shared.items():
            for gid in dict.fromkeys((self.group_of_value[self.shared_value(s)],
                                      *(r[0] for r in rs))):
                of_group[gid].append(s)
        return shared, pair, dict(of_group)

    def edge_items(self):
        """``((producer group, consumer group), [(value, node, operand), ...])`` of every edge
        between groups: each tensor one group makes and another reads, once per reading
        operand."""
        return self._edges.items()

    def shared_items(self):
        """``(value, ((consumer group, node, operand), ...))`` of every value that operators of
        other groups than its producer's read more than once: :meth:`shared_time` charges its
        layout changes once per layout, not per reader (the objective's one term that is not a
        sum over groups and pairs of groups). Under :meth:`by_programs` a value comes once per
        program that reads it more than once, with that program's readers."""
        return [(self.shared_value(s), rs) for s, rs in self._shared_readers.items()]

    def shared_time(self, key, assignment, gid: int | None = None, c: int | None = None
                    ) -> float:
        """Seconds of the layout changes of shared value ``key`` (an entry of
        :attr:`shared_of_group`: the value, or (value, program) under :meth:`by_programs`) under
        ``assignment`` (with group ``gid`` on candidate ``c``, if given): one change per layout
        its readers need, as XLA's partitioner makes one per (instruction, sharding) however many
        operators read it; a change some readers need deferred (into the step's tail) and others
        not is charged at the dearest (not deferred)."""
        return sum(t for t, _ in self._shared_changes(key, assignment, gid, c).values())

    def shared_groups(self, key) -> tuple[int, ...]:
        """The groups whose candidates :meth:`shared_time` of ``key`` reads: the producer of
        its value, then its readers' groups."""
        return (self.group_of_value[self.shared_value(key)], *self._shared_reader_groups[key])

    def shared_times(self, key, assignment, gid: int, cands) -> list[float]:
        """``[shared_time(key, assignment, gid, c) for c in cands]``, the same floats, without
        walking the other readers' changes once per candidate: with ``gid`` one of the
        readers (not the producer), the others' changes are fixed, merged once before and
        after ``gid``'s (in the readers' order, as :meth:`_shared_changes` merges them)."""
        gp = self.group_of_value[self.shared_value(key)]
        readers = self._shared_reader_groups[key]
        if gp == gid or gid not in readers:
            return [self.shared_time(key, assignment, gid, c) for c in cands]
        cp = assignment[gp]
        j = readers.index(gid)
        before: dict[Spec, tuple[float, int]] = {}
        for gc in readers[:j]:
            _merge_changes(before, self._shared_moves(key, cp, gc, assignment[gc]))
        after = [m for gc in readers[j + 1:]
                 for m in self._shared_moves(key, cp, gc, assignment[gc])]
        out, unchanged = [], None
        memo = self._shared_memo
        for c in cands:
            mine = memo.get((key, cp, gid, c))  # (_shared_moves, its memo read here)
            if mine is None:
                mine = self._shared_moves(key, cp, gid, c)
            if not mine and unchanged is not None:
                out.append(unchanged)
                continue
            changes = dict(before)
            _merge_changes(changes, mine)
            _merge_changes(changes, after)
            t = sum(t for t, _ in changes.values())
            if not mine:
                unchanged = t
            out.append(t)
        return out

    def _shared_changes(self, key, assignment, gid: int | None = None,
                        c: int | None = None) -> dict[Spec, tuple[float, int]]:
        """``{layout: (seconds, index of the reader charged)}`` of :meth:`shared_time`."""
        gp = self.group_of_value[self.shared_value(key)]
        cp = c if gp == gid else assignment[gp]
        out: dict[Spec, tuple[float, int]] = {}
        for gc in self._shared_reader_groups[key]:
            _merge_changes(out, self._shared_moves(key, cp, gc, c if gc == gid else assignment[gc]))
        return out

    def _shared_moves(self, skey, cp: int, gc: int, cc: int) -> list[tuple[Spec, float, int]]:
        """``[(layout, seconds, reader index)]`` of the readers of shared key ``skey`` in group
        ``gc`` (on candidate ``cc``) that need its value's layout changed, its producer on
        ``cp``. Memoized: the local searches ask for the same few pairs of candidates many
        times."""
        key = (skey, cp, gc, cc)
        moves = self._shared_memo.get(key)
        if moves is not None:
            return moves
        if len(self._shared_memo) > 1 << 20:  # a bound on the memo's memory
            self._shared_memo.clear()
        moves = []
        vid = self.shared_value(skey)
        src = self.spec(self.group_of_value[vid], cp, vid)
        if src is not None:
            for i, (g, nid, k) in enumerate(self._shared_readers[skey]):
                if g != gc:
                    continue
                dst = self.required(gc, cc, nid, k)
                if dst is not None and dst != src:
                    moves.append((dst, self.reading_time(vid, src, dst, nid), i))
        self._shared_memo[key] = moves
        return moves

    def _edge_moves(self, assignment):
        """``(value, node, operand, consumer group, src, dst, repeat)`` of every layout change
        between groups under ``assignment`` (``repeat``: another reader's change of the same
        shared value to the same layout is the one made and charged)."""
        specs: dict[int, dict] = {}
        charged = {}
        for key in self._shared_readers:
            for _, i in self._shared_changes(key, assignment).values():
                charged[(key, i)] = True
        for (gp, gc), items in self._edges.items():
            src_specs = specs.get(gp)
            if src_specs is None:
                src_specs = specs[gp] = self.local(gp, assignment[gp]).specs
            for v, nid, k in items:
                dst = self.required(gc, assignment[gc], nid, k)
                src = src_specs.get(v)
                if src is None or dst is None:
                    continue
                repeat = False
                key = self._share_key(v, nid) if nid >= 0 else None
                if key in self._shared_readers:
                    i = self._shared_readers[key].index((gc, nid, k))
                    repeat = src != dst and (key, i) not in charged
                yield v, nid, k, gc, src, dst, repeat

    def required(self, gid: int, c: int, nid: int, k: int) -> Spec | None:
        """Layout consumer ``(nid, k)`` (or ``(-1, input index)``) needs under candidate ``c``."""
        rep = self.table_rep[gid]
        if nid == -1:
            return self.spec(gid, c, self.graph.inputs[k])
        if rep != gid:
            ids = self._rep_maps.get(gid)
            nid = (ids if ids is not None else self._rep_ids(gid))[0][nid]
        loc = self._locals.get((rep, c))
        return (loc if loc is not None else self.local(rep, c)).res[nid].in_specs[k]

    def edge_comms(self, gp: int, cp: int, gc: int, cc: int) -> list[Comm]:
        """The layout changes on the tensors from group ``gp`` (candidate ``cp``) to ``gc``
        (``cc``), each reading operand its own."""
        return self._edge_changes(gp, cp, gc, cc, self._edges.get((gp, gc), ()))

    def _edge_changes(self, gp: int, cp: int, gc: int, cc: int, items) -> list[Comm]:
        out = []
        for v, nid, k in items:
            dst = self.required(gc, cc, nid, k)
            src = self.spec(gp, cp, v)
            if dst is not None and src is not None:
                out.extend(self._defer_shared(self.reshard(v, src, dst, direct=nid < 0), nid))
        return out

    def operand_changes(self, gid: int, c: int, nid: int, assignment) -> float:
        """How many operands of node ``nid`` must be moved (gathered, exchanged) to the layout
        candidate ``c`` needs.

        An operand that must be gathered or exchanged counts one change. Slicing costs nothing but
        is a change of layout: it counts half, so that a partitioner's propagation of an operand's
        split onto a whole operand (a replicated mask or constant cut to match) wins over gathering
        the split one, and otherwise layouts are kept as they arrive. A candidate that splits over a
        mesh axis none of its operands arrives split over, and keeps split, counts one change: a
        partitioner propagates shardings, it does not invent them. Values computed in place from
        constants (masks, position ids, the zeros a scatter accumulates into: the free group) are
        no change at all, and a split they alone are cut to is no invention here: they are made in
        any layout, as the operators that use them would be in an unrolled program (see
        :meth:`operand_changes_of` for how a propagation weighs such a split).
        """
        return self.operand_changes_of(gid, (c,), nid, assignment)[0]

    def operand_changes_of(self, gid: int, cands, nid: int, assignment,
                           from_constants: list | None = None) -> list[float]:
        """:meth:`operand_changes` of each candidate of ``cands`` (the operands' layouts as they
        arrive are looked up once). A split that only values made from constants take (zeros a
        scatter accumulates into, cut to its rows) invents nothing here; ``from_constants``, if
        given, gets one flag per candidate for such a split, so that a propagation can prefer it
        only where it saves moving what arrives."""
        grp = self.groups[gid]
        g = self.graph
        arriving = []
        for v in g.nodes[nid].inputs:
            if v is None:
                arriving.append(None)
                continue
            src_gid = self.group_of_value[v]
            have = self.spec(src_gid, assignment[src_gid], v)
            arriving.append((v, have, None if have is None else self._spec_axes(have),
                             (src_gid == self._free or g.values[v].producer in self.made_by)
                             and have is not None))
        out = []
        for c in cands:
            if grp.kind == LEADER and grp.leader == nid:
                need = grp.candidates[c].in_specs  # no need to build the group's tables
            else:
                need = self.resolution(gid, c, nid).in_specs
            n = 0.0
            kept: set[str] = set()  # axes an operand arrives split over and stays split over
            needed: set[str] = set()
            made: set[str] = set()  # axes only constant-made operands are cut over
            for arr, s in zip(arriving, need):
                if arr is None or s is None:
                    continue
                v, have, have_axes, free_replicated = arr
                wanted = self._spec_axes(s)
                if free_replicated:  # made in place in the layout it is used in
                    made |= wanted
                    continue
                needed |= wanted
                if have is None:
                    continue
                kept |= wanted & have_axes
                if have != s:
                    n += 1.0 if self.reshard(v, have, s) else 0.5
            out.append(n + bool(needed - kept))
            if from_constants is not None:
                from_constants.append(bool(made - needed - kept))
        return out

    def _spec_axes(self, spec: Spec) -> frozenset[str]:
        """The mesh axes a layout splits over (memoized: the searches ask for few layouts,
        many times)."""
        hit = self._axes_cache.get(spec)
        if hit is None:
            hit = self._axes_cache[spec] = frozenset(a for axes in spec for a in axes)
        return hit

    def _edge_list(self, gp: int, gc: int, shared: bool) -> list:
        return (self._edges if shared else self._pair_edges).get((gp, gc), ())

    def edge_time(self, gp: int, cp: int, gc: int, cc: int, *, shared: bool = True) -> float:
        """Seconds of the layout changes on the edge from group ``gp`` (candidate ``cp``) to
        ``gc`` (``cc``), each reader its own (:meth:`edge_comms`). ``shared=False`` leaves out
        the readers of shared values (:meth:`shared_items`), which the objective charges once
        per layout instead (:meth:`shared_time`); a heuristic that looks at one edge at a time
        keeps them."""
        key = (gp, cp, gc, cc, shared)
        t = self._edge_cache.get(key)
        if t is None:
            # An edge between repeated layers costs what the first layers' edge costs (its
            # entries read the table classes' specs, the values' shapes and dtypes and the
            # deferral of their nodes: all equal, see _edge_key): computed once per class.
            cls = self.edge_class(gp, gc, shared)
            ckey = None if cls is None else (cls, cp, cc)
            t = None if ckey is None else self._edge_class_time.get(ckey)
            if t is None:
                items = self._edge_list(gp, gc, shared)
                if self.program_runs is None:
                    t = sum(self.comm_time(cm) for cm in self._edge_changes(
                        gp, cp, gc, cc, items)) - self._credit_time(gp, cp, gc, cc)
                else:
                    t = sum(self.runs(it[1]) * self.comm_time(cm) for it in items
                            for cm in self._edge_changes(gp, cp, gc, cc, (it,)))
                if ckey is not None:
                    self._edge_class_time[ckey] = t
            self._edge_cache[key] = t
        return t

    def decision_key(self, gid: int, assignment, neighbours, decided, fixed) -> tuple:
        """A key equal for two leader groups whose choice a local rule given ``assignment``
        makes alike: groups of one table class (:meth:`table_class`: equal candidates and tables)
        whose operands arrive in the same layouts (and alike made from constants, as
        :meth:`operand_changes_of` reads them), and whose ``neighbours`` (``[(other group, other
        is the producer)]``, in order) that are in ``decided`` send or take the same tensors in
        the same layouts (:meth:`_edge_content`), alike in being in ``fixed``. Every
        :meth:`edge_time` between the group on any candidate and such a neighbour on its
        candidate is then the same number, and so is every cost such a rule compares, added in
        the same order."""
        g = self.graph
        arriving = []
        for v in g.nodes[self.groups[gid].leader].inputs:
            if v is None:
                arriving.append(None)
                continue
            src = self.group_of_value[v]
            have = self.spec(src, assignment[src], v)
            arriving.append((have, have is not None and (
                src == self._free or g.values[v].producer in self.made_by)))
        around = []
        for other, is_producer in neighbours:
            if other not in decided:
                around.append((is_producer,))
            elif is_producer:
                around.append((True, other in fixed,
                               self._edge_content(other, assignment[other], gid, None)))
            else:
                around.append((False, other in fixed,
                               self._edge_content(gid, None, other, assignment[other])))
        return self.table_rep[gid], tuple(arriving), tuple(around)

    def _edge_content(self, gp: int, cp: int | None, gc: int, cc: int | None) -> tuple:
        """What :meth:`edge_time` ``(gp, cp, gc, cc)`` reads, per reading (in order), with the
        side whose candidate is ``None`` named in its table class representative's ids (so its
        every candidate reads the same): the source layout (or value), the layout the reader
        needs (or its node and operand), the value's shape and dtype, whether the change is
        deferred, whether it is made directly (a carried state's), the reader's :meth:`runs`."""
        g = self.graph
        src_ids = self._rep_ids(gp) if cp is None and self.table_rep[gp] != gp else None
        dst_ids = self._rep_ids(gc) if cc is None and self.table_rep[gc] != gc else None
        out = []
        for v, nid, k in self._edges.get((gp, gc), ()):
            # (an id without a counterpart in the representative's stays the group's own)
            if cp is not None:
                src = self.spec(gp, cp, v)
            else:
                src = v if src_ids is None else src_ids[1].get(v, (gp, v))
            if cc is not None:
                dst = self.required(gc, cc, nid, k)
            elif nid < 0:  # a carried state: the layout of its input (value) in the group
                vin = g.inputs[k]
                dst = ("input", vin if dst_ids is None else dst_ids[1].get(vin, (gc, vin)))
            else:
                dst = (nid if dst_ids is None else dst_ids[0].get(nid, (gc, nid)), k)
            val = g.values[v]
            out.append((src, dst, val.shape, val.dtype, self._deferred_at(nid), nid < 0,
                        self.runs(nid)))
        for site in self.sum_sites().get((gp, gc), ()):
            # a merge reads each side's finishing all-reduce (the side without a candidate in
            # its table's ids, which all its candidates read alike)
            out.append(("sum", site.k, site.drops_far,
                        site.far_ids if cp is None else self._finishing(gp, cp, site.far_ids),
                        site.near_ids if cc is None else self._finishing(gc, cc, site.near_ids)))
        return tuple(out)

    def edge_class(self, gp: int, gc: int, shared: bool = True) -> int | None:
        """A small id equal for edges with equal :meth:`_edge_key`, whose :meth:`edge_matrix`
        (of equal candidate lists) is then the same matrix: repeated layers' edges (``None``:
        an edge of its own)."""
        hit = self._edge_classes.get((gp, gc, shared), -1)
        if hit == -1:
            items = self._edge_list(gp, gc, shared)
            key = self._edge_key(gp, gc, items)
            if key is not None and self.program_runs is not None:
                key = (key, tuple(self.runs(nid) for _, nid, _ in items))
            hit = None if key is None else self._edge_class_ids.setdefault(
                key, len(self._edge_class_ids))
            self._edge_classes[(gp, gc, shared)] = hit
        return hit

    def edge_matrix(self, gp: int, gc: int, cps=None, ccs=None, *, shared: bool = True
                    ) -> np.ndarray:
        """Edge times for every (producer candidate, consumer candidate) pair (``shared``: as
        :meth:`edge_time`)."""
        cps = range(len(self.groups[gp].candidates)) if cps is None else cps
        ccs = range(len(self.groups[gc].candidates)) if ccs is None else ccs
        items = self._edge_list(gp, gc, shared)
        # An edge between repeated layers is the same matrix as the first layers' edge: cached
        # under the table classes' ids (what every entry reads: :meth:`spec`, :meth:`required`,
        # :meth:`move_time`).
        key = self.edge_class(gp, gc, shared)
        if key is not None:
            key = (key, tuple(cps), tuple(ccs))
            hit = self._matrix_cache.get(key)
            if hit is not None:
                return hit.copy()
        m = np.zeros((len(cps), len(ccs)))
        # (:meth:`spec` and :meth:`required` of every candidate, their tables looked up once)
        rp, rc = self.table_rep[gp], self.table_rep[gc]
        vmap = self._rep_ids(gp)[1] if rp != gp else None
        nmap = self._rep_ids(gc) if rc != gc else None
        src_tables = [self.local(rp, c).specs for c in cps] if items else ()
        dst_tables = [self.local(rc, c) for c in ccs] if items else ()
        for v, nid, k in items:
            v2 = v if vmap is None else vmap.get(v, -1)
            srcs = [t.get(v2) for t in src_tables]
            if nid == -1:
                vin = self.graph.inputs[k]
                vin = vin if nmap is None else nmap[1].get(vin, -1)
                dsts = [t.specs.get(vin) for t in dst_tables]
            else:
                n2 = nid if nmap is None else nmap[0][nid]
                dsts = [t.res[n2].in_specs[k] for t in dst_tables]
            us, ui = _unique_index(srcs)
            ud, di = _unique_index(dsts)
            m += self.reading_matrix(v, nid, us, ud)[np.ix_(ui, di)]
        credit = self._credit_matrix(gp, gc, list(cps), list(ccs))
        if credit is not None:
            m -= credit
        if key is not None:
            self._matrix_cache[key] = m.copy()
        return m

    def reading_matrix(self, vid: int, nid: int, us: list, ud: list) -> np.ndarray:
        """``[[reading_time(vid, s, d, nid) for d in ud] for s in us]``, 0 where either is
        ``None`` or they are equal (the same floats; not to be written to). Memoized by what
        those entries read (:meth:`move_time`'s key and the reader's :meth:`runs`): the edges of
        repeated layers and of the many values of one shape ask for the same few matrices."""
        v = self.graph.values[vid]
        runs = None if self.program_runs is None else self.runs(nid)
        key = (v.shape, v.dtype, self._deferred_at(nid), nid < 0, runs, tuple(us), tuple(ud))
        t = self._reading_matrices.get(key)
        if t is None:
            t = np.zeros((len(us), len(ud)))
            for a, s in enumerate(us):
                if s is None:
                    continue
                for b, d in enumerate(ud):
                    if d is not None and s != d:
                        t[a, b] = self.reading_time(vid, s, d, nid)
            self._reading_matrices[key] = t
        return t

    def _edge_key(self, gp: int, gc: int, items) -> tuple | None:
        """The edge's items in its groups' table-class representatives' ids (``None``: a carried
        state edge, or ids without a counterpart)."""
        rp, rc = self.table_rep[gp], self.table_rep[gc]
        vmap = self._rep_ids(gp)[1] if rp != gp else None
        nmap = self._rep_ids(gc)[0] if rc != gc else None
        out = []
        for v, nid, k in items:
            if nid < 0:
                return None
            v2 = v if vmap is None else vmap.get(v)
            n2 = nid if nmap is None else nmap.get(nid)
            if v2 is None or n2 is None:
                return None
            out.append((v2, n2, k))
        sites = self.sum_sites().get((gp, gc), ())
        if sites:  # its merges (in the tables' ids: alike across the class)
            return (rp, rc, tuple(out), tuple((s.k, s.far_ids, s.near_ids, s.drops_far)
                                              for s in sites))
        return (rp, rc, tuple(out))

    def move_time(self, vid: int, src: Spec, dst: Spec, nid: int) -> float:
        """Seconds of bringing value ``vid`` from ``src`` to ``dst`` for node ``nid`` (the sum of
        :meth:`comm_time` over its deferred-as-due :meth:`reshard`), memoized by shape."""
        v = self.graph.values[vid]
        key = (v.shape, v.dtype, src, dst, self._deferred_at(nid), nid < 0)
        t = self._move_time.get(key)
        if t is None:
            t = self._move_time[key] = sum(self.comm_time(cm) for cm in self._defer_shared(
                self.reshard(vid, src, dst, direct=nid < 0), nid))
        return t

    # ---- assignments ---------------------------------------------------------------------
    def replicated_assignment(self) -> list[int]:
        """Every group on its fully replicated candidate."""
        out = []
        for grp in self.groups:
            if grp.kind == INPUT:
                out.append(grp.candidates.index(replicated(len(grp.candidates[0]))))
            elif grp.kind == LEADER:
                out.append(0)  # leader_candidates puts the replicated one first
            else:
                out.append(0)
        return out

    def input_candidate(self, gid: int, spec: Spec) -> int:
        """Index of ``spec`` among an input group's candidates.

        The axes splitting one dimension are looked up in mesh order (the cost model does not tell
        ``("a", "b")`` from ``("b", "a")``). Raises :class:`InvalidPlanError` for a layout no
        candidate has (one that does not divide the input's shape).
        """
        grp = self.groups[gid]
        index = self._input_index.get(gid)
        if index is None:
            index = self._input_index[gid] = {s: k for k, s in enumerate(grp.candidates)}
        order = self.mesh.axis_names
        canon = tuple(tuple(sorted(axes, key=order.index)) for axes in spec)
        k = index.get(canon)
        if k is None:
            i = grp.inputs[0]
            raise InvalidPlanError(
                f"layout {spec} of input {self.graph.input_paths[i]!r} (shape "
                f"{self.graph.values[self.graph.inputs[i]].shape}) is not a layout of it on mesh "
                f"{dict(self.sizes)}: every sharded dimension must divide evenly and use mesh axes "
                f"once. Re-plan for this topology.")
        return k

    def check_assignment(self, assignment) -> None:
        """Raise a clear error where ``assignment`` is not one candidate per group of this model
        (a plan's assignment read by another cost model: one with optimizer state apart has more
        groups)."""
        if len(assignment) != len(self.groups):
            raise InvalidPlanError(
                f"an assignment of {len(assignment)} choices for a cost model of "
                f"{len(self.groups)} groups (optimizer state "
                f"{'apart from' if self.optimizer_apart else 'with'} its parameter): it was made "
                f"by another cost model. Judge a plan with its own: "
                f"hj.strategies.plan_cost_model(plan.graph, plan.topology, plan).")

    def evaluate(self, assignment) -> Cost:
        """The :class:`Cost` of one candidate per group."""
        self.check_assignment(assignment)
        compute = 0.0
        comms: list[Comm] = []
        for gid, c in enumerate(assignment):
            loc = self.local(gid, c)
            compute += loc.compute
            comms.extend(loc.comms)
        for _, merged in self.credited_sums(assignment):  # an add's sum all-reduced once
            comms.remove(merged)
        comms.extend(self._edge_charges(assignment))
        by_axis: dict[str, float] = defaultdict(float)
        bytes_axis: dict[str, float] = defaultdict(float)
        grouped: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
        for cm in comms:
            kind = self.backend.kind_of(cm.kind)
            t = self.comm_time_by_axis(cm)
            for a, s in t.items():
                by_axis[a] += s
            for a, b in axis_bytes(kind, cm.bytes, cm.axes, self.topology,
                                   hierarchical=self.backend.hierarchical).items():
                bytes_axis[a] += b
            entry = grouped[(kind, tuple(sorted(cm.axes, key=self.mesh.axis_names.index)),
                             cm.deferred)]
            entry[0] += 1
            entry[1] += cm.bytes
            entry[2] += sum(t.values())
        merged: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
        for (kind, axes, deferred), (count, nbytes, secs) in grouped.items():
            if deferred and self.backend.combines(kind):  # combined into a few
                count = self.combined_count(kind, nbytes)
            entry = merged[(kind, axes)]
            entry[0] += count
            entry[1] += nbytes
            entry[2] += secs
        comm_time = float(sum(by_axis.values()))
        report = liveness(self, assignment)
        # The step is one program: its temporaries (what is live at the peak beyond its
        # arguments, whose results are written into the donated state) are allocated per call.
        pages = self.page_time(report.temporaries)
        compute += pages
        total_peak = sum(d.spec.peak_flops for d in self.topology.devices)
        ideal = self.graph.total_flops / total_peak if total_peak else 0.0
        link = {a: self.topology.axis_scope(a) for a in self.mesh.axis_names}
        return Cost(step_time=compute + comm_time, compute_time=compute, comm_time=comm_time,
                    page_time=pages,
                    comm_time_by_axis=dict(by_axis), comm_bytes=dict(bytes_axis), link_class=link,
                    peak_memory=report.peak, memory_breakdown=dict(report.breakdown),
                    memory_capacity=self.capacity, ideal_time=ideal,
                    collectives=tuple(PredictedCollective(kind=k, axes=a, count=v[0], bytes=v[1],
                                                          time=v[2])
                                      for (k, a), v in sorted(merged.items())))

    def combined_count(self, kind: str, nbytes: float, backend: Backend | None = None) -> int:
        """How many collectives of ``kind`` independent ones of ``nbytes`` together become once
        the backend's combiner merges them (up to its threshold each)."""
        threshold = (backend or self.backend).combine_threshold.get(kind, 0)
        return 1 if math.isinf(threshold) else max(1, math.ceil(nbytes / threshold))

    def program_collectives(self, assignment, *, reduce_scatter: bool = True) -> dict:
        """The collectives the compiled program should contain: ``{(kind, axes): bytes}``.

        Unlike the cost (which charges every use, as an implementation that re-gathers in the
        backward pass pays), a value brought to one layout is counted once: XLA computes it once
        and reuses it. With ``reduce_scatter=False`` reduce-scatters are reported as the
        all-reduce (+ local slice) XLA:CPU emits for them. Collectives inside loop bodies count
        once per iteration (``trip_count`` times): compare them with the HLO's weighted by each
        collective's ``trip_count``.
        """
        out: dict[tuple, int] = defaultdict(int)
        order = self.mesh.axis_names
        for cm in self.program_comm_list(assignment):
            kind = cm.kind if reduce_scatter or cm.kind != "reduce-scatter" else "all-reduce"
            out[(kind, tuple(sorted(cm.axes, key=order.index)))] += cm.bytes
        return dict(out)

    def program_comm_list(self, assignment, *, loops: bool = True) -> list[Comm]:
        """Every collective :meth:`program_collectives` counts, one entry per execution
        (``loops=False``: without those of loop bodies)."""
        return [e.comm for e in self.program_entries(assignment, loops=loops)]

    def program_entries(self, assignment, *, loops: bool = True) -> list[ProgramComm]:
        """:meth:`program_comm_list` with where each collective sits in the graph: the node whose
        result it takes and the node that uses what it returns (what XLA's combiners need to
        know which collectives depend on which)."""
        g = self.graph
        out: list[ProgramComm] = []
        moves: list[tuple[int, int, Spec | None, list[Comm]]] = []  # (value, node, target, comms)
        last: dict[int, int] = {}  # node -> index in ``out`` of its last own collective

        def own(nid, cms):
            for cm in cms:
                out.append(ProgramComm(cm, nid, nid, last.get(nid, -1)))
                last[nid] = len(out) - 1

        for gid, c in enumerate(assignment):
            loc = self.local(gid, c)
            grp = self.groups[gid]
            r = grp.candidates[c] if grp.kind == LEADER else None
            if isinstance(r, LoopResolution):
                if not loops:
                    continue
                out.extend(ProgramComm(cm, grp.leader, grp.leader) for cm in r.program_comms)
                for nid, cms in loc.node_comms.items():
                    if nid != grp.leader:
                        own(nid, cms)
            else:
                for nid, cms in loc.node_comms.items():
                    own(nid, cms)
            for mv in loc.moves:
                if mv.step:  # a later collective of the layout change before it
                    moves[-1][3].append(mv.comm)
                else:
                    moves.append((mv.value, mv.node, self._move_target(loc, mv), [mv.comm]))
        for (gp, gc), items in self._edges.items():
            src_loc = self.local(gp, assignment[gp])
            for v, nid, k in items:
                dst = self.required(gc, assignment[gc], nid, k)
                src = src_loc.specs.get(v)
                if src is not None and dst is not None:
                    moves.append((v, nid, dst, list(self._defer_shared(
                        self.reshard(v, src, dst, direct=nid < 0), nid))))
        # Every value's layout is pinned (:meth:`pinned_layouts`), so a layout change is one
        # reshard of one value, and XLA's partitioner makes a change of one instruction to one
        # layout once however many operators read it (its reshard cache; CSE does not merge
        # collectives). A change made in steps (:meth:`reshard_via`) is a chain of such changes,
        # each from the previous step's result, which the emitter shares among the readers of a
        # value with the same path: a step is made once per value and sequence of layouts up to
        # it, so readers share the steps their paths have in common (a direct change to a path's
        # intermediate is the path's first step), and a path and a direct change to the same
        # layout are both made.
        end = len(g.nodes)
        specs = self.value_specs(assignment)
        # (value, layouts up to a step) -> (index of the change's last collective up to that
        # step, -1: none yet; the index its next collective reads, ``after``)
        seen: dict[tuple, tuple[int, int]] = {}
        readers: dict[int, list[int]] = defaultdict(list)
        for v, nid, dst, comms in moves:
            reader = nid if nid >= 0 else end
            src = self._producer(v)
            layouts, counts = self._move_steps(v, specs.get(v), dst, nid, len(comms))
            tail, prev, made, pos = -1, last.get(src, -1), False, 0
            for j, count in enumerate(counts):
                step, pos = comms[pos:pos + count], pos + count
                key = (v, layouts[:j + 1])
                if key in seen:
                    tail, prev = seen[key]
                    made = False
                    continue
                for cm in step:
                    out.append(ProgramComm(cm, src, reader, prev, v))
                    tail = prev = len(out) - 1
                    made = True
                seen[key] = (tail, prev)
            if tail >= 0 and not made:
                readers[tail].append(reader)
        for i, rs in readers.items():
            out[i] = replace(out[i], readers=tuple(rs))
        return out

    def _reassociated(self, entries: list[ProgramComm], be: Backend, credited=frozenset()
                      ) -> tuple[list[ProgramComm], tuple[Comm, ...]]:
        """``entries`` as a backend that reassociates all-reduces leaves them
        (``Backend.reassociates_all_reduce``): where an ``add`` reads two values that are each
        their producer's one all-reduced partial sum (same mesh axes and bytes; directly or
        through transposes and reshapes, which commute with a sum), read by nothing else and not
        moved to another layout, the two all-reduces are one, of the sum, which the add makes
        and its readers read. Visited in graph order, so a chain of adds (three
        partial sums) reassociates into one. The merged all-reduces the objective does not
        already leave out are returned beside the entries (``Overlap.reassociated_comm_time``):
        ``credited`` names the adds whose merge it prices (:meth:`sum_sites`); a chain's later
        adds, whose saving depends on more than two groups' layouts, it charges."""
        if not be.reassociates_all_reduce:
            return entries, ()
        g = self.graph
        outputs = {v for v in g.outputs if v is not None}
        moved = {e.value for e in entries if e.value >= 0}
        own: dict[int, list[int]] = defaultdict(list)
        for i, e in enumerate(entries):
            if e.value < 0:
                own[e.source].append(i)
        entries = list(entries)
        dropped: set[int] = set()
        priced: set[int] = set()  # merges the objective already leaves out

        def single_partial(v) -> tuple[int, int] | None:
            """(entry, producer) of the one all-reduce that makes ``v``, through layout-only
            operators it commutes with (a transpose of the reduced gradient), each read once."""
            while v is not None:
                if v in moved or v in outputs or len(g.consumers(v)) != 1:
                    return None
                p = g.values[v].producer
                if p is None:
                    return None
                node = g.nodes[p]
                if own.get(p):
                    if len(own[p]) != 1 or len(node.outputs) != 1:
                        return None
                    i = own[p][0]
                    return (i, p) if entries[i].comm.kind == "all-reduce" else None
                if node.name not in _COMMUTES_WITH_SUMS or len(node.inputs) != 1:
                    return None
                v = node.inputs[0]
            return None

        for node in g.nodes:
            if node.name not in ("add", "add_any") or len(node.inputs) != 2 or own.get(node.id):
                continue
            u, w = node.inputs
            if u == w:
                continue
            pu, pw = single_partial(u), single_partial(w)
            if pu is None or pw is None or pu[1] == pw[1]:
                continue
            (i, src_u), (j, src_w) = pu, pw
            a, b = entries[i].comm, entries[j].comm
            if a.axes != b.axes or a.bytes != b.bytes:
                continue
            entries[i] = replace(entries[i], source=node.id, user=node.id, after=-1)
            dropped.add(j)
            if node.id in credited:
                priced.add(j)
            own[src_u], own[src_w] = [], []
            own[node.id] = [i]
        if not dropped:
            return entries, ()
        index, kept = {}, []
        for i, e in enumerate(entries):
            if i not in dropped:
                index[i] = len(kept)
                kept.append(e)
        return ([replace(e, after=index[e.after]) if e.after >= 0 else e for e in kept],
                tuple(entries[j].comm for j in sorted(dropped - priced)))

    # ---- partial sums added: the all-reduces a backend merges, in the objective ----------------
    def sum_sites(self) -> dict[tuple[int, int], tuple[SumSite, ...]]:
        """``{(source group, add's group): (SumSite, ...)}``: where two partial sums are added
        and whether their all-reduces merge depends on two groups' candidates only, so the
        objective prices the merge (``Backend.reassociates_all_reduce``; :meth:`_reassociated`
        finds every merge of the program an assignment makes).

        An ``add`` of two values, each one leader's result through layout-only operators it
        commutes with (transposes, reshapes: ``_COMMUTES_WITH_SUMS``), every value on the way
        read once and none a step's output, where one producer and the path from it are the
        add's own group (the add follows that operand) and the other's are one other group,
        whose result reaches the add over an edge. Under one candidate of each group the merge
        is made when each producer finishes its sum with one all-reduce, over the same axes and
        of the same bytes, and no value on either path is moved (:meth:`sum_credit`); the edge's
        time then leaves out the all-reduce the merge drops (:meth:`edge_time`,
        :meth:`edge_matrix`), and so do :meth:`evaluate` and :meth:`breakdown`. A chain of adds
        (three partial sums) depends on three groups: the objective prices its first merge,
        and the program's further ones are :meth:`combined_program`'s ``reassociated``.

        Empty where the backend does not reassociate, and for a step run as several programs
        (:meth:`by_programs`: a pipeline stage's; its merges are its programs' own)."""
        if self._sum_sites is not None:
            return self._sum_sites
        out: dict[tuple[int, int], list[SumSite]] = defaultdict(list)
        if not self.backend.reassociates_all_reduce or self.program_of is not None:
            self._sum_sites = {}
            return self._sum_sites
        g = self.graph
        outputs = {v for v in g.outputs if v is not None}

        def path(v):
            """(producer, nodes after it, values from its result to ``v``), or None."""
            nodes, values = [], []
            while True:
                if v in outputs or len(g.consumers(v)) != 1:
                    return None
                values.append(v)
                p = g.values[v].producer
                if p is None:
                    return None
                node = g.nodes[p]
                gid = self.group_of_node[p]
                grp = self.groups[gid]
                if grp.kind == LEADER and grp.leader == p:
                    if len(node.outputs) != 1 or node.subgraphs:
                        return None
                    return p, nodes[::-1], values[::-1]
                if node.name not in _COMMUTES_WITH_SUMS or len(node.inputs) != 1:
                    return None
                nodes.append(p)
                v = node.inputs[0]

        for node in g.nodes:
            if node.name not in ("add", "add_any") or len(node.inputs) != 2:
                continue
            u, w = node.inputs
            if u is None or w is None or u == w:
                continue
            ga = self.group_of_node[node.id]
            paths = [path(u), path(w)]
            if paths[0] is None or paths[1] is None:
                continue
            groups = [self.group_of_node[p[0]] for p in paths]
            if groups.count(ga) != 1:
                continue
            j = 0 if groups[0] != ga else 1  # the operand from across the edge
            far, near = paths[j], paths[1 - j]
            gf = groups[j]
            if any(self.group_of_node[n] != gf for n in far[1]) or \
                    any(self.group_of_node[n] != ga for n in near[1]):
                continue
            value = node.inputs[j]
            if (value, node.id, j) not in self._edges.get((gf, ga), ()):
                continue
            ids = []
            for gid, (p, nodes, values), extra in ((gf, far, ()), (ga, near, (node.id,))):
                nmap, vmap = (None, None) if self.table_rep[gid] == gid else self._rep_ids(gid)
                ns = [p, *nodes, *extra]
                if nmap is not None:
                    ns = [nmap.get(n) for n in ns]
                    values = [vmap.get(v) for v in values]
                if None in ns or None in values:
                    break
                ids.append((ns[0], tuple(ns[1:]), frozenset(values)))
            else:
                out[(gf, ga)].append(SumSite(
                    add=node.id, k=j, value=value, src=gf, dst=ga, far=far[0], near=near[0],
                    far_ids=ids[0], near_ids=ids[1], drops_far=j == 1))
        self._sum_sites = {k: tuple(v) for k, v in out.items()}
        return self._sum_sites

    def _finishing(self, gid: int, c: int, ids: tuple) -> Comm | None:
        """The one all-reduce group ``gid``'s candidate ``c`` finishes a :class:`SumSite`
        producer's sum with (``ids``: its ``far_ids`` or ``near_ids``), or None: another
        collective, none, one on the way, or a value on the way moved inside the group."""
        key = (self.table_rep[gid], c, ids)
        hit = self._finishing_memo.get(key, False)
        if hit is not False:
            return hit
        loc = self.table(gid, c)
        producer, nodes, values = ids
        cms = loc.node_comms.get(producer, ())
        out = None
        if len(cms) == 1 and cms[0].kind == "all-reduce" and \
                not any(loc.node_comms.get(n) for n in nodes) and \
                not any(mv.value in values for mv in loc.moves):
            out = cms[0]
        self._finishing_memo[key] = out
        return out

    def sum_credit(self, site: SumSite, cp: int, cc: int) -> Comm | None:
        """The all-reduce the merge at ``site`` leaves out with its source group on candidate
        ``cp`` and the add's on ``cc`` (:meth:`sum_sites`), or None where there is no merge."""
        a = self._finishing(site.src, cp, site.far_ids)
        if a is None:
            return None
        b = self._finishing(site.dst, cc, site.near_ids)
        if b is None or a.axes != b.axes or a.bytes != b.bytes:
            return None
        src = self.spec(site.src, cp, site.value)
        dst = self.required(site.dst, cc, site.add, site.k)
        if src is not None and dst is not None and src != dst and self._defer_shared(
                self.reshard(site.value, src, dst), site.add):
            return None  # the operand is moved: no merge
        return a if site.drops_far else b

    def _credit_time(self, gp: int, cp: int, gc: int, cc: int) -> float:
        """Seconds of the all-reduces merged on edge ``(gp, gc)`` (:meth:`sum_sites`)."""
        t = 0.0
        for site in self.sum_sites().get((gp, gc), ()):
            cm = self.sum_credit(site, cp, cc)
            if cm is not None:
                t += self.comm_time(cm)
        return t

    def _credit_matrix(self, gp: int, gc: int, cps, ccs) -> np.ndarray | None:
        """``[[_credit_time(gp, p, gc, c) for c in ccs] for p in cps]``, or None: no site."""
        sites = self.sum_sites().get((gp, gc), ())
        if not sites:
            return None
        m = np.zeros((len(cps), len(ccs)))
        for site in sites:
            fs = [self._finishing(gp, p, site.far_ids) for p in cps]
            if not any(fs):
                continue
            ns = [self._finishing(gc, c, site.near_ids) for c in ccs]
            for a, f in enumerate(fs):
                if f is None:
                    continue
                for b, n in enumerate(ns):
                    if n is not None and n.axes == f.axes and n.bytes == f.bytes:
                        cm = self.sum_credit(site, cps[a], ccs[b])
                        if cm is not None:
                            m[a, b] += self.comm_time(cm)
        return m

    def credited_sums(self, assignment) -> list[tuple[SumSite, Comm]]:
        """The merges :meth:`sum_sites` prices under ``assignment``, each with the all-reduce
        it leaves out (that producer's: ``site.far`` if ``site.drops_far``, else ``site.near``)."""
        out = []
        for (gp, gc), sites in self.sum_sites().items():
            for site in sites:
                cm = self.sum_credit(site, assignment[gp], assignment[gc])
                if cm is not None:
                    out.append((site, cm))
        return out

    def _move_steps(self, vid: int, src: Spec | None, dst: Spec | None, nid: int, n: int
                    ) -> tuple[tuple, tuple[int, ...]]:
        """The layouts a layout change of ``vid`` to ``dst`` for node ``nid`` passes through (its
        path, then ``dst``) and how many of its ``n`` collectives each step takes, as
        :meth:`pinned_paths` gives the emitter the path (from the value's planned layout
        ``src``)."""
        if src is None or dst is None or src == dst:
            return (dst,), (n,)
        via, comms, counts = self._reshard_path(vid, src, dst, nid < 0)
        if len(comms) != n:  # made from another layout than the value's (not a pinned path)
            return (dst,), (n,)
        return (*via, dst), counts

    def _producer(self, vid: int) -> int:
        """The node computing value ``vid`` (-1 for a graph input)."""
        p = self.graph.values[vid].producer
        return -1 if p is None else p

    def _program_operands(self, entries: list[ProgramComm]) -> list[list[int]]:
        """The program with its collectives as XLA's combiners see it: per instruction, its
        operands in order. Instructions are the nodes (``0 .. n-1``), the collectives of
        ``entries`` (``n + i``) and the step's result (``n + len(entries)``, its operands the
        step's outputs). A node reads a value through the layout change made for it, else through
        its producer's last own collective, else from its producer; a collective reads the
        collective before it (``after``), else its source node."""
        g = self.graph
        n = len(g.nodes)
        own: dict[int, int] = {}  # node -> its last own collective
        moved: dict[tuple[int, int], int] = {}  # (value, reader) -> its layout change's last step
        for i, e in enumerate(entries):
            if e.value < 0:
                own[e.source] = i
            else:
                for r in (e.user, *e.readers):
                    moved[(e.value, r)] = i

        def read(v: int | None, reader: int) -> list[int]:
            if v is None:
                return []
            if (v, reader) in moved:
                return [n + moved[(v, reader)]]
            p = g.values[v].producer
            if p is None:
                return []
            return [n + own[p]] if p in own else [p]

        ops = [[x for v in node.inputs for x in read(v, node.id)] for node in g.nodes]
        ops += [[n + e.after] if e.after >= 0 else [e.source] if e.source >= 0 else []
                for e in entries]
        ops.append([x for v in g.outputs for x in read(v, n)])
        return ops

    @staticmethod
    def _post_order(ops: list[list[int]], live: list[bool]) -> list[int]:
        """XLA's ``HloComputation::MakeInstructionPostOrder`` of a program given as operand lists
        (the last instruction: the result): a depth-first post-order that visits an instruction's
        operands in their order, from the result, then from every other instruction no one uses
        (in order). Instructions not ``live`` (replaced by a combined one) are left out."""
        m = len(ops)
        used = [False] * m
        for x in range(m):
            if live[x]:
                for o in ops[x]:
                    used[o] = True
        state = [0] * m  # 0: new, 1: its operands on the stack, 2: visited
        order: list[int] = []
        for start in [m - 1] + [x for x in range(m - 1) if live[x] and not used[x]]:
            stack = [start]
            while stack:
                x = stack[-1]
                if state[x] == 0:
                    state[x] = 1
                    stack.extend(o for o in reversed(ops[x]) if state[o] != 2)
                    continue
                stack.pop()
                if state[x] == 1:
                    state[x] = 2
                    order.append(x)
        return order

    def _combine(self, entries: list[ProgramComm], be: Backend) -> list[tuple[str, tuple, int]]:
        """The collectives of one computation after the backend's combiners, as
        ``(kind, axes, bytes)`` (:meth:`_combine_groups` without the members)."""
        return [(kind, axes, nbytes) for kind, axes, nbytes, _ in self._combine_groups(entries, be)]

    def _combine_groups(self, entries: list[ProgramComm], be: Backend
                        ) -> list[tuple[str, tuple, int, tuple[int, ...]]]:
        """The collectives of one computation after the backend's combiners, as
        ``(kind, axes, bytes, members)`` (``members``: the indices in ``entries`` of the
        collectives merged into it, in the walk's order; one for a collective left alone), found
        by running XLA's ``CombineInstructionsByKey`` on the program
        with its collectives (:meth:`_program_operands`), one combiner (kind) after another:

        * walk the program in post-order (:meth:`_post_order`); the first collective left opens a
          group, and later ones of its kind and devices join it until one is reachable from a
          member (or the size threshold is reached); one larger than the threshold alone is left
          as it is without ending the group;
        * a group of two or more becomes one collective that takes all its members' operands
          and feeds all their users, and the walk starts again on the changed program, with its
          post-order and reachability rebuilt.

        The changed program's post-order is what decides the next group: it visits all of a
        combined collective's operands where the first of its members' users is. T5's position
        bias gradients (each reduced over "model", then scattered into its table, reduced over
        "data" then "model"): once the two "data" all-reduces are combined, the walk meets the
        decoder's bias all-reduce (which the combined one reads) before any other "model"
        all-reduce; it opens a group, which the next one (reading the combined "data" all-reduce)
        ends at once, and every other "model" all-reduce then combines into one."""
        g = self.graph
        n, k = len(g.nodes), len(entries)
        root = n + k
        axis_order = self.mesh.axis_names
        keys = [(be.kind_of(e.comm.kind), tuple(sorted(e.comm.axes, key=axis_order.index)))
                for e in entries]
        out = [(kind, axes, entries[i].comm.bytes, (i,)) for i, (kind, axes) in enumerate(keys)
               if not be.combines(kind)]
        base = self._program_operands(entries)
        into = list(range(root + 1))  # the instruction that took each one's place
        members: dict[int, list[int]] = {}  # a combined collective -> its collectives

        def rebuild():
            """The post-order of the program as combined so far, and per instruction the
            collectives reachable from it (a bit set, itself included)."""
            live = [into[x] == x for x in range(root + 1)]
            ops = [[into[o] for o in (base[x] if x not in members else
                                      [o for i in members[x] for o in base[n + i]])]
                   if live[x] else [] for x in range(root + 1)]
            post = self._post_order(ops, live)
            users: list[list[int]] = [[] for _ in range(root + 1)]
            for x in post:
                for o in ops[x]:
                    users[o].append(x)
            reach = [0] * (root + 1)
            for x in reversed(post):
                bits = 1 << (x - n) if n <= x < root else 0
                for u in users[x]:
                    bits |= reach[u]
                reach[x] = bits
            return post, reach

        passes = sorted({kind for kind, _ in keys if be.combines(kind)},
                        key=lambda kind: (_COMBINER_ORDER.index(kind)
                                          if kind in _COMBINER_ORDER else len(_COMBINER_ORDER),
                                          kind))
        post, reach = rebuild()
        for kind in passes:
            threshold = be.combine_threshold[kind]
            left = {i for i, (kd, _) in enumerate(keys) if kd == kind}
            while left:
                walk = [x - n for x in post if n <= x < root and x - n in left]
                taken: list[int] = []
                total, key, reached = 0, None, 0
                for i in walk:
                    if not taken:
                        key = keys[i]
                    if keys[i] != key:
                        continue
                    b = entries[i].comm.bytes
                    if b > threshold:  # never combined
                        left.discard(i)
                        out.append((*keys[i], b, (i,)))
                        continue
                    if total + b > threshold or reached >> i & 1:
                        break
                    taken.append(i)
                    total += b
                    reached |= reach[n + i]
                    left.discard(i)
                if taken:
                    out.append((*key, total, tuple(taken)))
                if len(taken) > 1:
                    head = n + taken[0]
                    members[head] = taken
                    for i in taken[1:]:
                        into[n + i] = head
                    post, reach = rebuild()
        return out

    def program_summary(self, assignment, backend: str | Backend | None = None, *,
                        min_bytes: float = 0, exits=None) -> dict:
        """The collectives the compiled program should contain, as a backend compiles them:
        ``{(kind, axes): {"count": int, "bytes": int}}``.

        Each use is counted as :meth:`program_collectives` does; then the backend's treatment
        applies (:mod:`hulkjax.cost.backends`): reduce-scatters become all-reduces where it forms
        none, and its combiners merge the collectives of each computation (:meth:`_combine`): the
        step's, and each loop body's per iteration, with the layout changes of its results on
        exit (``exits``: per body result, its exit layout; the loop's caller passes them),
        repeated ``trip_count`` times. ``backend``: a name (``"cpu"``, ``"gpu"``, ``"tpu"``) or a
        :class:`Backend`; default: the topology's. Compare with the HLO of a program compiled on
        that backend (loop bodies: per iteration, weighted by ``trip_count``). Collectives of at
        most ``min_bytes`` each are left out (scalar metrics, which XLA folds into other
        reductions).

        >>> import jax, jax.numpy as jnp, hulkjax as hj
        >>> def step(ws, x):
        ...     loss = lambda ws: sum(jnp.sum(jnp.tanh(x @ w)) for w in ws)
        ...     return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]
        >>> p = hj.plan(step, [jnp.ones((8, 8))] * 3, jnp.ones((16, 8)),
        ...             topology=hj.Topology.grid((8,), ("d",)), strategy="dp")
        >>> hj.strategies.plan_cost_model(p.graph, p.topology, p).program_summary(p.assignment)
        {('all-reduce', ('d',)): {'count': 1, 'bytes': 768}}
        """
        from hulkjax.cost.backends import BACKENDS

        be = self.backend if backend is None else (
            BACKENDS[backend] if isinstance(backend, str) else backend)
        out: dict[tuple, dict] = {}
        # A combiner merges collectives of one computation: the step's, and each loop body's per
        # iteration (its own program, its results' layout changes on exit included), repeated
        # trip_count times.
        entries, _ = self._reassociated(self.program_entries(assignment, loops=False), be)
        entries += self._exit_entries(assignment, exits or (), len(entries))
        for kind, axes, nbytes in self._combine(entries, be):
            if nbytes <= min_bytes:
                continue
            entry = out.setdefault((kind, axes), {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += nbytes
        for gid, c in enumerate(assignment):
            r = self.groups[gid].candidates[c] if self.groups[gid].kind == LEADER else None
            if not isinstance(r, LoopResolution):
                continue
            for body in r.bodies:
                inner = body.cost_model.program_summary(body.assignment, be, min_bytes=min_bytes,
                                                        exits=body.outputs)
                for key, e in inner.items():
                    entry = out.setdefault(key, {"count": 0, "bytes": 0})
                    entry["count"] += e["count"] * r.trips
                    entry["bytes"] += e["bytes"] * r.trips
        return out

    def combined_program(self, assignment, backend: str | Backend | None = None, *,
                         exits=None) -> CombinedProgram:
        """The step's program (loop bodies left to their own: a loop is one node) with its
        collectives as ``backend``'s combiners merge them (the groups :meth:`program_summary`
        counts), and who reads whom (:class:`CombinedProgram`). ``exits``: as for
        :meth:`program_summary` (a loop body's result layouts on exit)."""
        from hulkjax.cost.backends import BACKENDS

        be = self.backend if backend is None else (
            BACKENDS[backend] if isinstance(backend, str) else backend)
        credited = frozenset(s.add for s, _ in self.credited_sums(assignment)) \
            if be == self.backend else frozenset()
        entries, merged = self._reassociated(self.program_entries(assignment, loops=False), be,
                                             credited)
        on_exit = self._exit_entries(assignment, exits or (), len(entries))
        entries += on_exit
        groups = tuple(CombinedCollective(kind, axes, nbytes, members)
                       for kind, axes, nbytes, members in self._combine_groups(entries, be))
        n = len(self.graph.nodes)
        where = [0] * len(entries)  # entry -> its combined collective's instruction
        for j, grp in enumerate(groups):
            for i in grp.members:
                where[i] = n + j
        base = self._program_operands(entries)

        def mapped(ops):
            out: list[int] = []
            for o in ops:
                x = o if o < n else where[o - n]
                if x not in out:
                    out.append(x)
            return out

        operands = [mapped(base[x]) for x in range(n)]
        operands += [mapped([o for i in grp.members for o in base[n + i]]) for grp in groups]
        operands.append(mapped(base[-1]))
        order = self._post_order(operands, [True] * len(operands))
        return CombinedProgram(n, entries, groups, operands, order, len(on_exit), merged)

    def overlapped(self, assignment, backend: str | Backend | None = None):
        """The step time with collectives overlapped with compute as XLA's latency-hiding
        scheduler overlaps them, and which collectives it hides: :func:`hulkjax.cost.overlap.
        overlap` (a refinement of :meth:`evaluate`'s additive ``step_time``, which bounds it)."""
        from hulkjax.cost.overlap import overlap

        return overlap(self, assignment, backend)

    def _exit_entries(self, assignment, exits, base: int = 0) -> list[ProgramComm]:
        """A loop body's results brought to their exit layouts (``exits``: per body result, the
        layout it leaves in, ``None``: as produced), as the body's last collectives; carried
        results are changed by the body's carried edges already. ``base``: how many entries
        come before them in the list they join (a step's ``after`` indexes that list)."""
        if not exits:
            return []
        g = self.graph
        specs = self.value_specs(assignment)
        carried = set(g.carried.values())
        out: list[ProgramComm] = []
        for i, spec in enumerate(exits):
            vid = g.outputs[i] if i < len(g.outputs) else None
            if spec is None or vid is None or i in carried or specs.get(vid) is None:
                continue
            src = self._producer(vid)
            prev = -1
            for cm in self.reshard(vid, specs[vid], spec, direct=True):
                out.append(ProgramComm(cm, src, len(g.nodes), prev, vid))
                prev = base + len(out) - 1
        return out

    def _move_target(self, loc: Local, mv: Move) -> Spec | None:
        """The layout an in-group move brings its value to (``None``: a state result's)."""
        if mv.node < 0:
            return None
        n = self.graph.nodes[mv.node]
        return next((s for v, s in zip(n.inputs, loc.res[mv.node].in_specs) if v == mv.value),
                    None)

    def assignment_comms(self, assignment) -> list[Comm]:
        """Every collective the cost charges for an assignment (groups' own, then edges')."""
        out: list[Comm] = []
        for gid, c in enumerate(assignment):
            out.extend(self.local(gid, c).comms)
        out.extend(self._edge_charges(assignment))
        return out

    def _edge_charges(self, assignment) -> list[Comm]:
        """The collectives the objective charges for layout changes between groups: each edge's
        own (``shared=False``), and each shared value's once per layout (:meth:`shared_time`)."""
        out: list[Comm] = []
        for (gp, gc), items in self._pair_edges.items():
            out.extend(self._edge_changes(gp, assignment[gp], gc, assignment[gc], items))
        for key, readers in self._shared_readers.items():
            v = self.shared_value(key)
            src = self.spec(self.group_of_value[v], assignment[self.group_of_value[v]], v)
            for dst, (_, i) in self._shared_changes(key, assignment).items():
                nid = readers[i][1]
                out.extend(self._defer_shared(self.reshard(v, src, dst), nid))
        return out

    def objective(self, assignment) -> float:
        """``evaluate(assignment).step_time`` computed from the tables (what the ILP minimizes;
        under :meth:`by_programs` with runs, each program's share times its runs)."""
        t = sum(self.table_time(gid, c) for gid, c in enumerate(assignment))
        for gp, gc in self._pair_edges:
            t += self.edge_time(gp, assignment[gp], gc, assignment[gc], shared=False)
        for key in self._shared_readers:
            t += self.shared_time(key, assignment)
        return t

    def memory(self, assignment) -> float:
        """Per-device memory of an assignment in the additive model the ILP constrains: every
        group's parameters, gradients, optimizer state and saved activations at their layouts.
        The reported peak (``evaluate(...).peak_memory``) is :func:`~hulkjax.cost.memory.liveness`'s
        walk, which this sum usually bounds from above (not where a combined gradient reduction
        holds its operands and results at once); planners check their result with the walk."""
        return sum(self.table(gid, c).memory for gid, c in enumerate(assignment))

    def peak_memory(self, assignment) -> float:
        """Per-device peak memory of an assignment (the liveness walk), bytes."""
        return liveness(self, assignment).peak

    def breakdown(self, assignment, *, memory: bool = True) -> Breakdown:
        """Per-operator compute, collectives and memory of an assignment (see :class:`Breakdown`).

        >>> import jax.numpy as jnp, hulkjax as hj
        >>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)))
        >>> cm = CostModel(g, hj.Topology.grid((8,), ("d",)))
        >>> a = cm.replicated_assignment()
        >>> abs(sum(cm.breakdown(a).compute) - cm.evaluate(a).compute_time) < 1e-15
        True
        """
        key = tuple(assignment)
        hit = self._breakdowns.get(key)
        if hit is None:
            self.check_assignment(assignment)
            hit = self._breakdown_parts(assignment)
            if len(self._breakdowns) >= _BREAKDOWNS_KEPT:
                self._breakdowns.pop(next(iter(self._breakdowns)))  # the oldest
            self._breakdowns[key] = hit
        specs, compute, own, moves = hit
        # Copies: a caller may change its record; the kept parts stay as computed.
        uses: list[MemoryUse] = []
        merged: dict[int, tuple[Comm, ...]] = defaultdict(tuple)
        for site, cm in self.credited_sums(assignment):
            merged[site.far if site.drops_far else site.near] += (cm,)
        b = Breakdown(list(assignment), dict(specs), list(compute), dict(own), list(moves), uses,
                      dict(merged))
        if memory:
            for buf in liveness(self, assignment, breakdown=b).live:  # the buffers at the peak
                gid = (self.group_of_value[buf.value] if buf.value is not None
                       else self.group_of_node[buf.node])
                uses.append(MemoryUse(buf.node, gid, buf.kind, buf.bytes))
        return b

    def _breakdown_parts(self, assignment) -> tuple:
        """``(specs, compute, own, moves)`` of :meth:`breakdown` (everything but the memory)."""
        g = self.graph
        compute = [0.0] * len(g.nodes)
        own: dict[int, tuple[Comm, ...]] = {}
        moves: list[Move] = []
        specs: dict[int, Spec] = {}
        for gid, c in enumerate(assignment):
            loc = self.local(gid, c)
            specs.update(loc.specs)
            for nid, t in loc.node_compute.items():
                compute[nid] = t
            own.update(loc.node_comms)
            moves.extend(loc.moves)
        for v, nid, _, gc, src, dst, repeat in self._edge_moves(assignment):
            moves.extend(Move(v, nid, gc, m, step, repeat, dst) for step, m in
                         enumerate(self._defer_shared(
                             self.reshard(v, src, dst, direct=nid < 0), nid)))
        return specs, compute, own, moves

    # ---- plan output ---------------------------------------------------------------------
    def value_specs(self, assignment) -> dict[int, Spec]:
        out: dict[int, Spec] = {}
        for gid, c in enumerate(assignment):
            out.update(self.local(gid, c).specs)
        return out

    def pinned_layouts(self, assignment) -> tuple[dict, dict]:
        """What the emitter constrains: ``({(node, operand): Spec}, {(node, result): Spec})``
        under ``assignment``; literals and scalars left out.

        Every result is pinned to its planned layout, and so is every operand whose layout the
        plan changes (a cross-group edge or an in-group move that is not free), besides each
        leader's operands and a top-k's (the emitter runs it per shard; XLA's partitioner would
        gather it). With every value pinned, XLA's partitioner performs exactly the plan's layout
        changes, each where the plan puts it, and the cost model prices the program that
        compiles. Left free, XLA's sharding propagation chooses layouts for unconstrained values
        by its own rules: on BERT's tensor-parallel step it pulled the attention's gradient chain
        onto a bias gradient's split and gathered it again for the matmuls (20 all-gathers where
        the plan has 8); predicted collectives agreed with the compiled ones in 77% of the
        real-model cases with leaders alone pinned, 91% with every value (97% with the rules for
        sharded slices, concatenates and scatters that XLA then compiles as planned;
        ``python benchmarks/realmodels.py --skip-quality``).
        """
        g = self.graph
        operands, results = {}, {}
        specs = self.value_specs(assignment)
        for n in g.nodes:
            for k, o in enumerate(n.outputs):
                if g.values[o].shape and specs.get(o) is not None:
                    results[(n.id, k)] = specs[o]

        def pin(nid, k, v, spec):
            if nid >= 0 and spec is not None and g.values[v].shape:
                operands[(nid, k)] = spec

        for gid, c in enumerate(assignment):
            grp, loc = self.groups[gid], self.local(gid, c)
            if grp.kind == LEADER:
                node = g.nodes[grp.leader]
                for k, (v, s) in enumerate(zip(node.inputs, loc.res[node.id].in_specs)):
                    if v is not None:
                        pin(node.id, k, v, s)
            for nid in grp.members:
                if g.nodes[nid].primitive in TOP_K:
                    for k, (v, s) in enumerate(zip(g.nodes[nid].inputs, loc.res[nid].in_specs)):
                        if v is not None:
                            pin(nid, k, v, s)
            for mv in loc.moves:
                if mv.node >= 0:
                    for k, v in enumerate(g.nodes[mv.node].inputs):
                        if v == mv.value:
                            pin(mv.node, k, v, loc.res[mv.node].in_specs[k])
        for (_, gc), items in self._edges.items():
            for v, nid, k in items:
                if nid >= 0 and specs.get(v) != (dst := self.required(gc, assignment[gc], nid, k)):
                    pin(nid, k, v, dst)
        return operands, results

    def pinned_paths(self, assignment, operands=None) -> dict:
        """``{(node, operand): (Spec, ...)}``: the layouts a pinned operand passes through
        before its pin (:meth:`pinned_layouts`), where :meth:`reshard` prices its layout change
        in steps (:meth:`reshard_via`); the emitter constrains the operand to each in turn, so
        XLA makes the steps priced, not its own dearer change. ``operands``: the pins, if the
        caller has them."""
        g = self.graph
        if operands is None:
            operands = self.pinned_layouts(assignment)[0]
        specs = self.value_specs(assignment)
        out = {}
        for (nid, k), dst in operands.items():
            v = g.nodes[nid].inputs[k]
            src = specs.get(v)
            if src is not None and src != dst:
                via = self.reshard_via(v, src, dst)
                if via:
                    out[(nid, k)] = via
        return out


def _merge_changes(out: dict, moves) -> None:
    """Merge a reader group's ``[(layout, seconds, reader index)]`` into ``{layout: (seconds,
    reader index)}``: the dearest reading per layout; of equal ones, the first reader's."""
    for dst, t, i in moves:
        had = out.get(dst)
        if had is None or t > had[0] or (t == had[0] and i < had[1]):
            out[dst] = (t, i)


def _unique_index(items):
    uniq, index, pos = [], [], {}
    for it in items:
        j = pos.get(it)
        if j is None:
            j = pos[it] = len(uniq)
            uniq.append(it)
        index.append(j)
    return uniq, np.array(index, dtype=np.int64)
