"""Run a traced step again, with a hook on every graph node's operands and results.

The emitter uses this to place ``with_sharding_constraint`` on planned values. The walk inlines the
same equations, in the same order, as the graph builder (see :mod:`hulkjax.trace.walk`), so the
``node_id`` passed to the hook is the id of the node in the :class:`OpGraph`. ``remat2`` bodies are
re-wrapped in ``jax.checkpoint`` so rematerialization survives. Loop bodies (``scan``, ``while``,
``cond``) run as they are, unless ``on_body`` gives hooks for them: then each hooked body is
interpreted with its own :class:`BodyHooks` (node ids of the body graph, ``node.subgraphs[i]``,
counted from 0), made into a jaxpr again, and the loop is bound with it.

>>> import jax, jax.numpy as jnp
>>> from hulkjax.trace.interpret import interpret
>>> cj = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3))
>>> seen = []
>>> out = interpret(cj, [jnp.ones(3)], on_result=lambda i, outs: seen.append(i) or outs)
>>> seen
[0, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import core as jex_core
from jax.extend.core import primitives as P

from hulkjax.trace.primitives import LOOPS
from hulkjax.trace.walk import count_nodes, inlined_body, struct_of

OperandHook = Callable[[int, int, Any], Any]  # (node id, operand index, value) -> value
ResultHook = Callable[[int, list], list]  # (node id, results) -> results
# (node id, primitive, operands, params) -> results, or None to bind the primitive as traced
BindHook = Callable[[int, Any, list, dict], "list | None"]


class BodyHooks(NamedTuple):
    """Hooks for one body of a loop node (all optional).

    on_input / on_output: ``(values) -> values`` on the body's arguments on entry and its results
    on exit. on_operand / on_result / on_body / on_bind: as :func:`interpret`'s, with the body
    graph's ids.
    """

    on_input: Callable[[list], list] | None = None
    on_output: Callable[[list], list] | None = None
    on_operand: OperandHook | None = None
    on_result: ResultHook | None = None
    on_body: Any = None
    on_bind: BindHook | None = None


BodyHook = Callable[[int], "Sequence[BodyHooks | None] | None"]  # node id -> hooks per body


def interpret(closed, args: Sequence[Any], *, on_operand: OperandHook | None = None,
              on_result: ResultHook | None = None, on_body: BodyHook | None = None,
              on_bind: BindHook | None = None) -> list:
    """Evaluate a ``ClosedJaxpr`` on flat arguments, calling the hooks at each graph node.

    ``on_body(node_id)`` may return, for a loop node, one :class:`BodyHooks` (or ``None``) per
    body in :func:`hulkjax.trace.walk.sub_jaxprs` order. ``on_bind`` may run a node itself (the
    emitter runs per shard what XLA's partitioner would gather): it returns the results, or
    ``None`` for the plain bind.
    """
    outs, _ = _run(closed.jaxpr, closed.consts, list(args), on_operand, on_result, 0, on_body,
                   on_bind)
    return outs


def _bind(eqn, nid: int, invals: list, on_body, on_bind, on_result) -> list:
    """Node ``nid``'s results: its loop bodies hooked (``on_body``), bound by ``on_bind`` or as
    traced, then ``on_result``. Shared by :func:`interpret` and :func:`evaluate`."""
    params = eqn.params
    if on_body is not None and eqn.primitive in LOOPS:
        hooks = on_body(nid)
        if hooks:
            params = _hooked_loop_params(eqn, hooks)
    outs = None if on_bind is None else on_bind(nid, eqn.primitive, invals, params)
    if outs is None:
        with eqn.ctx.manager:
            ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        outs = ans if eqn.primitive.multiple_results else [ans]
    outs = list(outs)
    return outs if on_result is None else on_result(nid, outs)


def _run(jaxpr, consts, args, on_operand, on_result, next_id: int, on_body=None, on_bind=None):
    env: dict[Any, Any] = {}

    def read(a):
        return a.val if isinstance(a, jex_core.Literal) else env[a]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        body = inlined_body(eqn)
        if body is not None:
            sub, sub_consts = body
            start = next_id
            if eqn.primitive is P.remat_p:
                def fn(*xs, _sub=sub, _consts=sub_consts, _start=start):
                    return _run(_sub, _consts, list(xs), on_operand, on_result, _start,
                                on_body, on_bind)[0]

                outs = jax.checkpoint(fn, prevent_cse=eqn.params.get("prevent_cse", True),
                                      policy=eqn.params.get("policy"))(*invals)
                next_id = start + count_nodes(sub)
            else:
                outs, next_id = _run(sub, sub_consts, invals, on_operand, on_result, start, on_body,
                                     on_bind)
        else:
            if on_operand is not None:
                invals = [x if isinstance(a, jex_core.Literal) else on_operand(next_id, k, x)
                          for k, (a, x) in enumerate(zip(eqn.invars, invals))]
            outs = _bind(eqn, next_id, invals, on_body, on_bind, on_result)
            next_id += 1
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(a) for a in jaxpr.outvars], next_id


def _hooked_loop_params(eqn, hooks: Sequence[BodyHooks | None]) -> dict:
    """The loop equation's parameters with each hooked body re-made through :func:`_run`."""
    params = dict(eqn.params)
    if eqn.primitive is P.scan_p:
        keys = ["jaxpr"]
    elif eqn.primitive is P.while_p:
        keys = ["cond_jaxpr", "body_jaxpr"]
    else:
        keys = [("branches", i) for i in range(len(eqn.params["branches"]))]
    branches = list(eqn.params.get("branches", ()))
    for key, h in zip(keys, hooks):
        if h is None:
            continue
        if isinstance(key, tuple):
            branches[key[1]] = _hooked_body(branches[key[1]], h)
        else:
            params[key] = _hooked_body(params[key], h)
    if branches:
        params["branches"] = tuple(branches)
    return params


def _hooked_body(closed, h: BodyHooks):
    """``closed`` (a ``ClosedJaxpr``) interpreted with ``h``, traced back into a ``ClosedJaxpr``
    with the same input and output types."""
    jaxpr = closed.jaxpr

    def body(*xs):
        xs = list(xs)
        if h.on_input is not None:
            xs = h.on_input(xs)
        outs, _ = _run(jaxpr, closed.consts, xs, h.on_operand, h.on_result, 0, h.on_body,
                       h.on_bind)
        if h.on_output is not None:
            outs = h.on_output(list(outs))
        # A literal result (a constant carry) comes back as an array of the result's type.
        return [_as_aval(x, v.aval) for x, v in zip(outs, jaxpr.outvars)]

    avals = [struct_of(v.aval) for v in jaxpr.invars]
    return jax.make_jaxpr(body)(*avals)


def _as_aval(x, aval):
    """A literal result (a Python or numpy scalar) as an array of the result's dtype."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or isinstance(x, jax.Array):
        return x
    return jax.numpy.asarray(x, dtype)


# ---- evaluating a subset of a graph's nodes (staged emission) ----------------------------------

class Equation(NamedTuple):
    """The equation behind one graph node, with the literal operands it receives.

    ``literals`` maps operand index to value: a literal written in the equation, or one passed to
    the inlined body the equation sits in (the graph records both as ``None`` operands).
    """

    eqn: Any
    literals: dict


def equations(closed) -> list[Equation]:
    """The equation behind every graph node of ``closed`` (a ``ClosedJaxpr``), by node id.

    Walks the jaxpr as the graph builder does (inlined bodies descended into), so
    ``equations(graph.jaxpr)[i]`` is the equation of ``graph.nodes[i]``: its primitive, its
    parameters, its literal operands and its context.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3))
    >>> [e.eqn.primitive.name for e in equations(cj)], float(equations(cj)[1].literals[1])
    (['sin', 'mul'], 2.0)
    """
    out: list[Equation] = []
    _walk_equations(closed.jaxpr, {}, out)
    return out


# (Module-level recursions, not closures: a nested function that calls itself is a reference
# cycle through its own cell, which keeps what it closes over, here the whole list of equations,
# alive until the cyclic collector runs.)
def _walk_equations(jaxpr, bound: dict, out: list) -> None:
    for eqn in jaxpr.eqns:
        lits = {}
        for k, a in enumerate(eqn.invars):
            if isinstance(a, jex_core.Literal):
                lits[k] = a.val
            elif a in bound:
                lits[k] = bound[a]
        body = inlined_body(eqn)
        if body is None:
            out.append(Equation(eqn, lits))
        else:
            _walk_equations(body[0], {iv: lits[k] for k, iv in enumerate(body[0].invars)
                                      if k in lits}, out)


def constant_values(closed) -> list:
    """Values of a graph's closed-over constants, in ``OpGraph.constants`` order: the jaxpr's own,
    then those of the bodies the graph builder inlined, in walk order.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> cj = jax.make_jaxpr(lambda x: x + np.arange(3.0))(jnp.ones(3))
    >>> [np.asarray(c).tolist() for c in constant_values(cj)]
    [[0.0, 1.0, 2.0]]
    """
    out = list(closed.consts)
    _walk_constants(closed.jaxpr, out)
    return out


def _walk_constants(jaxpr, out: list) -> None:
    for eqn in jaxpr.eqns:
        body = inlined_body(eqn)
        if body is not None:
            out.extend(body[1])
            _walk_constants(body[0], out)


def literal_operands(closed) -> dict[tuple[int, int], Any]:
    """``{(node id, operand index): value}`` of every literal operand of ``closed``'s graph nodes
    (the operands a graph records as ``None``).

    >>> import jax, jax.numpy as jnp
    >>> {k: float(v) for k, v in literal_operands(jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(3))).items()}
    {(0, 1): 2.0}
    """
    return {(nid, k): v for nid, e in enumerate(equations(closed)) for k, v in e.literals.items()}


def evaluate(graph, eqns: Sequence[Equation], node_ids: Sequence[int], env: dict, *,
             on_operand: OperandHook | None = None, on_result: ResultHook | None = None,
             on_body: BodyHook | None = None, on_bind: BindHook | None = None) -> dict:
    """Run some of a graph's nodes, in the order given, on values keyed by value id.

    ``eqns`` is :func:`equations` of the graph's jaxpr; ``env`` maps value ids to arrays (the graph
    inputs and constants the nodes read, and the results of nodes run before) and receives every
    result. The hooks are :func:`interpret`'s, with the graph's node ids. The staged emitter builds
    each stage's program from this: a stage runs a subset of one traced step.

    >>> import jax, jax.numpy as jnp
    >>> import hulkjax as hj
    >>> g = hj.trace(lambda x: jnp.sin(x) * 2, jnp.ones(3))
    >>> env = evaluate(g, equations(g.jaxpr), [0], {g.inputs[0]: jnp.zeros(3)})
    >>> env[g.nodes[0].outputs[0]].tolist()
    [0.0, 0.0, 0.0]
    """
    for nid in node_ids:
        node = graph.nodes[nid]
        eqn, lits = eqns[nid]
        invals = [lits[k] if k in lits else env[v] for k, v in enumerate(node.inputs)]
        if on_operand is not None:
            invals = [x if k in lits else on_operand(nid, k, x) for k, x in enumerate(invals)]
        outs = _bind(eqn, nid, invals, on_body, on_bind, on_result)
        for v, x in zip(node.outputs, outs):
            env[v] = x
    return env
