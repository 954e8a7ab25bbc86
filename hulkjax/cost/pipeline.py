"""The cost of a staged (pipeline) plan, built on the cost model of each stage's device group.

Where this sits::

    stage k: CostModel(microbatch graph, sub-topology of its devices) + an SPMD assignment
             + the nodes it runs (forward / backward per microbatch, update per step)
                          |  per-node compute, collectives and memory (CostModel.breakdown)
                          v
    pipeline_cost: per-stage times, transfers between stages (alpha-beta on the link between
    their devices), the schedule (1F1B or GPipe) -> hulkjax.Cost with stages, bubble, transfers

**Per stage** (each number from the stage's own cost model, so a stage of V100s computes at the
V100's pace and its collectives pay its own links):

* ``forward`` / ``backward``: per microbatch, the roofline compute of its forward / backward nodes
  at the microbatch's shapes, the collectives its SPMD plan implies for them and the layout
  changes into them; a weight gradient the stage accumulates unreduced
  (:mod:`hulkjax.cost.unreduced`: its plan splits the batch over mesh axes and leaves the
  gradient whole over them) is not reduced there, as the emitted program does not reduce it;
  one reduced as a shard (fsdp-like layouts) is, in every microbatch's backward (ZeRO-3);
* ``reduction``: once per step, the all-reduce of each unreduced gradient's float32
  accumulator, run right after the stage's last forward or backward, as the emitted step runs
  it: the discrete-event schedule below keeps the stage's group busy with it (an interleaved
  plan's later chunks on the group wait), the drain after it hides it (the stages still busy
  with the last microbatch), and the rest lengthens the pipeline; such a gradient sent to
  another stage's update leaves after it;
* ``update``: once per step, its optimizer nodes and the layout changes of its state;
* fresh pages: each of these programs allocates its temporaries on every call, and a device
  whose runtime maps them afresh (``DeviceSpec.fresh_page_time``: XLA:CPU, above glibc's mmap
  threshold) pays for their pages in each call (:meth:`~hulkjax.cost.model.CostModel.page_time`
  of the liveness walk's temporaries over the program's nodes); a microbatch's programs often
  stay under the threshold where the whole step's does not;
* memory per device: its parameters, gradients and optimizer state, float32 gradient accumulators
  (more than one microbatch), and the saved activations and data of the microbatches in flight
  (1F1B: ``min(M, S - k)`` on stage ``k``; GPipe: ``M``; interleaved: the most a chunk holds in its
  group's order, :func:`~hulkjax.plan.stages.schedule_in_flight`). In an interleaved plan a
  device holds every chunk of its group: the chunks' memory adds up (each chunk's peak inside its
  own programs counted, an overestimate by the transient of the others).

**Transfers**: every value one stage produces and another reads is sent over the link between
their devices (``Topology.link``, the slowest pair): per microbatch for activations and their
gradients, once per step for parameters read by another stage and for gradients sent to the stage
that updates them. Bytes per device are what each receiving device must get of its layout, spread
over the sending devices (``max(dst_local, dst_local * n_dst / n_src)``); one message per
microbatch and direction pays the latency.

**Schedule** (``M`` microbatches, stage work ``w_k = f_k + b_k``, link times ``c``):

* 1F1B: ``sum_k w_k + sum_links (c_fwd + c_bwd) + (M - 1) * max(max_k w_k, max_k
  max(out_k, in_k))``: transfers overlap with compute in the steady state, the fill and drain pay
  every stage and link once. ``out_k`` / ``in_k`` are the link times of everything stage ``k``
  sends / receives per microbatch: links are full duplex, but a stage's sends to two stages
  (a middle stage's activations on and gradients back) share its devices' bandwidth;
* GPipe: the same for the forward phase (``f``, ``c_fwd``), then for the backward phase;
* interleaved 1F1B (Narayanan et al., SC'21; ``G`` device groups with ``v`` chunks each, ``W_d``
  the per-microbatch work of group ``d``'s chunks): ``(sum_d W_d - max_d W_d) / v + max_d W_d +
  sum_boundaries (c_fwd + c_bwd) + (M - 1) * max(max_d W_d, max_d max(out_d, in_d)))``
  (``out_d`` / ``in_d``: the transfers of every chunk boundary from / into group ``d``): the bubble is ``(G - 1) / v`` of a group's
  work, each microbatch crosses every one of the ``G v - 1`` chunk boundaries (``v`` times 1F1B's
  transfers, in fill and drain and in the steady state). With equal chunks, and sends no longer
  than a chunk's forward, this is the makespan of the emitted order exactly, transfers included
  (checked in the tests); with ``v = 1`` it is the 1F1B formula, which is optimistic when sends
  are not free (the steady state's round trips stall 1F1B, the same test shows);
* and never less than the emitted order run as a discrete-event schedule (each group runs its
  programs in :func:`~hulkjax.plan.stages.schedule_queues` order, each once the group is free
  and its inputs have arrived, sends as delays, a stage's reduction after its last program):
  that is where 1F1B's stalls come in (on the WAN testbed a 3-stage 1F1B GPT step measured its
  sends almost fully exposed; the closed form predicted them hidden). The pipeline's time is
  the larger of the two, so the closed form's link-load bound stays;

then what the per-step transfers leave exposed, then the slowest group's update (its chunks'
updates in turn). A parameter one stage holds and another reads goes at the start of the step and
is hidden by the fill before its reader's first forward (the forwards and forward sends of the
stages before it, less the first microbatch's send on the same link, which waits behind it); a
gradient sent back to the stage that updates it goes once its sender's last backward is done and
is hidden by the drain after it (the backwards and backward sends of the stages before the
sender, less the last microbatch's send on the same link). Only their excess over those windows adds to the step (summed over
the pairs of stages, as if they shared one link), the rest overlaps as the emitted program
overlaps it (the receiver waits for the value only where it reads it); a value an update
produces has no window (nor has one sent by the first stage, whose last backward ends the
pipeline). The
*bubble* is what the busiest group does not spend computing or communicating: ``step - its
compute - its collectives``.

Approximations (stated so a reader knows what the number means): transfers ride separate links
and engines (they never slow a stage's compute), except on a device whose
``DeviceSpec.receive_overhead`` says its network stack shares its cores (a CPU process pinned to
its cores: that share of each per-microbatch receive's link time is added to the receiving
stage's forward or backward that reads it; per-step transfers are not charged); a stage's
forward and backward take the same time for every microbatch; values of several transfers
between one pair of stages in one direction go as one message; the update starts when the last microbatch's backward ends on every stage (a
stage that finishes early does not start its update early); a group's reductions are charged as
a step's gradient all-reduces are (each its bytes and its share of the latency of the one XLA
combines them into), and their scaling and cast to the gradient's dtype are not charged
(elementwise, as the combination of the sums reduced per microbatch is not); host dispatch is
free.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from hulkjax.cost.comm import axis_bytes
from hulkjax.cost.memory import liveness
from hulkjax.cost.model import CostModel
from hulkjax.cost.unreduced import unreduced_sums
from hulkjax.plan.cost import Cost, PredictedCollective, StageTime, Transfer
from hulkjax.plan.specs import Spec, local_shape
from hulkjax.plan.stages import schedule_in_flight, schedule_times
from hulkjax.trace.graph import DATA, OPTIMIZER, PARAMETER, OpGraph, dtype_size
from hulkjax.trace.microbatch import BatchSplit


@dataclass
class StageWork:
    """What one stage runs, on which devices, and how (the input of :func:`pipeline_cost`).

    Attributes:
      devices: indices into the topology's devices.  # tuple of int
      cost_model: the cost model of the step at microbatch size on the stage's sub-topology.
      assignment: its SPMD plan (a candidate per cost-model group).  # list of int
      forward / backward / update: node ids it runs.  # tuple of int
      inputs: argument leaves it holds.  # tuple of int
    """

    devices: tuple[int, ...]
    cost_model: CostModel
    assignment: list[int]
    forward: tuple[int, ...]
    backward: tuple[int, ...]
    update: tuple[int, ...]
    inputs: tuple[int, ...] = ()


@dataclass
class NodeCosts:
    """Per-node time, compute and communication of one assignment, and its memory records.

    Attributes:
      time / compute / comm: seconds per node (``time = compute + comm``); ``comm`` holds the
        node's own collectives and the layout changes of its operands, each reader's own (a
        ``repeat`` move too: a stage runs a program per phase, and each program that reads a
        value makes its own copy; an SPMD plan's cost charges a shared change once). A stage's
        time takes :func:`shared_excess` off: the copies its programs share.  # np.ndarray
      shared: ``{(value, target layout): ((node, seconds, move indices), ...)}``: the readings
        of one layout change of a value between groups (where there are several), each with its
        change's seconds and the indices of its steps in ``moves``.  # dict
      state_moves: ``{input index: seconds}``: carried state results brought back to the layout of
        their input.  # dict
      memory: ``(node or None, input indices of its group, kind, bytes)`` per device.  # list
      specs: planned layout of every value.  # dict
      own / moves: the breakdown's collectives of each node and layout changes
        (:class:`~hulkjax.cost.model.Breakdown`).  # dict, list
    """

    time: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    state_moves: dict[int, float] = field(default_factory=dict)
    memory: list = field(default_factory=list)
    specs: dict = field(default_factory=dict)
    own: dict = field(default_factory=dict)
    moves: list = field(default_factory=list)
    shared: dict = field(default_factory=dict)
    _order: tuple | None = field(default=None, repr=False, compare=False)

    def by_node(self) -> tuple[dict[int, int], dict[int, list[int]]]:
        """``({node: its position in own}, {node: indices of its moves})``: a stage's
        collectives found from its nodes, in the order of the whole's."""
        if self._order is None:
            moves: dict[int, list[int]] = defaultdict(list)
            for i, m in enumerate(self.moves):
                moves[m.node].append(i)
            self._order = ({nid: j for j, nid in enumerate(self.own)}, dict(moves))
        return self._order


def _copies(nc: NodeCosts, nodes) -> list[tuple[int, float, tuple]]:
    """The readings in ``nodes`` (one program's operators) of a shared change that the program
    does not make: of several readings of the same change of a value (to one layout), only the
    dearest (the first of equal ones) is made, as XLA's partitioner keeps one reshard per
    instruction and sharding."""
    mine = set(nodes)
    out = []
    for readings in nc.shared.values():
        rs = [r for r in readings if r[0] in mine]
        if len(rs) > 1:
            keep = max(range(len(rs)), key=lambda j: (rs[j][1], -j))
            out.extend(r for j, r in enumerate(rs) if j != keep)
    return out


def shared_excess(nc: NodeCosts, nodes) -> float:
    """Seconds :attr:`NodeCosts.time` charges ``nodes`` (one program's operators) for layout
    changes that program makes once (:func:`_copies`)."""
    return float(sum(t for _, t, _ in _copies(nc, nodes))) if nc.shared else 0.0


def node_costs(cm: CostModel, assignment) -> NodeCosts:
    """Per-node costs of ``assignment`` under ``cm`` (memoized on the cost model's graph).

    Every operator's own collectives are charged, those a GPU merges into the all-reduce of a
    sum of partial sums (``Breakdown.merged``) too: a stage's programs are planned without
    that merge (:meth:`~hulkjax.cost.model.CostModel.sum_sites` of a :meth:`by_programs`
    view), and they are costed alike."""
    key = ("node_costs", id(cm), tuple(assignment))
    memo = cm.graph.memo
    hit = memo.get(key)
    if hit is not None and hit[0] is cm:
        return hit[1]
    g = cm.graph
    b = cm.breakdown(list(assignment))
    compute = np.array(b.compute, dtype=np.float64)
    comm = np.zeros(len(g.nodes))
    for nid, comms in b.own.items():
        comm[nid] += sum(cm.comm_time(c) for c in comms)
    carried_input = {g.outputs[o]: i for i, o in g.carried.items() if g.outputs[o] is not None}
    state_moves: dict[int, float] = defaultdict(float)
    readings: dict[tuple, list] = defaultdict(list)  # (value, target) -> [[node, s, steps]]
    for i, m in enumerate(b.moves):
        t = cm.comm_time(m.comm)
        if m.node >= 0:
            comm[m.node] += t
            if m.target is not None:  # a change between groups: one reading, step by step
                rs = readings[(m.value, m.target)]
                if m.step == 0 or not rs or rs[-1][0] != m.node:
                    rs.append([m.node, 0.0, []])
                rs[-1][1] += t
                rs[-1][2].append(i)
        elif m.value in carried_input:
            state_moves[carried_input[m.value]] += t
    shared = {k: tuple((n, t, tuple(ix)) for n, t, ix in rs)
              for k, rs in readings.items() if len(rs) > 1}
    memory = [(u.node, cm.groups[u.group].inputs, u.kind, u.bytes) for u in b.memory]
    out = NodeCosts(time=compute + comm, compute=compute, comm=comm,
                    state_moves=dict(state_moves), memory=memory, specs=b.specs, own=b.own,
                    moves=b.moves, shared=shared)
    memo[key] = (cm, out)
    return out


def local_bytes(graph: OpGraph, vid: int, spec: Spec | None, sizes) -> float:
    """Bytes of value ``vid`` on one device under ``spec`` (the whole value without one)."""
    v = graph.values[vid]
    if spec is None:
        return float(v.nbytes)
    # math.prod of ints is exact, as np.prod in float64 is below 2**53 elements
    return float(math.prod(local_shape(v.shape, spec, sizes))) * dtype_size(v.dtype)


def stage_link(topology, src: tuple[int, ...], dst: tuple[int, ...]):
    """The slowest link between two device groups (one device per node compared)."""
    def reps(ids):
        seen: dict[str, int] = {}
        for d in ids:
            seen.setdefault(topology.devices[d].node, d)
        return list(seen.values())

    links = [topology.link(a, b) for a in reps(src) for b in reps(dst)]
    return min(links, key=lambda ln: (ln.bandwidth, -ln.latency))


def link_class(topology, src: tuple[int, ...], dst: tuple[int, ...]) -> str:
    a, b = topology.devices[src[0]], topology.devices[dst[0]]
    if a.region != b.region:
        return "wan"
    return "region" if a.node != b.node else "node"


def pipeline_cost(topology, graph: OpGraph, stages: list[StageWork], *, microbatches: int,
                  schedule: str = "1f1b", split: BatchSplit | None = None,
                  virtual_stages: int = 1) -> Cost:
    """The :class:`~hulkjax.plan.Cost` of a staged plan (see the module docstring).

    Args:
      topology: the whole cluster.
      graph: the step at full batch (its FLOPs give the ideal time).
      stages: the stages in pipeline order (for ``"interleaved"``: every chunk, stage ``j`` on
        the devices of stage ``j % (len(stages) // virtual_stages)``).
      microbatches: ``M``.
      schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"``.
      split: the step's microbatch analysis (:mod:`hulkjax.trace.microbatch`). With ``M > 1``
        its boundary sums (gradients and summed losses) get float32 accumulators (in memory),
        and those a stage's plan lets it accumulate unreduced (:mod:`hulkjax.cost.unreduced`)
        are reduced once per step instead of in every microbatch.
      virtual_stages: ``v``, chunks per device group (``"interleaved"`` only).
    """
    M, S, v = microbatches, len(stages), virtual_stages
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"virtual_stages={v} needs schedule='interleaved', got {schedule!r}")
    G = S // v  # device groups
    group = [k % G for k in range(S)]
    split = split if M > 1 else None
    boundary = () if split is None else tuple(
        x for x, c in split.boundary.items() if c.kind == "sum")
    unreduced = [unreduced_sums(s.cost_model, s.assignment, split, s.forward + s.backward)
                 for s in stages]
    work = [_stage_times(s, u) for s, u in zip(stages, unreduced)]
    stage_of: dict[int, int] = {}
    phase_of: dict[int, str] = {}
    for k, s in enumerate(stages):
        for ph, nodes in (("F", s.forward), ("B", s.backward), ("U", s.update)):
            for nid in nodes:
                stage_of[nid] = k
                phase_of[nid] = ph
    holder = {i: k for k, s in enumerate(stages) for i in s.inputs}
    transfers = _transfers(topology, stages, stage_of, phase_of, holder, M,
                           {x for u in unreduced for x in u})
    # A device whose network stack shares its cores (DeviceSpec.receive_overhead: a CPU process
    # pinned to its cores) loses that share of a receive's time on the link to compute: charged
    # to the receiving stage's program that reads the value, per microbatch (a forward's value
    # sent back down the pipeline, a skip connection's, is read by a backward).
    for (a, c), t in transfers.items():
        rho = max(topology.devices[d].spec.receive_overhead for d in stages[c].devices)
        if rho > 0:
            work[c]["f" if a < c else "b"] += rho * t["fwd"]
            work[c]["b"] += rho * t["bwd"]
    f = [w["f"] for w in work]
    b = [w["b"] for w in work]
    u = [w["u"] for w in work]
    fwd_links = [t for t in transfers.values() if t["fwd"] > 0]
    bwd_links = [t for t in transfers.values() if t["bwd"] > 0]
    cf = [t["fwd"] for t in fwd_links]
    cb = [t["bwd"] for t in bwd_links]
    if schedule == "gpipe":
        t_f = sum(f) + sum(cf) + (M - 1) * max(max(f), max(cf, default=0.0))
        t_b = sum(b) + sum(cb) + (M - 1) * max(max(b), max(cb, default=0.0))
        t_pipe = t_f + t_b
    else:
        # Per device group: the work of its chunks, and per ordered pair of groups the transfers
        # of every chunk boundary between them (one chunk per group for 1F1B).
        w = [0.0] * G
        for k in range(S):
            w[group[k]] += f[k] + b[k]
        # Per microbatch, what each group sends and what it receives: a group's sends to
        # different groups share its devices' bandwidth (a middle stage sends activations on
        # and gradients back over the same uplink; links are full duplex).
        egress, ingress = [0.0] * G, [0.0] * G
        for (a, c), t in transfers.items():
            if group[a] != group[c]:
                egress[group[a]] += t["fwd"] + t["bwd"]
                ingress[group[c]] += t["fwd"] + t["bwd"]
        duplex = egress + ingress
        # Fill and drain: the chunks' work once, 1 / v of it exposed (Narayanan et al.: the bubble
        # is (G - 1) / v of a group's per-microbatch work); every chunk boundary's transfer once
        # each way (v times 1F1B's).
        t_pipe = ((sum(w) - max(w)) / v + max(w) + sum(cf) + sum(cb)
                  + (M - 1) * max(max(w), max(duplex, default=0.0)))
    # The emitted order as a discrete-event schedule (links are not queued there: the closed
    # form keeps its link-load bound): 1F1B's steady state waits for the round trip of its
    # sends, which the closed form above hides behind compute.
    times = schedule_times(schedule, G, v, M, f, b, transfers)
    plain = max((end for _, end in times.values()), default=0.0)
    # Each stage reduces the gradients it accumulated unreduced right after its last forward
    # or backward (the emitted step runs its reduction program there): its group is busy with
    # it before the group's later programs, the drain after it hides what it can.
    r = [work[k]["r"] for k in range(S)]
    reduced = [0.0] * S  # when each stage's reduction ends
    if any(r):
        times = schedule_times(schedule, G, v, M, f, b, transfers, tails=r)
        for (k, _, _), (_, end) in times.items():
            reduced[k] = max(reduced[k], end + r[k])
    makespan = max([plain, *reduced]) if any(r) else plain
    t_pipe = max(t_pipe, makespan)
    # Per-step transfers, hidden by the first microbatch's forward chain before their reader
    # (parameters) or the last one's backward chain after their sender (gradients).
    fill, drain = [0.0] * S, [0.0] * S
    for k in range(1, S):
        fill[k] = fill[k - 1] + f[k - 1] + transfers.get((k - 1, k), {}).get("fwd", 0.0)
        drain[k] = drain[k - 1] + b[k - 1] + transfers.get((k, k - 1), {}).get("bwd", 0.0)
    for (a, c), t in transfers.items():
        # The link itself is busy with the first microbatch's values (last one's gradients)
        # while the fill (drain) goes on: those wait behind the per-step values, which the
        # emitted step sends first (measured between shaped namespaces: a 2-stage GPT's first
        # forward waited for the tied embedding to cross before its activations did).
        # A sum reduced once per step is sent after its stage's reduction.
        wait = r[a] if t["after_reduction"] else 0.0
        t["exposed"] = (max(t["start"] - (fill[c] - t["fwd"]), 0.0)
                        + max(wait + t["end"] - (drain[a] - t["bwd"]), 0.0) + t["late"])
    t_step_transfers = sum(t["exposed"] for t in transfers.values())
    u_group = [0.0] * G
    for k in range(S):
        u_group[group[k]] += u[k]
    step = t_pipe + t_step_transfers + max(u_group)
    # The busiest group: its compute and collectives; the rest of the step is bubble.
    busy = [M * (work[k]["f"] + work[k]["b"]) + work[k]["u"] + work[k]["r"] for k in range(S)]
    busy_group = [0.0] * G
    compute_group = [0.0] * G
    for k in range(S):
        busy_group[group[k]] += busy[k]
        compute_group[group[k]] += work[k]["compute_step"](M)
    pages_group = [0.0] * G
    for k in range(S):
        pages_group[group[k]] += work[k]["pages_step"](M)
    kb = int(np.argmax(busy_group))
    compute = compute_group[kb]
    comm = busy_group[kb] - compute
    in_flight = schedule_in_flight(schedule, G, v, M)
    mems = [_stage_memory(s, stage_of, k, in_flight[k], M, boundary) for k, s in enumerate(stages)]
    if v > 1:  # a device holds every chunk of its group: their memory adds up
        per_group: list[dict] = [defaultdict(float) for _ in range(G)]
        for k, mem in enumerate(mems):
            for kind, nbytes in mem.items():
                per_group[group[k]][kind] += nbytes
        mems = [dict(per_group[group[k]]) for k in range(S)]
    stage_times, worst = [], None
    for k, s in enumerate(stages):
        mem = mems[k]
        cap = min(topology.devices[d].spec.memory for d in s.devices)
        st = StageTime(devices=tuple(s.devices), forward=f[k], backward=b[k], update=u[k],
                       reduction=r[k], reduction_exposed=max(reduced[k] - plain, 0.0),
                       compute=work[k]["compute_step"](M), comm=busy[k] - work[k]["compute_step"](M),
                       peak_memory=float(sum(mem.values())), memory_capacity=cap,
                       in_flight=in_flight[k], memory_breakdown=mem)
        stage_times.append(st)
        if worst is None or st.peak_memory / cap > worst.peak_memory / worst.memory_capacity:
            worst = st
    by_axis: dict[str, float] = {}
    sent: dict[str, float] = {}
    scopes: dict[str, str] = {}
    collectives = []
    for k, s in enumerate(stages):
        times, nbytes, colls = work[k]["comm_by_axis"](M)
        for axis, t in times.items():
            by_axis[f"s{k}/{axis}"] = t
            sent[f"s{k}/{axis}"] = nbytes.get(axis, 0.0)
            scopes[f"s{k}/{axis}"] = s.cost_model.topology.axis_scope(axis)
        collectives += [PredictedCollective(kind=kind, axes=tuple(f"s{k}/{a}" for a in axes),
                                            count=count, bytes=nb, time=secs)
                        for kind, axes, count, nb, secs in colls]
    total_peak = sum(d.spec.peak_flops for d in topology.devices)
    recs = tuple(Transfer(src=a, dst=c, link=t["class"], bandwidth=t["link"].bandwidth,
                          latency=t["link"].latency, microbatch_bytes=t["mb_bytes"],
                          step_bytes=t["step_bytes"], time=M * (t["fwd"] + t["bwd"]) + t["step"],
                          exposed=t["exposed"])
                 for (a, c), t in sorted(transfers.items()))
    return Cost(step_time=step, compute_time=compute, comm_time=comm,
                comm_time_by_axis=by_axis, comm_bytes=sent, link_class=scopes,
                collectives=tuple(collectives),
                peak_memory=worst.peak_memory, memory_breakdown=dict(worst.memory_breakdown),
                memory_capacity=worst.memory_capacity,
                ideal_time=graph.total_flops / total_peak if total_peak else 0.0,
                page_time=pages_group[kb], stages=tuple(stage_times), bubble=max(step - compute - comm, 0.0),
                transfers=recs, microbatches=M, schedule=schedule, virtual_stages=v)


