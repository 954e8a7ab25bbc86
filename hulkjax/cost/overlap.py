"""Collectives overlapped with compute, as XLA's latency-hiding scheduler overlaps them.

:meth:`~hulkjax.cost.CostModel.evaluate` adds compute and communication: ``Cost.step_time`` is
their sum, the objective every planner minimizes (additive, so the ILP is exact), and an upper
bound on a step whose collectives run while independent compute does. This module is the
refinement, computed on request (:func:`overlap`, ``CostModel.overlapped``), never inside
``evaluate``: the step's program as XLA compiles it, scheduled on a compute stream and
collective streams, and its makespan.

**What it follows in XLA.**

* ``xla/service/latency_hiding_scheduler.cc`` (``DefaultSchedulerCore``, ``AsyncTracker``): a
  collective is an async start/done pair; the scheduler places the start as early and the done
  as late as the dependencies allow (``IsSupportedAsyncStart`` / ``Done``), so the collective
  runs while compute that is neither an ancestor of its operands nor a descendant of its result
  does. Each start occupies a *resource* until its done; at most ``GetNumAvailableResources``
  of a resource are in flight. The generic tracker gives every kind its own resource
  (``kAllGather``, ``kAllReduce``, ``kReduceScatter``, ``kAllToAll``, ``kCollectivePermute``),
  each limited to 1 by ``SchedulerConfig``'s ``*_overlap_limit`` defaults: the ``"tpu"``
  backend is modelled so (the TPU scheduler itself is not public).
* ``xla/service/gpu/gpu_latency_hiding_scheduler.cc`` (``GpuAsyncTracker``): on GPU every
  collective takes the one resource ``kGpuAsyncStreamCollectives``, whose limit is
  ``xla_gpu_experimental_parallel_collective_overlap_limit``, default 1
  (``xla/debug_options_flags.cc``): one collective in flight at a time, of any kind.
* XLA:CPU runs no latency-hiding scheduler: its collectives are synchronous, in line with
  compute (the ``"cpu"`` backend overlaps nothing).
* The scheduler works per computation: a ``while``'s body is scheduled on its own, and the loop
  is one instruction of its caller.

Which resource a kind takes per backend is ``Backend.async_collectives``
(:mod:`hulkjax.cost.backends`).

**The model.** The program is :meth:`~hulkjax.cost.CostModel.combined_program`: the graph's
operators and the collectives as XLA's combiners leave them (a combined collective reads all
its members' operands and feeds all their users), with who reads whom. A list schedule runs it:

* the compute stream runs operators one at a time, each for its roofline time (what
  :meth:`~hulkjax.cost.CostModel.breakdown` charges it); a synchronous collective runs on it too.
  An operator XLA fuses into the kernel that reads it (elementwise and shape operators, iotas, a
  transpose a matmul takes) runs inside that reader, not on its own (:func:`_fold_fused`);
* each collective resource runs one asynchronous collective at a time, for the seconds the cost
  model charges its members (:meth:`~hulkjax.cost.CostModel.comm_time`, summed over the
  combined collective's members). Collectives in flight on different resources at once (TPU: an
  all-gather during a reduce-scatter) share the network: each progresses at 1/k of its pace
  with k in flight, so communication never takes less than its total;
* an instruction starts when every operand has finished; whenever a stream is free it starts,
  among the instructions ready for it, the first in XLA's post-order
  (``MakeInstructionPostOrder``, the order the scheduler starts from);
* a loop is one operator of its caller, running ``trip_count`` times its body's own schedule
  (a ``cond``: its slowest branch), with its body's collectives (and its results' layout
  changes on exit) scheduled inside.

Copies between device and host memory (a step's offloaded activations, out and back, on a
backend that offloads: :attr:`~hulkjax.cost.backends.Backend.host_offload`) are asynchronous too
(XLA's ``host_memory_transfer_asyncifier``): they run one at a time on the host link, beside
compute and collectives, and the compute stream waits only where a reader needs one not yet
done.

The step time is the makespan. The compute stream idles only while it waits for a collective
(or a host copy), so ``step_time = compute_time + exposed_comm_time +
exposed_host_copy_time``, and a collective's *hidden* seconds are
those it runs while compute runs. A collective on the critical path (a combined gradient
all-reduce that every gradient feeds and every update reads) stays exposed; one that
independent compute can cover (an FSDP all-gather of layer k+1's weights during layer k, a
per-layer gradient reduction during the backward of earlier layers) is hidden. With no
collective, ``step_time == compute_time``.

**Against the additive cost.** ``compute_time + comm_time <= Cost.step_time``, so
``max(compute_time, comm_time) <= step_time <= Cost.step_time``. ``comm_time`` is the compiled
program's: a layout change of one value that several operators read is made once (XLA's
partitioner keeps one reshard per instruction and sharding), as ``Cost.comm_time`` charges it
(:meth:`~hulkjax.cost.CostModel.shared_time`); ``reused_comm_time`` is what the cost still
charges beyond the program: a change inside a group that another group's operator also needs,
or a direct change to a layout that another reader's two-step path passes through.

Limits: the schedule is greedy, in post-order priority, not the scheduler's own cost-driven
bottom-up choices, and ignores its memory-pressure limits (it may start a gather earlier than
XLA would to stay under memory); collectives of a loop body do not overlap with compute outside
the loop, nor with the body's next iteration (XLA's collective pipeliner moves some there);
collectives on different mesh axes share the network as if they crossed the same links; a
collective over a loop's results that the caller's combiner merges in is priced as the cost
model prices it (for a deferred collective: its share of the combined latency).

>>> import jax.numpy as jnp, hulkjax as hj
>>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)))
>>> from hulkjax.cost import CostModel
>>> cm = CostModel(g, hj.Topology.grid((8,), ("d",)))
>>> o = overlap(cm, cm.replicated_assignment())
>>> o.step_time == o.compute_time, o.collectives
(True, ())
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from hulkjax.cost.backends import BACKENDS, Backend
from hulkjax.errors import InvalidPlanError
from hulkjax.rules.loops import LoopResolution, boundary
from hulkjax.trace.primitives import FUSIBLE, handles

_COMPUTE = None  # the compute stream's key in the schedule
_HOST = "host copies"  # the copies between device and host memory: DMA engines of their own


@dataclass(frozen=True, kw_only=True)
class ScheduledCollective:
    """One collective of the compiled program (after combining) and how much of it is hidden.

    Attributes:
      kind: what the backend runs (``"all-reduce"``, ``"all-gather"``, ...).  # str
      axes: mesh axes, in mesh order.  # tuple of str
      bytes: per-device bytes (summed over the collectives combined into it).  # int
      count: how many of the program's collectives were combined into it.  # int
      seconds: its time per execution, as the cost model prices its members.  # float
      hidden_seconds: of ``seconds``, those it runs while the compute stream computes.  # float
      start: when it starts, seconds from the start of its computation (the step, or one
        iteration of its loop's body).  # float
      trips: how many times it runs per step (a loop body's: the loop's trip count).  # int
      loop: the step graph's loop node whose body it is in (``None``: the step's own).
      asynchronous: whether the backend runs it as a start/done pair (else in line with
        compute, never hidden).  # bool
    """

    kind: str
    axes: tuple[str, ...]
    bytes: int
    count: int
    seconds: float
    hidden_seconds: float
    start: float
    trips: int = 1
    loop: int | None = None
    asynchronous: bool = True

    @property
    def exposed_seconds(self) -> float:
        """``seconds - hidden_seconds``: what it adds to the step per execution."""
        return max(0.0, self.seconds - self.hidden_seconds)

    @property
    def hidden(self) -> bool:
        """Whether all of it runs under compute (to a millionth of its time)."""
        return self.exposed_seconds <= 1e-6 * self.seconds


@dataclass(frozen=True, kw_only=True)
class Overlap:
    """A step's time with its collectives overlapped with compute (see the module docstring).

    Attributes:
      step_time: the makespan of the schedule, seconds (``compute_time + exposed_comm_time +
        exposed_host_copy_time``).  # float
      compute_time: operators' roofline time (loop bodies x trip count), host copies
        apart.  # float
      comm_time: every collective of the compiled program, each once, seconds.  # float
      exposed_comm_time: collective time the compute stream waits for.  # float
      hidden_comm_time: ``comm_time - exposed_comm_time``: run under compute.  # float
      additive_time: the cost model's ``Cost.step_time`` (compute + comm, no overlap).  # float
      reused_comm_time: what ``Cost.comm_time`` charges beyond ``comm_time`` for layout
        changes: one the cost prices twice that the program makes once (see above; ``>= 0`` up
        to rounding).  # float
      reassociated_comm_time: what ``Cost.comm_time`` charges for all-reduces the backend
        merges into another, of a sum of partial sums (XLA:GPU's ``AllReduceReassociate``,
        ``CostModel._reassociated``), which the program does not make: the merges the
        objective does not price itself (``CostModel.sum_sites`` prices those two groups'
        layouts decide; a chain's later adds depend on three); 0 where the backend does not
        reassociate.  # float
      collectives: every collective, in the order the schedule starts them (loop bodies' after
        the step's, per loop).  # tuple of ScheduledCollective
      backend: the backend whose combiners and async resources were modelled.  # str
      host_copy_time: the copies between device and host memory (offloaded activations out,
        and back where the backward pass reads them; :attr:`Backend.host_offload`), which the
        additive cost counts as their ``device_put``'s compute: here they run asynchronously on
        the host link, beside compute and collectives (loop bodies x trip count).  # float
      exposed_host_copy_time: of ``host_copy_time``, what the compute stream waits for
        (``step_time = compute_time + exposed_comm_time + exposed_host_copy_time``).  # float
    """

    step_time: float
    compute_time: float
    comm_time: float
    exposed_comm_time: float
    hidden_comm_time: float
    additive_time: float
    reused_comm_time: float
    collectives: tuple[ScheduledCollective, ...]
    backend: str
    reassociated_comm_time: float = 0.0
    host_copy_time: float = 0.0
    exposed_host_copy_time: float = 0.0

    @property
    def hidden(self) -> tuple[ScheduledCollective, ...]:
        """The collectives that run entirely under compute."""
        return tuple(c for c in self.collectives if c.hidden)

    @property
    def exposed(self) -> tuple[ScheduledCollective, ...]:
        """The collectives the step waits for, at least in part."""
        return tuple(c for c in self.collectives if not c.hidden)

    def __str__(self) -> str:
        host = (f"; host copies {self.host_copy_time * 1e3:.4g} ms of which "
                f"{(self.host_copy_time - self.exposed_host_copy_time) * 1e3:.4g} ms hidden"
                if self.host_copy_time else "")
        return (f"step {self.step_time * 1e3:.4g} ms with overlap (additive "
                f"{self.additive_time * 1e3:.4g} ms): compute {self.compute_time * 1e3:.4g} ms, "
                f"comm {self.comm_time * 1e3:.4g} ms of which {self.hidden_comm_time * 1e3:.4g} "
                f"ms hidden; {len(self.hidden)} of {len(self.collectives)} collectives hidden"
                f"{host}")


def overlap(cost_model, assignment, backend: str | Backend | None = None, *,
            exits=None) -> Overlap:
    """The step time of ``assignment`` with collectives overlapped with compute as XLA's
    latency-hiding scheduler overlaps them on ``backend`` (a name or a :class:`Backend`;
    default: the topology's), and which collectives are hidden (see the module docstring).
    The backend decides combining and which collectives run asynchronously; times are the
    cost model's. ``exits``: a loop body's result layouts on exit (as
    :meth:`~hulkjax.cost.CostModel.program_summary` takes them). Staged plans have their own
    overlap (:mod:`hulkjax.cost.pipeline`); this is one SPMD program's.

    >>> import jax, jax.numpy as jnp, hulkjax as hj
    >>> def step(ws, x):
    ...     loss = lambda ws: sum(jnp.sum(jnp.tanh(x @ w)) for w in ws)
    ...     return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]
    >>> p = hj.plan(step, [jnp.ones((8, 8))] * 3, jnp.ones((16, 8)),
    ...             topology=hj.Topology.grid((8,), ("d",)), strategy="dp")
    >>> cm = hj.strategies.plan_cost_model(p.graph, p.topology, p)
    >>> o = overlap(cm, p.assignment, "gpu")
    >>> [(c.kind, c.count, c.hidden) for c in o.collectives]  # one all-reduce every update reads
    [('all-reduce', 3, False)]
    >>> round(o.exposed_comm_time / o.comm_time, 9)  # nothing left to hide it under
    1.0
    """
    be = cost_model.backend if backend is None else (
        BACKENDS[backend] if isinstance(backend, str) else backend)
    return _overlap(cost_model, list(assignment), be, exits, None)


def _overlap(cm, assignment, be: Backend, exits, loop: int | None) -> Overlap:
    g = cm.graph
    prog = cm.combined_program(assignment, be, exits=exits)
    n, groups = prog.nodes, prog.collectives
    m = len(prog.operands)
    bd = cm.breakdown(assignment, memory=False)
    dur = [0.0] * m
    stream: list[object] = [_COMPUTE] * m
    compute = exposed_inline = comm = host = host_inline = 0.0
    merged = sum(cm.comm_time(c) for c in prog.reassociated)  # charged, not in the program
    inner: list[ScheduledCollective] = []
    copies = cm.host_copies if be.host_offload else {}
    for nid in range(n):
        r = _loop_resolution(cm, assignment, nid)
        if r is None:
            dur[nid] = bd.compute[nid]
            if nid in copies:  # asynchronous, on the host link
                stream[nid] = _HOST
                host += dur[nid]
            else:
                compute += dur[nid]
            continue
        bodies = [_overlap(b.cost_model, list(b.assignment), be, b.outputs,
                           nid if loop is None else loop) for b in r.bodies]
        node = g.nodes[nid]
        b = boundary(node, g)
        if b is not None and b.kind == "cond":  # one branch runs: the slowest
            bodies = [max(bodies, key=lambda o: o.step_time)] if bodies else []
        trips = r.trips
        dur[nid] = sum(_pipelined(o, trips) for o in bodies)
        compute += trips * sum(o.compute_time for o in bodies)
        comm += trips * sum(o.comm_time for o in bodies)
        exposed_inline += trips * sum(o.exposed_comm_time for o in bodies)
        host += trips * sum(o.host_copy_time for o in bodies)
        host_inline += sum(_pipelined(o, trips) - trips * (o.step_time - o.exposed_host_copy_time)
                           for o in bodies)
        merged += trips * sum(o.reassociated_comm_time for o in bodies)
        for o in bodies:
            inner.extend(_repeat(c, trips, nid if loop is None else loop) for c in o.collectives)
    for j, grp in enumerate(groups):
        x = n + j
        dur[x] = sum(cm.comm_time(prog.entries[i].comm) for i in grp.members)
        comm += dur[x]
        res = be.async_collectives.get(grp.kind)
        if res is None:
            exposed_inline += dur[x]  # synchronous: the compute stream runs it
        else:
            stream[x] = res
    prio = [0] * m
    for pos, x in enumerate(prog.order):
        prio[x] = pos
    _fold_fused(g, n, dur, prog.operands, prio, stream)
    start, hidden, makespan = _schedule(dur, stream, prog.operands, prio)
    busy = sum(d for d, s in zip(dur, stream) if s is _COMPUTE)
    # The compute stream's idle time is waiting for a collective or a host copy: a copy's part
    # is what of it ran with compute idle (at most all the idle time).
    idle = makespan - busy
    waited = min(idle, sum(max(0.0, d - hidden[x]) for x, (d, st) in enumerate(zip(dur, stream))
                           if st == _HOST))
    exposed = (idle - waited) + exposed_inline
    own = [ScheduledCollective(kind=grp.kind, axes=grp.axes, bytes=grp.bytes,
                               count=len(grp.members), seconds=dur[n + j],
                               hidden_seconds=min(hidden[n + j], dur[n + j]),
                               start=start[n + j], loop=loop,
                               asynchronous=stream[n + j] is not _COMPUTE)
           for j, grp in enumerate(groups)]
    own.sort(key=lambda c: c.start)
    additive = cm.objective(assignment)
    # A loop body: its results' layout changes on exit, which the loop charges.
    additive += sum(cm.comm_time(e.comm) for e in prog.entries[len(prog.entries) - prog.exits:])
    return Overlap(step_time=makespan, compute_time=compute, comm_time=comm,
                   exposed_comm_time=exposed, hidden_comm_time=max(0.0, comm - exposed),
                   additive_time=additive,
                   reused_comm_time=additive - compute - host - comm - merged,
                   collectives=tuple(own + inner), backend=be.name,
                   reassociated_comm_time=merged, host_copy_time=host,
                   exposed_host_copy_time=waited + host_inline)


_TRANSPOSE = handles("transpose")
_DOT = handles("dot_general")
_FOLDED = (FUSIBLE - _TRANSPOSE) | handles("iota")
"""Operators XLA:GPU and TPU compile into the kernel that reads them (loop and input fusion of
elementwise and shape operators: an iota, a mask's comparisons, a cast). They run when that
kernel runs, not on their own. A transpose folds only into matmuls (:func:`_folds`)."""


_EXPENSIVE = handles("exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "sqrt", "rsqrt",
                     "cbrt", "pow", "div", "rem", "atan2", "erf", "erfc", "erf_inv", "lgamma",
                     "digamma", "sin", "cos", "tan")
"""Operators XLA does not duplicate into several readers' fusions (``IsExpensive`` in
``xla/service/instruction_fusion.cc``: transcendentals, divisions): with several readers the
result is written once, by a kernel of its own."""


def _folds(g, node, readers: list[int]) -> bool:
    """Whether ``node`` runs inside its readers' kernels: a fusible operator, or a transpose of
    a matrix (or of its two minor dimensions) that only matmuls read (XLA's transpose folding:
    the matmul takes the operand transposed). A transpose that moves a batch dimension (an
    attention's heads) stays a kernel of its own (``input_transpose_fusion`` in XLA:GPU's
    programs)."""
    if node.primitive in _FOLDED:
        return True
    if node.primitive not in _TRANSPOSE:
        return False
    perm = tuple(node.params.get("permutation", ()))
    minor = len(perm) <= 2 or perm[:-2] == tuple(range(len(perm) - 2))
    return minor and all(g.nodes[r].primitive in _DOT for r in readers)


def _fold_fused(g, n: int, dur: list[float], operands: list[list[int]], prio: list[int],
                stream: list) -> None:
    """Move each fusible operator's time to the kernel that reads it (with several readers,
    the first in post-order: XLA duplicates a cheap operator into each reader's fusion).

    The compiled program has no kernel of its own for an operator fused into its reader: a
    causal mask's iota and comparisons run inside the attention softmax, a weight's transpose
    inside the matmul. Scheduled on their own, they run as soon as their operands are ready,
    and a collective before the reader seems to run during them (the forward tensor-parallel
    all-reduces of a step, hidden under its masks and weight transposes; XLA:GPU schedules
    almost none of them over compute, ``benchmarks/GPU_SHARDED.md``). Folded, that time runs with its
    reader, after whatever the reader waits for. An expensive operator with several readers
    (a tanh the backward reads again, :data:`_EXPENSIVE`), an operator a collective or a copy
    to host memory reads, or one nothing reads (the step's results) keeps its time: XLA writes
    it out. Operators are visited in graph order, so a chain of them folds into the last one's
    reader. Total compute is unchanged."""
    readers: list[list[int]] = [[] for _ in range(n)]
    for x, ops in enumerate(operands):
        for o in set(ops):
            if o < n:
                readers[o].append(x)  # collectives too: a value a collective reads is written
    for x in range(n):
        node = g.nodes[x]
        rs = readers[x]
        if dur[x] <= 0 or node.subgraphs or not rs or any(
                r >= n or stream[r] == _HOST for r in rs) or stream[x] == _HOST:
            continue
        if not _folds(g, node, rs) or (len(rs) > 1 and node.primitive in _EXPENSIVE):
            continue
        first = min(rs, key=lambda r: prio[r])
        dur[first] += dur[x]
        dur[x] = 0.0


def _loop_resolution(cm, assignment, nid: int) -> LoopResolution | None:
    gid = cm.group_of_node[nid]
    grp = cm.groups[gid]
    if grp.leader != nid:
        return None
    r = grp.candidates[assignment[gid]]
    return r if isinstance(r, LoopResolution) else None


def _pipelined(body: Overlap, trips: int) -> float:
    """Seconds ``trips`` iterations of a loop body take, its host copies pipelined across
    iterations: the first iteration as its own schedule has it, each further one the longer of
    its schedule without waiting for host copies and its host copies (the host link copies the
    next iteration's values while this one computes). Without host copies: ``trips`` times the
    body's schedule.

    XLA's schedulers overlap a loop's host transfers with the compute of other iterations:
    MaxText runs its offloading TPU recipes with many host transfers in flight
    (``xla_tpu_host_transfer_overlap_limit=24`` among its ``HOST_OFFLOAD_FLAGS``), and its
    Llama 3.1 8B recipe on v6e moves about 60 GB per chip per step to and from host memory
    (each layer's input and its query, key, value and output projections, 4 x 8192 tokens per
    chip) in a step of about 4.5 s at its published 45.5% MFU: at the host link's 15 GB/s the
    copies take nearly the whole step, which only copies that run across layer boundaries
    allow."""
    if trips <= 1 or not body.host_copy_time:
        return trips * body.step_time
    computing = body.step_time - body.exposed_host_copy_time
    return body.step_time + (trips - 1) * max(computing, body.host_copy_time)


def _repeat(c: ScheduledCollective, trips: int, loop: int) -> ScheduledCollective:
    return ScheduledCollective(kind=c.kind, axes=c.axes, bytes=c.bytes, count=c.count,
                               seconds=c.seconds, hidden_seconds=c.hidden_seconds, start=c.start,
                               trips=c.trips * trips, loop=loop, asynchronous=c.asynchronous)


def _schedule(dur: list[float], stream: list, operands: list[list[int]], prio: list[int]
              ) -> tuple[list[float], list[float], float]:
    """A list schedule: ``(start per instruction, seconds each ran under compute, makespan)``.

    ``stream[x]``: ``None`` for the compute stream (one instruction at a time), else the
    resource of an asynchronous collective (one in flight per resource; those in flight at once
    share the network equally) or :data:`_HOST`, the copies between device and host memory (one
    at a time, on the host link: they do not share the network). A free stream starts its
    ready instruction of least ``prio``."""
    m = len(dur)
    users: list[list[int]] = [[] for _ in range(m)]
    waiting = [0] * m
    for x, ops in enumerate(operands):
        for o in set(ops):
            users[o].append(x)
        waiting[x] = len(set(ops))
    ready: dict[object, list] = {_COMPUTE: []}
    for x in range(m):
        ready.setdefault(stream[x], [])
        if not waiting[x]:
            heapq.heappush(ready[stream[x]], (prio[x], x))
    start = [0.0] * m
    hidden = [0.0] * m
    t = 0.0
    running: tuple[int, float] | None = None  # compute stream: (instruction, end)
    flight: dict[object, list] = {}  # resource -> [instruction, work left]
    done = 0

    def finish(x: int) -> None:
        nonlocal done
        done += 1
        for u in users[x]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready[stream[u]], (prio[u], u))

    while True:
        started = True
        while started:  # zero-time instructions finish at once and may ready others
            started = False
            while running is None and ready[_COMPUTE]:
                _, x = heapq.heappop(ready[_COMPUTE])
                start[x] = t
                started = True
                if dur[x] > 0:
                    running = (x, t + dur[x])
                else:
                    finish(x)
            for res, heap in ready.items():
                while res is not _COMPUTE and res not in flight and heap:
                    _, x = heapq.heappop(heap)
                    start[x] = t
                    started = True
                    if dur[x] > 0:
                        flight[res] = [x, dur[x]]
                    else:
                        finish(x)
        if running is None and not flight:
            break
        # Collectives in flight share the network; host copies run on the host link, apart.
        k = sum(1 for res in flight if res != _HOST) or 1
        pace = {res: 1 if res == _HOST else k for res in flight}
        ends = [w * pace[res] for res, (_, w) in flight.items()]
        if running is not None:
            ends.append(running[1] - t)
        dt = max(min(ends), 0.0)
        for res in list(flight):
            x, w = flight[res]
            kk = pace[res]
            if running is not None:
                hidden[x] += min(w, dt / kk)
            if w * kk <= dt * (1 + 1e-12):
                del flight[res]
                finish(x)
            else:
                flight[res][1] = w - dt / kk
        t += dt
        if running is not None and running[1] - t <= 1e-12 * max(t, 1e-300):
            x = running[0]
            running = None
            finish(x)
    if done != m:
        raise InvalidPlanError(
            f"the program of this plan has a dependency cycle: {m - done} of its {m} "
            f"instructions never become ready. This is a hulkjax bug; please report it with the "
            f"plan.")
    return start, hidden, t
