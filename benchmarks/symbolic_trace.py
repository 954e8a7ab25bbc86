"""One trace with a symbolic batch instead of two concrete ones: what it would save, and whether
the step's operators stay the same (issue 14: the staged search's second trace).

The staged search traces the step a second time, at ``B / k`` (``hulkjax.trace.microbatch``),
to learn which sizes scale with the batch and which literals are ``1 / B``. A step traced once
with a symbolic leading dimension ``b`` (``jax.export.symbolic_shape``) carries both facts, so
one such trace could replace the two, if (1) it costs less than the two and (2) evaluated at
``b = B`` it is the step the concrete trace gives, operator for operator (the plan is made per
operator and emitted from the concrete trace). This measures both, per model:

* CPU seconds of ``jax.make_jaxpr`` (process time): the step at ``B`` with JAX's caches cleared
  (what the first trace pays), then at ``B / k`` (``k``: the least divisor of ``B`` above 1, as
  the partition's analysis traces it; JAX's caches warm from the first, as in the planner), and
  the symbolic trace with the caches cleared (what one trace instead of the two would pay), and
  of making the symbolic trace concrete at ``B`` and at ``B / k`` (:func:`concretize`);
* the graphs built from the symbolic trace made concrete at ``B`` and at ``B / k`` against the
  graphs ``hj.trace`` and the staged search's microbatch trace build (everything planning reads
  of a graph, and the literal operands): the same, or the first difference;
* the two jaxprs' equations, sub-jaxprs included, with what is computed from literals and
  dimension sizes alone left out on both sides, shapes evaluated at ``b = B``: which primitives
  each side has that the other lacks; and :func:`static_gathers`;
* where the graphs differ (``--plans``, LLaMA's by default): ``megatron``, ``dp_tp`` and ``auto``
  planned on the traced graph and on the derived one, predicted steps side by side.

How the symbolic trace is made concrete (:func:`concretize`): every size in every equation's
result types and parameters, sub-jaxprs included, is evaluated at the size; the symbolic trace's
dimension arithmetic, which a concrete trace does in Python (``dim_as_value`` and its casts: the
``B`` of ``jnp.mean``), becomes literals, as a concrete trace has them; the result is
type-checked by JAX (``check_jaxpr``). The pieces live here, not in the package: the planner
does not use them (see ``SYMBOLIC.md`` for why).

Models: the zoo at ``tiny`` (our code), the third-party families of ``tests/realmodels`` and the
unseen models of ``benchmarks/unseen.py`` (code we did not write), and the two planning cases of
issue 14's targets (GPT-2 small, LLaMA-8B-class, abstract) for the times. Writes
``benchmarks/results/symbolic_trace.json`` and ``benchmarks/SYMBOLIC.md``::

    python benchmarks/symbolic_trace.py                # every model (about 10 minutes, 2 cores)
    python benchmarks/symbolic_trace.py --models zoo:gpt2 hf:llama unseen:opt
"""

from __future__ import annotations

import argparse
import collections
import datetime
import difflib
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the families live in tests/realmodels
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # the 2 x 4 mesh of the plan comparison
import numpy as np  # noqa: E402
from jax._src import core as _core  # noqa: E402  - Var, Literal, DropVar: not in jax.extend
from jax._src.literals import TypedNdArray  # noqa: E402
from jax.extend import core as jcore  # noqa: E402

import hulkjax as hj  # noqa: E402
from hulkjax import zoo  # noqa: E402
from hulkjax.errors import UnsupportedStepError  # noqa: E402
from hulkjax.trace.interpret import literal_operands  # noqa: E402
from hulkjax.trace.microbatch import batch_size, microbatch_graph, split_inputs  # noqa: E402
from hulkjax.trace.tracer import _without_dead_code, build_graph  # noqa: E402
from tests.helpers import graph_record  # noqa: E402