def _stage_times(s: StageWork, unreduced: dict) -> dict:
    """``{"f", "b" (per microbatch), "u", "r" (per step), "compute_step", "comm_by_axis"}`` of a
    stage; ``r``: the reduction of the sums it leaves unreduced (``unreduced``, by
    :func:`~hulkjax.cost.unreduced.unreduced_sums`), whose all-reduces ``f`` and ``b`` no
    longer make per microbatch."""
    nc = node_costs(s.cost_model, s.assignment)
    cm = s.cost_model
    saved: dict[int, float] = defaultdict(float)  # node -> seconds of collectives deferred
    for un in unreduced.values():
        saved[un.node] += sum(cm.comm_time(nc.own[un.node][i]) for i in un.deferred)
    r = float(sum(cm.comm_time(un.reduction) for un in unreduced.values()))
    # A program per phase: each makes a shared layout change once, however many read it.
    f = float(sum(nc.time[n] - saved.get(n, 0.0) for n in s.forward)) \
        - shared_excess(nc, s.forward)
    b = float(sum(nc.time[n] - saved.get(n, 0.0) for n in s.backward)) \
        - shared_excess(nc, s.backward)
    u = float(sum(nc.time[n] for n in s.update)) - shared_excess(nc, s.update) + sum(
        nc.state_moves.get(i, 0.0) for i in s.inputs)
    # Each program call allocates its temporaries anew: on XLA:CPU those above glibc's mmap
    # threshold are fresh pages every call (CostModel.page_time; 0 elsewhere). A microbatch's
    # programs are smaller than the step's and often stay under it.
    pf, pb, pu = (_program_pages(s, nodes) for nodes in (s.forward, s.backward, s.update))
    f, b, u = f + pf, b + pb, u + pu
    cf = float(sum(nc.compute[n] for n in s.forward + s.backward)) + pf + pb
    cu = float(sum(nc.compute[n] for n in s.update)) + pu
    deferred = {(un.node, i) for un in unreduced.values() for i in un.deferred}

    def comm_by_axis(M: int) -> tuple[dict[str, float], dict[str, float], list]:
        """Seconds and bytes each device sends per step on each axis of the stage's mesh: its
        own collectives and layout changes, as ``f``, ``b``, ``u`` and ``r`` charge them (their
        sum over the axes is the stage's communication, ``busy - compute``); and those
        collectives per step, ``[(kind, axes, count, bytes, seconds)]`` by kind and axes, the
        reduction program's combined as the backend combines them."""
        b_ = node_costs(cm, s.assignment)  # its breakdown's collectives (memoized)
        per: dict[str, float] = defaultdict(float)
        sent: dict[str, float] = defaultdict(float)
        grouped: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
        mine_mb = set(s.forward) | set(s.backward)
        mine_u = set(s.update)
        # (the stage's nodes' collectives, in the whole's order: the same sums)
        position, moves_of = b_.by_node()
        mine = sorted((n for n in mine_mb | mine_u if n in position), key=position.__getitem__)
        order = cm.mesh.axis_names

        def add(comm, times, reduction=False):
            t, nbytes = _axis_charges(cm, comm)
            for axis, x in t.items():
                per[axis] += x * times
            for axis, x in nbytes.items():
                sent[axis] += x * times
            kind = cm.backend.kind_of(comm.kind)
            entry = grouped[(kind, tuple(sorted(comm.axes, key=order.index)), reduction)]
            entry[0] += times
            entry[1] += comm.bytes * times
            entry[2] += sum(t.values()) * times

        for nid in mine:
            times = M if nid in mine_mb else 1
            for i, c in enumerate(b_.own[nid]):
                if (nid, i) not in deferred:
                    add(c, times)
        for un in unreduced.values():
            add(un.reduction, 1, reduction=True)
        copies = {i for ph in (s.forward, s.backward, s.update) for *_, ix in _copies(b_, ph)
                  for i in ix}
        for i in sorted(i for n in mine_mb | mine_u for i in moves_of.get(n, ())):
            if i not in copies:
                add(b_.moves[i].comm, M if b_.moves[i].node in mine_mb else 1)
        # The state it holds brought back to its inputs' layout for the next step (``u``'s
        # ``state_moves``).
        at_end = moves_of.get(-1, ())
        if at_end:
            mine_in = set(s.inputs)
            held = {cm.graph.outputs[o] for i, o in cm.graph.carried.items() if i in mine_in}
            for i in at_end:
                if b_.moves[i].value in held:
                    add(b_.moves[i].comm, 1)
        merged: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
        for (kind, axes, reduction), (count, nbytes, secs) in grouped.items():
            if reduction and cm.backend.combines(kind):  # one program: combined into a few
                count = cm.combined_count(kind, nbytes)
            entry = merged[(kind, axes)]
            entry[0] += count
            entry[1] += nbytes
            entry[2] += secs
        return dict(per), dict(sent), [(k, a, *v) for (k, a), v in sorted(merged.items())]

    return {"f": f, "b": b, "u": u, "r": r, "compute_step": lambda M: M * cf + cu,
            "pages_step": lambda M: M * (pf + pb) + pu, "comm_by_axis": comm_by_axis}


