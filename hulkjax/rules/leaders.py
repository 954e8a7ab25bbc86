"""Which operators are leaders, and their candidates: the candidate table, or the loop planner.

A leader is an operator with choices of its own: a primitive in the candidate table (matmuls,
convolutions, embedding gathers and scatters) or a loop with traced bodies. A loop's candidates are
plans of its bodies, which takes a planner: the cost model receives one as a callable
(:data:`LoopPlanner`) from the layer that owns planning (:mod:`hulkjax.strategies.loops`), and
without one a loop has its replicated candidate only.

>>> import jax.numpy as jnp, hulkjax as hj
>>> from hulkjax.rules.sharding import Mesh
>>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4)))
>>> [r.label for r in leader_candidates(g.nodes[0], g, Mesh(("d",), (2,)))][:3]
['replicated', 'd:L', 'd:R']
"""

from __future__ import annotations

from collections.abc import Callable

from hulkjax.rules.loops import is_loop
from hulkjax.rules.sharding import Mesh, Resolution, candidate_rules, replicated_resolution
from hulkjax.trace.graph import Node, OpGraph

LoopPlanner = Callable[[Node, OpGraph, Mesh], list[Resolution]]
"""``(loop node, graph, mesh) -> candidates`` (``LoopResolution`` s, the replicated body first)."""


def is_leader(node: Node) -> bool:
    """Whether an operator has candidates of its own (loops: when their bodies were traced)."""
    return node.primitive in candidate_rules or is_loop(node)


def leader_candidates(node: Node, graph: OpGraph, mesh: Mesh,
                      loop_planner: LoopPlanner | None = None) -> list[Resolution]:
    """Candidates of a leader, the replicated one first.

    Loops get theirs from ``loop_planner`` (without one: the replicated candidate alone).
    """
    if is_loop(node):
        if loop_planner is not None:
            cands = loop_planner(node, graph, mesh)
            if cands:
                return cands
        return [replicated_resolution(node, graph)]
    rule = candidate_rules.get(node.primitive)
    cands = [] if rule is None else rule(node, graph, mesh)
    rep = replicated_resolution(node, graph)
    cands = [c for c in cands if c != rep]
    cands.insert(0, rep)
    return cands