OUT_JSON = os.path.join(HERE, "results", "symbolic_trace.json")
OUT_MD = os.path.join(HERE, "SYMBOLIC.md")
ZOO = ("mlp", "transformer-block", "cnn", "gpt2", "llama", "bert", "vit", "moe", "resnet")
TARGETS = {  # issue 14's planning cases (abstract, as benchmarks/planning.py traces them)
    "gpt2-small": lambda: zoo.get("gpt2", size="small", batch=16, seq_len=1024),
    "llama3-8b": lambda: zoo.get("llama", size="llama3-8b", batch=64, seq_len=2048,
                                 dtype="bfloat16", remat=True),
}


# ---- one symbolic trace, made concrete at a batch size ---------------------------------------

_DIM_ARITHMETIC = frozenset({"dim_as_value"})
_CASTS_OF_DIMS = frozenset({"convert_element_type"})


def is_symbolic(x) -> bool:
    """Whether ``x`` is a symbolic dimension (``jax.export``'s dimension expressions)."""
    return hasattr(x, "_evaluate") and type(x).__name__ == "_DimExpr"


def evaluate(x, env: dict[str, int]):
    """``x`` with every symbolic dimension in it evaluated at ``env``: ints, tuples, lists,
    named tuples and dicts are walked; anything else is returned as it is.
    """
    if is_symbolic(x):
        return int(x._evaluate(env))
    if isinstance(x, tuple):
        items = [evaluate(y, env) for y in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [evaluate(y, env) for y in x]
    if isinstance(x, dict):
        return {k: evaluate(v, env) for k, v in x.items()}
    return x


def concretize(closed, env: dict[str, int], *, check: bool = True):
    """The ``ClosedJaxpr`` ``closed`` (traced with symbolic dimensions) at the sizes ``env``.

    Every result type and parameter is evaluated (:func:`evaluate`), sub-jaxprs too;
    ``dim_as_value`` equations become literals, and so do casts of them (a concrete trace makes
    both in Python). With ``check``, the result is type-checked
    (``jax.extend.core.check_jaxpr``: every equation's abstract evaluation again, about 60% of
    the time on GPT-2 small): a size the step cannot take, or one this script did not find, is
    refused here rather than where the jaxpr is run. The substitution is the same at every size,
    so a caller that made the same jaxpr concrete with the check before may leave it out.

    Raises:
      UnsupportedStepError: ``closed`` asserts something of its dimensions
        (``shape_assertion``: the step only traces for some sizes), or a symbolic dimension
        is left where :func:`evaluate` does not look.
    """
    try:
        out = jcore.ClosedJaxpr(_Concretizer(env).jaxpr(closed.jaxpr), closed.consts)
        if check:
            jcore.check_jaxpr(out.jaxpr)
    except UnsupportedStepError:
        raise
    except Exception as e:  # noqa: BLE001 - a size the trace cannot take, or a size missed
        raise UnsupportedStepError(
            f"the step traced with a symbolic batch could not be made concrete at {env}: "
            f"{type(e).__name__}: {e}. Trace the step at that size (hulkjax.trace).") from e
    return out


def _args_at(graph, size):
    """``graph``'s arguments as ``ShapeDtypeStruct`` leaves, its batch arguments
    (:func:`~hulkjax.trace.microbatch.split_inputs`) with leading dimension ``size`` (an int, or
    a symbolic dimension), in the step's argument structure."""
    split = set(split_inputs(graph))
    leaves = [jax.ShapeDtypeStruct(((size,) + tuple(a.shape[1:])) if i in split else a.shape,
                                   a.dtype, weak_type=getattr(a, "weak_type", False))
              for i, a in enumerate(graph.jaxpr.in_avals)]
    return jax.tree_util.tree_unflatten(graph.in_tree, leaves)


def symbolic_trace(graph, name: str = "b"):
    """``graph``'s step traced again with the leading dimension of its batch arguments the
    symbolic dimension ``name`` (:func:`_args_at`): a ``ClosedJaxpr``.

    Raises:
      UnsupportedStepError: the graph has no traced function or no batch, or the step does not
        trace with a symbolic batch (it branches on the batch size, say).
    """
    if graph.fn is None or not split_inputs(graph):
        raise UnsupportedStepError("a symbolic trace needs the step's function and a batch "
                                   "argument; trace the step with hulkjax.trace")
    (b,) = jax.export.symbolic_shape(name)
    try:
        return jax.make_jaxpr(graph.fn)(*_args_at(graph, b))
    except Exception as e:  # noqa: BLE001 - JAX's errors for what shape polymorphism refuses
        raise UnsupportedStepError(f"the step does not trace with a symbolic batch: "
                                   f"{type(e).__name__}: {e}") from e


def graph_of(concrete, graph):
    """The graph of ``concrete`` (:func:`concretize`'s result), built as
    :func:`~hulkjax.trace.tracer.trace` builds ``graph`` (dead code dropped; its argument and
    result paths)."""
    out = build_graph(_without_dead_code(concrete), graph.input_paths, graph.output_paths,
                      graph.in_tree, graph.out_tree)
    out.fn = graph.fn
    return out


def graph_at(symbolic, graph, size: int, name: str = "b", *, check: bool = True):
    """The graph of ``symbolic`` (:func:`symbolic_trace` of ``graph``) made concrete at batch
    ``size`` (:func:`concretize`, ``check`` passed on; :func:`graph_of`)."""
    return graph_of(concretize(symbolic, {name: size}, check=check), graph)


def static_gathers(closed) -> int:
    """How many ``gather`` equations of ``closed`` (sub-jaxprs included) read an array of
    symbolic shape at indices that are constants (computed from literals alone): where JAX
    gathers only because the shape is symbolic, and a concrete trace slices (``x[..., :n]``,
    ``x[:, 0]``: jnp's static-slice path refuses symbolic shapes). A step with any has another
    graph when traced concretely (``benchmarks/SYMBOLIC.md`` checks this on third-party models).
    """
    count = 0

    def walk(jaxpr):
        nonlocal count
        const: set = set()
        for e in jaxpr.eqns:
            names = [v for v in e.invars if not isinstance(v, jcore.Literal)]
            if all(v in const for v in names) and not _sub_jaxprs_any(e):
                const.update(e.outvars)
            if e.primitive.name == "gather":
                operand, indices = e.invars[0], e.invars[1]
                if any(is_symbolic(d) for d in getattr(operand.aval, "shape", ())) and (
                        isinstance(indices, jcore.Literal) or indices in const):
                    count += 1
            for sub in _sub_jaxprs(e):
                walk(sub)
    walk(closed.jaxpr)
    return count


class _Concretizer:
    def __init__(self, env: dict[str, int]):
        self.env = env
        self.avals: dict[Any, Any] = {}
        self.dims: dict[int, Any] = {}  # id -> the literals made from dimensions (kept alive)

    def aval(self, a):
        hit = self.avals.get(id(a))
        if hit is not None and hit[0] is a:
            return hit[1]
        shape = getattr(a, "shape", None)
        out = a
        if shape is not None and any(is_symbolic(d) for d in shape):
            out = a.update(shape=tuple(evaluate(d, self.env) for d in shape))
        self.avals[id(a)] = (a, out)
        return out

    def jaxpr(self, jaxpr):
        env: dict[Any, Any] = {}

        def new_var(v):
            if isinstance(v, _core.DropVar):
                return _core.DropVar(self.aval(v.aval))
            nv = env[v] = _core.Var(self.aval(v.aval))
            return nv

        def read(v):
            if isinstance(v, jcore.Literal):
                return v
            return env[v]

        constvars = [new_var(v) for v in jaxpr.constvars]
        invars = [new_var(v) for v in jaxpr.invars]
        eqns = []
        for e in jaxpr.eqns:
            name = e.primitive.name
            if name == "shape_assertion":
                raise UnsupportedStepError(
                    "the step asserts something of its symbolic dimensions (a shape_assertion): "
                    "it traces for some batch sizes only")
            ins = [read(v) for v in e.invars]
            if name in _DIM_ARITHMETIC:
                (o,) = e.outvars
                value = evaluate(e.params["dim"], self.env)
                env[o] = self.literal(value, self.aval(o.aval))
                continue
            if name in _CASTS_OF_DIMS and len(ins) == 1 and id(ins[0]) in self.dims:
                (o,) = e.outvars
                env[o] = self.literal(np.asarray(ins[0].val), self.aval(o.aval))
                continue
            params = {k: self.param(v) for k, v in e.params.items()}
            outs = [new_var(v) for v in e.outvars]
            eqns.append(e.replace(invars=ins, outvars=outs, params=params))
        outvars = [read(v) for v in jaxpr.outvars]
        return jaxpr.replace(constvars=constvars, invars=invars, outvars=outvars, eqns=eqns)

    def literal(self, value, aval):
        """A literal of ``value`` in ``aval``'s dtype, remembered as made from a dimension (its
        casts are folded too)."""
        lit = _core.Literal(TypedNdArray(np.asarray(value, dtype=aval.dtype), aval), aval)
        self.dims[id(lit)] = lit
        return lit

    def param(self, v):
        if isinstance(v, jcore.ClosedJaxpr):
            return jcore.ClosedJaxpr(self.jaxpr(v.jaxpr), v.consts)
        if isinstance(v, jcore.Jaxpr):
            return self.jaxpr(v)
        if isinstance(v, tuple) and any(isinstance(x, jcore.ClosedJaxpr | jcore.Jaxpr)
                                        for x in v):
            return tuple(self.param(x) for x in v)
        return evaluate(v, self.env)


# ---- the measurements ---------------------------------------------------------------------------

def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _builder(spec: str):
    kind, name = spec.split(":", 1)
    if kind == "zoo":
        m = zoo.get(name, size="tiny") if name in ("gpt2", "llama", "bert", "vit", "moe",
                                                   "resnet") else zoo.get(name)
        return lambda: (m.step, *m.abstract())
    if kind == "target":
        def build():
            m = TARGETS[name]()
            return (m.step, *m.abstract())
        return build
    from tests.realmodels import families, unseen_models
    families._quiet_transformers()
    if kind == "hf":
        return lambda: families.build(name, "tiny")
    if kind == "unseen":
        return unseen_models.MODELS[name]
    raise KeyError(f"unknown model kind {kind!r} in {spec!r}: use zoo:, hf:, unseen: or target:")


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for w in (v if isinstance(v, tuple | list) else (v,)):
            if isinstance(w, jcore.ClosedJaxpr):
                yield w.jaxpr
            elif isinstance(w, jcore.Jaxpr):
                yield w


def equations(jaxpr, env) -> list[tuple[str, tuple]]:
    """``(primitive, result shapes)`` of every equation, sub-jaxprs after their equation, shapes
    evaluated at ``env``; equations whose operands are all literals or results of such
    equations (sizes, ``1 / B``, constants) are left out."""
    out: list[tuple[str, tuple]] = []
    const: set = set()

    def walk(jx):
        for e in jx.eqns:
            names = [v for v in e.invars if not isinstance(v, jcore.Literal)]
            if all(v in const for v in names) and not _sub_jaxprs_any(e):
                const.update(e.outvars)
                continue
            out.append((e.primitive.name, tuple(evaluate(tuple(getattr(v.aval, "shape", ())),
                                                           env) for v in e.outvars)))
            for sub in _sub_jaxprs(e):
                walk(sub)
    walk(jaxpr)
    return out


def _sub_jaxprs_any(eqn) -> bool:
    return next(_sub_jaxprs(eqn), None) is not None


def _same_values(a, b) -> bool:
    """Equal arrays, NaN equal to NaN (a literal NaN fill value in both)."""
    a, b = np.asarray(a), np.asarray(b)
    return np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")


def graph_difference(traced, derived) -> str | None:
    """The first difference between a traced graph and a derived one, or None: everything of
    a graph that planning reads (``tests.helpers.graph_record``: nodes, parameters, shapes,
    FLOPs, bytes, layers, roles) and the literal operands (the ``1 / B`` of a mean)."""
    a, b = graph_record(traced), graph_record(derived)
    if a != b:
        if len(a[0]) != len(b[0]) or len(a[1]) != len(b[1]):
            return (f"{len(a[0])} / {len(b[0])} nodes, {len(a[1])} / {len(b[1])} values")
        for x, y in zip(a[0], b[0]):
            if x != y:
                return f"node {x[0]} ({x[1]} / {y[1]})"
        for x, y in zip(a[1], b[1]):
            if x != y:
                return f"value {x[0]}: {x[1]} {x[2]} / {y[1]} {y[2]}"
        return "graph fields (roles, paths, trees or totals)"
    la, lb = literal_operands(traced.jaxpr), literal_operands(derived.jaxpr)
    if la.keys() != lb.keys() or any(
            np.asarray(v).dtype != np.asarray(lb[k]).dtype or not _same_values(v, lb[k])
            for k, v in la.items()):
        return "literal operands"
    return None


def derived_graph(symbolic, graph, size: int, check: bool):
    """``(graph, seconds)``: :func:`graph_at`, and the CPU seconds of
    :func:`concretize` alone (building the graph, which a trace does
    too, is not counted)."""
    t0 = time.process_time()
    concrete = concretize(symbolic, {"b": size}, check=check)
    seconds = time.process_time() - t0
    return graph_of(concrete, graph), seconds


def measure(spec: str, repeat: int = 1) -> dict:
    """One model's row: the times are each the least of ``repeat`` runs."""
    step, state, batch = _builder(spec)()
    state, batch = _abstract(state), _abstract(batch)
    graph = hj.trace(step, state, batch)
    B = batch_size(graph)
    row = {"model": spec, "nodes": len(graph.nodes), "batch": B}
    if B is None or B < 2:
        return {**row, "error": "no batch to split"}
    k = next(d for d in range(2, B + 1) if B % d == 0)

    def timed(size, clear):
        if clear:
            jax.clear_caches()
        t0 = time.process_time()
        out = jax.make_jaxpr(graph.fn)(*_args_at(graph, size))
        return out, time.process_time() - t0

    times: dict[str, list[float]] = {}
    for _ in range(repeat):
        concrete, t = timed(B, clear=True)
        times.setdefault("trace_B_s", []).append(t)
        times.setdefault("trace_micro_s", []).append(timed(B // k, clear=False)[1])
        jax.clear_caches()
        t0 = time.process_time()
        try:
            symbolic = symbolic_trace(graph)
        except UnsupportedStepError as e:  # recorded: the model does not trace symbolically
            return {**row, "error": str(e)[:200]}
        times.setdefault("trace_symbolic_s", []).append(time.process_time() - t0)
    row["static_gathers"] = static_gathers(symbolic)
    # The graphs a trace at B and at B / k give, against those derived from the symbolic trace.
    micro = microbatch_graph(graph, k)
    try:
        for _ in range(repeat):
            # type-checked once: the substitution is the same at every size
            derived, t = derived_graph(symbolic, graph, B, check=True)
            times.setdefault("concretize_B_s", []).append(t)
            micro_derived, t = derived_graph(symbolic, graph, B // k, check=False)
            times.setdefault("concretize_micro_s", []).append(t)
        row["graph_B"] = graph_difference(graph, derived) or "same"
        row["graph_micro"] = graph_difference(micro, micro_derived) or "same"
    except Exception as e:  # noqa: BLE001 - recorded
        row["graph_B"] = row["graph_micro"] = f"not derived: {type(e).__name__}: {str(e)[:150]}"
    row.update({key: min(ts) for key, ts in times.items()})
    row["repeat"] = repeat
    a = equations(concrete.jaxpr, {})
    s = equations(symbolic.jaxpr, {"b": B})
    row["eqns_concrete"], row["eqns_symbolic"] = len(a), len(s)
    row["equal"] = a == s
    if not row["equal"]:
        blocks = [op for op in difflib.SequenceMatcher(None, s, a, autojunk=False).get_opcodes()
                  if op[0] != "equal"]
        only_s = collections.Counter(p for _, i1, i2, _, _ in blocks for p, _ in s[i1:i2])
        only_c = collections.Counter(p for _, _, _, j1, j2 in blocks for p, _ in a[j1:j2])
        row["blocks"] = len(blocks)
        row["symbolic_only"] = dict(only_s.most_common())
        row["concrete_only"] = dict(only_c.most_common())
    return row


PLAN_MODELS = ("zoo:llama", "hf:llama")
PLAN_STRATEGIES = ("megatron", "dp_tp", "auto")


def plan_quality(spec: str) -> list[dict]:
    """Predicted steps of plans made on the traced graph and on the graph derived from the
    symbolic trace (its static slices gathers), on the 2 x 4 CPU mesh and on 8 H100s in 2 DGX
    nodes: what planning from the derived graph would cost where the two differ."""
    from tests.realmodels.measure import MESHES

    step, state, batch = _builder(spec)()
    state, batch = _abstract(state), _abstract(batch)
    graph = hj.trace(step, state, batch)
    derived = graph_at(symbolic_trace(graph), graph, batch_size(graph))
    rows = []
    for mesh, topology in (("cpu 2x4", MESHES["2x4"]), ("2 DGX-H100 x 4", hj.Topology.preset(
            "dgx-h100", nodes=2, gpus_per_node=4))):
        for strategy in PLAN_STRATEGIES:
            kw = {"time_limit": 10} if strategy == "auto" else {}
            t, d = (hj.plan(step, state, batch, topology=topology, strategy=strategy, graph=g,
                            **kw).cost.step_time for g in (graph, derived))
            rows.append({"model": spec, "mesh": mesh, "strategy": strategy, "traced": t,
                         "derived": d})
    return rows


def default_models() -> list[str]:
    from tests.realmodels import families, unseen_models
    return ([f"target:{n}" for n in TARGETS] + [f"zoo:{n}" for n in ZOO]
            + [f"hf:{n}" for n in families.names() if families.available(n)]
            + [f"unseen:{n}" for n in unseen_models.MODELS])


def _counts(c: dict) -> str:
    return ", ".join(f"{p} x{n}" for p, n in c.items()) or "-"


def _saves(r) -> float | None:
    """CPU seconds one symbolic trace, made concrete at ``B`` and at ``B / k``, would save
    against the two traces (building the graphs is in both)."""
    if "concretize_micro_s" not in r:
        return None
    return (r["trace_B_s"] + r["trace_micro_s"] - r["trace_symbolic_s"]
            - r["concretize_B_s"] - r["concretize_micro_s"])


def report(doc: dict) -> str:
    rows = doc["rows"]
    ok = [r for r in rows if "error" not in r]
    third = [r for r in ok if r["model"].split(":")[0] in ("hf", "unseen")]
    same = [r for r in third if r.get("graph_B") == "same" and r.get("graph_micro") == "same"]
    flagged = [r for r in third if r.get("static_gathers")]
    reps = max((r.get("repeat", 1) for r in ok), default=1)
    lines = [
        "# One symbolic trace instead of two concrete ones",
        "",
        f"Generated by `python benchmarks/symbolic_trace.py` on {doc['date']} (commit "
        f"`{doc['commit']}`, jax {doc['jax']}, {doc['cpus']} CPU(s)); see the script's docstring. "
        "CPU seconds of `jax.make_jaxpr`: `B` with JAX's caches cleared (the first trace), "
        "`B / k` after it (the staged search's second trace), `symbolic` with the caches "
        "cleared. `concretize` is this script's `concretize` at `B` (type-checked) and "
        "at `B / k` (not: the substitution is the same at every size) together. `saves` is "
        "`B` + `B / k` - `symbolic` - `concretize`: what one symbolic trace would save "
        "against the two, where it stands for both. `graph at B` and `graph at "
        "B / k`: the graph built from the symbolic trace made concrete, against the graph "
        "`hj.trace` builds from the concrete trace (nodes, parameters, shapes, FLOPs, bytes, "
        "layers, literal operands): `same` or the first difference. `static gathers`: "
        "`static_gathers`, the gathers JAX makes only because a shape "
        f"is symbolic. The times of issue 14's cases (`target:`) are each the least of {reps} "
        "runs, the others' one run: noisy to a few tenths of a second.",
        "",
        f"- **Traces symbolically:** {len(ok)} of {len(rows)} models.",
        f"- **The same graphs, at `B` and at `B / k`** (third-party code: the families and the "
        f"unseen models): {len(same)} of {len(third)}.",
        f"- **With static gathers** (third-party): {len(flagged)}; of the "
        f"{len(third) - len(same)} whose graphs differ, "
        f"{sum(1 for r in third if r not in same and r.get('static_gathers'))} have them.",
    ]
    for name in TARGETS:
        r = next((r for r in ok if r["model"] == f"target:{name}"), None)
        if r is not None and _saves(r) is not None:
            lines.append(
                f"- **{name}** (issue 14's case): `B` {r['trace_B_s']:.2f} s + `B / k` "
                f"{r['trace_micro_s']:.2f} s against one symbolic trace "
                f"{r['trace_symbolic_s']:.2f} s + concretize "
                f"{r['concretize_B_s'] + r['concretize_micro_s']:.2f} s; graphs "
                f"{'the same' if r['graph_B'] == r['graph_micro'] == 'same' else 'differ'}.")
    lines += ["", "| model | graph nodes | B | B (s) | B / k (s) | symbolic (s) | concretize (s) "
              "| saves (s) | graph at B | graph at B / k | static gathers | only in the symbolic "
              "trace | only in the concrete trace |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['nodes']} | {r.get('batch')} | | | | | | "
                         f"{r['error']} | | | | |")
            continue
        saves = _saves(r)
        conc = "-" if saves is None else f"{r['concretize_B_s'] + r['concretize_micro_s']:.2f}"
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['batch']} | {r['trace_B_s']:.2f} | "
            f"{r['trace_micro_s']:.2f} | {r['trace_symbolic_s']:.2f} | {conc} | "
            f"{'-' if saves is None else f'{saves:.2f}'} | {r['graph_B']} | {r['graph_micro']} "
            f"| {r['static_gathers']} | {_counts(r.get('symbolic_only', {}))} | "
            f"{_counts(r.get('concrete_only', {}))} |")
    if doc.get("plans"):
        lines += ["", "## Plans on the derived graph where it differs", "",
                  "Predicted step of each strategy planned on the traced graph and on the graph "
                  "made concrete from the symbolic trace (its static slices gathered); `derived / traced` above 1 is what planning from the one symbolic "
                  "trace would lose on such a step.", "",
                  "| model | topology | strategy | traced (us) | derived (us) | derived / traced |",
                  "|---|---|---|---:|---:|---:|"]
        for p in doc["plans"]:
            lines.append(f"| {p['model']} | {p['mesh']} | {p['strategy']} | "
                         f"{p['traced'] * 1e6:.1f} | {p['derived'] * 1e6:.1f} | "
                         f"{p['derived'] / p['traced']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", help="zoo:NAME, hf:FAMILY, unseen:NAME, target:NAME "
                    "(default: all)")
    ap.add_argument("--plans", nargs="*", default=list(PLAN_MODELS),
                    help="models whose plans on the traced and the derived graph are compared "
                    f"(default: {' '.join(PLAN_MODELS)})")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each time of issue 14's cases (target:*), the least kept "
                    "(the small models' times are one run each)")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(OUT_JSON) as f:
            doc = json.load(f)
    else:
        rows = []
        for spec in args.models or default_models():
            print(spec, flush=True)
            try:
                rows.append(measure(spec, args.repeat if spec.startswith("target:") else 1))
            except Exception as e:  # noqa: BLE001 - recorded: the model fails to build
                rows.append({"model": spec, "nodes": 0, "error": f"{type(e).__name__}: "
                             f"{str(e)[:200]}"})
        plans = []
        for spec in args.plans:
            print("plans:", spec, flush=True)
            plans += plan_quality(spec)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
        doc = {"date": datetime.date.today().isoformat(), "commit": commit,
               "jax": jax.__version__, "cpus": os.cpu_count(),
               "machine": platform.machine(), "rows": rows, "plans": plans}
        os.makedirs(os.path.dirname(OUT_JSON), exist_ok=True)
        with open(OUT_JSON, "w") as f:
            json.dump(doc, f, indent=1)
    md = report(doc)
    with open(OUT_MD, "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