def _program_pages(s: StageWork, nodes) -> float:
    """Seconds one call of the stage's program running ``nodes`` spends on fresh pages for its
    temporaries (:meth:`~hulkjax.cost.model.CostModel.page_time`; its arguments, the values
    other programs make, and its results are buffers of their own)."""
    cm = s.cost_model
    if not cm.fresh_page_time or not nodes:
        return 0.0
    report = liveness(cm, list(s.assignment), nodes=nodes, held=set(s.inputs),
                      received_as_arguments=True)
    return cm.page_time(report.temporaries)


def _axis_charges(cm: CostModel, comm) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds and bytes per device of ``comm`` on each axis of the stage's topology, as its
    backend runs it (:meth:`~hulkjax.cost.model.CostModel.comm_time_by_axis`: its algorithm, its
    reduce-scatter, a combined collective's share of the latency), memoized on the graph per
    topology (every layout costed asks for the same collectives again); the result
    is shared: read it, do not change it."""
    key = ("collective axis charges", cm.topology)  # (its backend is the topology's)
    memo = cm.graph.memo.get(key)
    if memo is None:
        memo = cm.graph.memo[key] = {}
    hit = memo.get(comm)
    if hit is None:
        hit = memo[comm] = (cm.comm_time_by_axis(comm), axis_bytes(
            cm.backend.kind_of(comm.kind), comm.bytes, comm.axes, cm.topology,
            hierarchical=cm.backend.hierarchical))
    return hit


def crossing_values(graph: OpGraph, place_of, phase_of, holder):
    """Every value a node reads that another place makes or holds: ``(value, source place,
    reading place, kind)``, once per reading node. ``place_of`` / ``phase_of``: a node id's place
    (a stage, a layer unit; ``None``: nowhere) and phase (``"F" | "B" | "U"``); ``holder``:
    ``{input index: place}`` of the state leaves. Kinds: per microbatch ``"fwd"`` (a forward
    value, read by a forward or a backward) and ``"bwd"`` (a backward value a backward reads);
    per step ``"start"`` (a state leaf read away from its holder: a tied embedding the LM head
    reads), ``"end"`` (a forward or backward value an update reads: that embedding's gradient)
    and ``"late"`` (a value an update makes). The batch comes from the host, constants are
    everywhere (an input ``holder`` does not place is not sent); where the source is ``None`` or
    the place itself, nothing crosses (not yielded)."""
    input_index = {v: i for i, v in enumerate(graph.inputs)}
    for n in graph.nodes:
        c = place_of(n.id)
        if c is None:
            continue
        for v in n.inputs:
            if v is None:
                continue
            p = graph.values[v].producer
            if p is None:
                i = input_index.get(v)
                if i is None or graph.input_roles[i] == DATA:
                    continue  # constants are everywhere; the batch comes from the host
                a, kind = holder.get(i), "start"
            else:
                a = place_of(p)
                pp, pc = phase_of(p), phase_of(n.id)
                kind = ("late" if pp == "U" else "end" if pc == "U"
                        else "bwd" if pp == "B" and pc == "B" else "fwd")
            if a is not None and a != c:
                yield v, a, c, kind


def _transfers(topology, stages, stage_of, phase_of, holder, M, unreduced=frozenset()) -> dict:
    """``{(src, dst): {"fwd", "bwd", "step", "start", "end", "late" seconds, bytes, link}}``
    (per microbatch for fwd / bwd; ``step`` = ``start`` (parameters read by another stage) +
    ``end`` (values a forward or backward sends to another stage's update) + ``late`` (values
    an update sends)); ``after_reduction``: an ``end`` value is a sum reduced once per step
    (in ``unreduced``), sent once its stage has reduced it."""
    g = stages[0].cost_model.graph
    per: dict[tuple[int, int], dict] = {}
    sent: set[tuple[int, int]] = set()

    def entry(a, c):
        e = per.get((a, c))
        if e is None:
            link = stage_link(topology, stages[a].devices, stages[c].devices)
            e = per[(a, c)] = {"fwd": 0.0, "bwd": 0.0, "step": 0.0, "mb_bytes": 0.0,
                               "step_bytes": 0.0, "link": link,
                               "class": link_class(topology, stages[a].devices,
                                                   stages[c].devices),
                               "_fb": 0.0, "_bb": 0.0, "_sb": 0.0, "_eb": 0.0,
                               "_lb": 0.0, "after_reduction": False}
        return e

    for v, a, c, kind in crossing_values(g, stage_of.get, phase_of.get, holder):
        if (v, c) in sent or stages[a].devices == stages[c].devices:
            continue  # (chunks of one group: the value stays on its devices)
        sent.add((v, c))
        nbytes = _transfer_bytes(g, v, stages[a], stages[c])
        e = entry(a, c)
        e["_" + {"fwd": "fb", "bwd": "bb", "start": "sb", "end": "eb", "late": "lb"}[kind]] \
            += nbytes
        if kind == "end" and v in unreduced:
            e["after_reduction"] = True
    for e in per.values():
        link = e["link"]
        for key, b in (("fwd", e["_fb"]), ("bwd", e["_bb"]), ("start", e["_sb"]),
                       ("end", e["_eb"]), ("late", e["_lb"])):
            e[key] = link.latency + b / link.bandwidth if b > 0 else 0.0
        e["mb_bytes"] = e["_fb"] + e["_bb"]
        e["step_bytes"] = e["_sb"] + e["_eb"] + e["_lb"]
        # The link's time per step (the record): the per-step values as one message.
        e["step"] = link.latency + e["step_bytes"] / link.bandwidth if e["step_bytes"] else 0.0
    return per


def _transfer_bytes(g: OpGraph, v: int, src: StageWork, dst: StageWork) -> float:
    """Bytes per receiving device: its shard of the destination layout, spread over senders."""
    return received_bytes(dst.cost_model, dst.assignment, v, len(src.devices))


def received_bytes(cm: CostModel, assignment, v: int, senders: int) -> float:
    """Bytes each device of a group (``cm``'s topology, laid out by ``assignment``) receives of
    value ``v`` from a group of ``senders`` devices: its shard of the value, spread over the
    senders where they are fewer than the receivers."""
    spec = node_costs(cm, assignment).specs.get(v)
    d_local = local_bytes(cm.graph, v, spec, cm.sizes)
    return max(d_local, d_local * cm.topology.num_devices / max(senders, 1))


def _stage_memory(s: StageWork, stage_of, k: int, in_flight: int, M: int, boundary) -> dict:
    """Stage ``k``'s peak bytes per device by kind: the liveness walk
    (:func:`~hulkjax.cost.memory.liveness`) over the operators it runs, with the parameters and
    optimizer state it holds and ``in_flight`` microbatches of data and saved activations, plus
    float32 accumulators for the boundary sums it makes when ``M > 1``."""
    cm = s.cost_model
    g = cm.graph
    key = ("stage_memory", id(cm), tuple(s.assignment), s.forward, s.backward, s.update, s.inputs,
           in_flight)
    hit = g.memo.get(key)
    if hit is not None and hit[0] is cm:
        mem = dict(hit[1])
    else:
        report = liveness(cm, list(s.assignment), nodes=(*s.forward, *s.backward, *s.update),
                          held=set(s.inputs), in_flight=in_flight)
        mem = {kind: b for kind, b in report.breakdown.items() if b}
        g.memo[key] = (cm, dict(mem))
    if M > 1:
        nc = node_costs(cm, s.assignment)
        acc = 0.0
        for v in boundary:
            p = g.values[v].producer
            if p is not None and stage_of.get(p) == k:
                spec = nc.specs.get(v)
                acc += 4.0 * local_bytes(g, v, spec, cm.sizes) / max(dtype_size(g.values[v].dtype), 1)
        if acc:
            mem["accumulators"] = acc
    return mem


def held_inputs(graph: OpGraph, home_stage: dict[int, int], k: int) -> tuple[int, ...]:
    """Argument leaves stage ``k`` holds: parameters and optimizer state homed on it."""
    return tuple(i for i, s in sorted(home_stage.items())
                 if s == k and graph.input_roles[i] in (PARAMETER, OPTIMIZER))


__all__ = ["NodeCosts", "StageWork", "crossing_values", "held_inputs", "local_bytes", "node_costs", "pipeline_cost",
           "received_bytes", "stage_link"]
