"""What the tracer inlines, shared by the graph builder and the interpreter.

Both walk a jaxpr depth first and descend into the bodies returned by :func:`inlined_body`; every
other equation is one graph node. Keeping this decision in one place is what makes node ids line up
between the graph a plan was made on and the program the emitter runs.

This module (with the rest of ``hulkjax/trace``) is the only place that reads jaxpr internals.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.extend.core import primitives as P

from hulkjax.trace.primitives import INLINED_BODIES


def in_host_memory(aval) -> bool:
    """Whether a value of this aval lives in host memory (its memory space is ``Host``)."""
    return getattr(getattr(aval, "memory_space", None), "name", None) == "Host"


def struct_of(aval, shape=None) -> jax.ShapeDtypeStruct:
    """An abstract argument that traces to ``aval`` (of ``shape``, if given): its dtype, weak
    type and memory space (a value in host memory is given a host-memory sharding: a step that
    keeps state there traces to the same program)."""
    return jax.ShapeDtypeStruct(tuple(aval.shape) if shape is None else tuple(shape), aval.dtype,
                                weak_type=getattr(aval, "weak_type", False),
                                sharding=_host_sharding() if in_host_memory(aval) else None)


@functools.cache
def _host_sharding():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("host",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(),
                                      memory_kind="pinned_host")


def inlined_body(eqn) -> tuple[Any, tuple] | None:
    """``(jaxpr, consts)`` of an equation the tracer inlines, else ``None``."""
    key = INLINED_BODIES.get(eqn.primitive)
    if key is None:
        return None
    body = eqn.params[key]
    if isinstance(body, jex_core.ClosedJaxpr):
        return body.jaxpr, tuple(body.consts)
    return body, ()


def sub_jaxprs(eqn) -> list[tuple[str, Any, tuple]]:
    """``(role, jaxpr, consts)`` of the bodies of a control-flow equation."""
    out = []
    if eqn.primitive is P.scan_p:
        out.append(("body", eqn.params["jaxpr"].jaxpr, tuple(eqn.params["jaxpr"].consts)))
    elif eqn.primitive is P.while_p:
        for role in ("cond", "body"):
            cj = eqn.params[f"{role}_jaxpr"]
            out.append((role, cj.jaxpr, tuple(cj.consts)))
    elif eqn.primitive is P.cond_p:
        for i, cj in enumerate(eqn.params["branches"]):
            out.append((f"branch{i}", cj.jaxpr, tuple(cj.consts)))
    return out


_node_counts: dict[int, tuple[Any, int]] = {}


def count_nodes(jaxpr) -> int:
    """Number of graph nodes a jaxpr becomes after inlining."""
    hit = _node_counts.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    n = 0
    for eqn in jaxpr.eqns:
        body = inlined_body(eqn)
        n += 1 if body is None else count_nodes(body[0])
    _node_counts[id(jaxpr)] = (jaxpr, n)
    return n
