"""Loop rules: how a ``scan`` / ``while`` / ``cond`` node's operands and results map onto its bodies.

A table keyed by primitive, like the others: ``loop_rules[prim](node, graph) -> Boundary``. It says
which body input each operand is, which operands are stacked (``scan`` ``xs``), which body results
carry back into which operands, and where the node's results come from. It plans nothing: the
body planner (:mod:`hulkjax.strategies.loops`) reads boundaries to build loop candidates, and the
cost model receives that planner as an injected callable. The records a loop candidate is made
of (:class:`LoopResolution`, :class:`LoopBody`) live here too, so the cost model can read them
without knowing who made them.

**Boundary.** A layout hypothesis for a loop is one spec per operand ("slot"), in the body's
per-iteration shape. ``scan`` ``xs`` / ``ys`` get an unsharded leading (stacked) dimension. Carry-in
and carry-out share one layout. All branches of a ``cond`` take the same operand layouts and
return their results in one layout (that of its ``main`` branch, the one with most FLOPs). A
``while`` body and its condition share the carry layout.

>>> import jax, jax.numpy as jnp, hulkjax as hj
>>> g = hj.trace(lambda w, x: jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0].sum(),
...              jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
>>> b = boundary(g.nodes[0], g)
>>> b.kind, b.stacked, b.carries
('scan', (False, True), (((0, 0),),))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jax.extend.core import primitives as P

from hulkjax.plan.collectives import Comm
from hulkjax.plan.specs import Spec
from hulkjax.rules.sharding import Resolution, registrar
from hulkjax.trace.graph import Node, OpGraph


@dataclass(frozen=True)
class Boundary:
    """How a loop node's operands and results map onto its bodies' inputs and outputs.

    Attributes:
      slots: per operand, its per-iteration shape (``None``: a literal).  # tuple
      stacked: per operand, whether it is a ``scan`` ``xs`` (a leading stacked dimension).  # tuple
      fixed: per operand, whether it is always replicated (a ``cond``'s branch index).  # tuple
      inputs: per body, the operand each body input is.  # tuple of tuple of int
      carries: per body, ``(body output, operand)`` pairs that carry back.  # tuple
      results: per node result, ``("carry", operand)`` or ``("out", body output)``.  # tuple
      main: the body whose layouts hypotheses are built on (``cond``: most FLOPs).  # int
      kind: ``"scan" | "while" | "cond"``.  # str
    """

    slots: tuple[tuple[int, ...] | None, ...]
    stacked: tuple[bool, ...]
    fixed: tuple[bool, ...]
    inputs: tuple[tuple[int, ...], ...]
    carries: tuple[tuple[tuple[int, int], ...], ...]
    results: tuple[tuple[str, int], ...]
    main: int
    kind: str


@dataclass(frozen=True)
class LoopBody:
    """The plan of one body of a loop under one candidate.

    Attributes:
      graph: the body graph as planned (the tracer's sub-graph with loop roles and carries).
      cost_model: the body's cost model on the same topology.
      assignment: candidate per body group.  # tuple of int
      inputs: layout of each body input (the boundary).  # tuple of Spec
      outputs: layout each body result is constrained to on exit (``None``: left as produced).
    """

    graph: OpGraph = field(compare=False, repr=False)
    cost_model: Any = field(compare=False, repr=False)
    assignment: tuple[int, ...]
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec | None, ...]


@dataclass(frozen=True)
class LoopResolution(Resolution):
    """A candidate of a loop node: the loop's operand/result layouts plus its bodies' plans.

    Attributes (besides :class:`~hulkjax.rules.sharding.Resolution`'s; ``comms`` are the body's
    collectives, repeated ``trip_count`` times, as the cost charges them):
      compute: seconds of compute per step on the slowest device: ``trip_count`` x the body's.
      memory: per-device bytes the body keeps while it runs (the peak of its own liveness walk
        less its arguments, the loop's operands held outside it); what it stacks (``ys``) are
        outer values, costed by the outer model.
      program_comms: the collectives the compiled program should contain (a value brought to a
        layout once per iteration), repeated ``trip_count`` times.
      iteration_comms: those of one iteration (a ``cond``: of every branch).
      trips: how many times the body runs (``trip_count``; 1 for a ``cond``).
      bodies: one :class:`LoopBody` per sub-graph of the node (``node.subgraphs`` order).
    """

    compute: float = 0.0
    memory: float = 0.0
    program_comms: tuple[Comm, ...] = ()
    iteration_comms: tuple[Comm, ...] = ()
    trips: int = 1
    bodies: tuple[LoopBody, ...] = ()


LoopRule = Callable[[Node, OpGraph], Boundary]
loop_rules: dict[object, LoopRule] = {}

register_loop_rule = registrar(
    loop_rules, "Register a loop rule ``(node, graph) -> Boundary`` for control-flow primitives.")


def boundary(node: Node, graph: OpGraph) -> Boundary | None:
    """The boundary of a loop node, or ``None`` (not a loop, or no traced bodies)."""
    rule = loop_rules.get(node.primitive)
    if rule is None or not node.subgraphs:
        return None
    return rule(node, graph)


def is_loop(node: Node) -> bool:
    """Whether a node is a loop with a rule and traced bodies (a leader whose candidates are
    plans of its bodies)."""
    return bool(node.subgraphs) and node.primitive in loop_rules


def _shapes(node: Node, graph: OpGraph):
    return [None if v is None else graph.values[v].shape for v in node.inputs]


@register_loop_rule(P.scan_p)
def _scan_boundary(node: Node, graph: OpGraph) -> Boundary:
    shapes = _shapes(node, graph)
    n = len(node.inputs)
    nc, ncarry = node.params["num_consts"], node.params["num_carry"]
    stacked = tuple(k >= nc + ncarry for k in range(n))
    slots = tuple(None if s is None else (s[1:] if st else s) for s, st in zip(shapes, stacked))
    body = node.subgraphs[0]
    carries = tuple((i, nc + i) for i in range(ncarry))
    results = tuple(("carry", nc + i) if i < ncarry else ("out", i)
                    for i in range(len(node.outputs)))
    return Boundary(slots, stacked, (False,) * n, (tuple(range(len(body.inputs))),),
                    (carries,), results, 0, "scan")


@register_loop_rule(P.while_p)
def _while_boundary(node: Node, graph: OpGraph) -> Boundary:
    shapes = _shapes(node, graph)
    n = len(node.inputs)
    cc, bc = node.params["cond_nconsts"], node.params["body_nconsts"]
    m = n - cc - bc
    cond_in = tuple(range(cc)) + tuple(cc + bc + i for i in range(m))
    body_in = tuple(cc + j for j in range(bc)) + tuple(cc + bc + i for i in range(m))
    carries = tuple((i, cc + bc + i) for i in range(m))
    results = tuple(("carry", cc + bc + i) for i in range(len(node.outputs)))
    return Boundary(tuple(shapes), (False,) * n, (False,) * n, (cond_in, body_in),
                    ((), carries), results, 1, "while")


@register_loop_rule(P.cond_p)
def _cond_boundary(node: Node, graph: OpGraph) -> Boundary:
    shapes = _shapes(node, graph)
    n = len(node.inputs)  # operand 0 is the branch index
    ins = tuple(tuple(range(1, n)) for _ in node.subgraphs)
    main = max(range(len(node.subgraphs)), key=lambda b: (node.subgraphs[b].total_flops, -b))
    results = tuple(("out", i) for i in range(len(node.outputs)))
    return Boundary(tuple(shapes), (False,) * n, (True,) + (False,) * (n - 1), ins,
                    tuple(() for _ in node.subgraphs), results, main, "cond")
