"""Measurements of hulkjax on the real-model families: fidelity, plan quality, coverage.

Shared by ``tests/realmodels`` and the reports ``benchmarks/realmodels.py`` and
``benchmarks/coverage.py``. Everything here reads a traced graph, a plan or a compiled program;
nothing plans or compiles.

* Fidelity: the cost model's predicted collectives as XLA:CPU compiles them
  (``CostModel.program_summary(assignment, backend="cpu")``) against the compiled HLO's
  (``ShardedStep.collectives()``), per ``(kind, axes)``; predicted peak memory (``plan.cost.peak_memory``) against
  ``compiled.memory_analysis()``. As in ``tests/emit/test_fidelity.py``: reduce-scatters are
  predicted as the all-reduce + slice XLA:CPU emits, collectives of at most
  :data:`tests.emit.test_fidelity.SMALL` bytes (scalar metrics XLA folds into other reductions) are
  ignored, and a collective in a loop counts ``trip_count`` times.
* Quality: which of ``dp``'s compiled collectives are not gradient all-reduces; which projection
  kernels (parameters of rank >= 2 that feed a ``dot_general``) a plan shards.
* Coverage: every primitive of a graph (loop bodies included), its count, how hulkjax handles it
  (:func:`hulkjax.rules.handling`) and where the ones without a rule of their own occur.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator

import numpy as np
from jax.extend.core.primitives import reduce_sum_p

import hulkjax as hj
from hulkjax.emit.hlo import Collective
from hulkjax.rules import is_leader
from hulkjax.trace.graph import OPTIMIZER, PARAMETER, OpGraph
from hulkjax.trace.primitives import PASS_THROUGH, SCATTERS
from tests.emit.test_fidelity import SMALL
from tests.helpers import TWO_D_TOPOLOGY

# The meshes of the tests and reports, all on the 8 fake CPU devices: a flat ring, the 2 x 4 mesh of
# the other tests (slow "data", fast "model") and a 2 x 2 x 2 mesh with three link speeds.
MESHES = {
    "8": hj.Topology.grid((8,), ("data",)),
    "2x4": TWO_D_TOPOLOGY,
    "2x2x2": hj.Topology.grid((2, 2, 2), ("data", "fsdp", "model"), bandwidth=(25e9, 100e9, 450e9),
                              latency=(5e-6, 2e-6, 1e-6)),
}

BYTES_TOLERANCE = 0.10  # predicted bytes per (kind, axes) within 10% of the HLO's
MEMORY_TOLERANCE = 0.15  # predicted peak memory within 15% of the compiled program's

Table = dict[tuple[str, tuple[str, ...]], dict[str, int]]  # (kind, axes) -> {"count", "bytes"}


# ------------------------------------------------------------------------------------------------
# Fidelity
# ------------------------------------------------------------------------------------------------


def predicted_collectives(graph: OpGraph, plan: hj.Plan) -> Table:
    """The collectives the cost model predicts for ``plan``'s program as XLA:CPU compiles them
    (``CostModel.program_summary(..., backend="cpu")``: reduce-scatters as all-reduce + slice,
    gradient all-reduces combined per computation), per ``(kind, axes)``; collectives of at most
    ``SMALL`` bytes each are left out."""
    cm = hj.strategies.plan_cost_model(graph, plan.topology, plan)
    return {key: {"count": int(e["count"]), "bytes": int(e["bytes"])}
            for key, e in cm.program_summary(plan.assignment, backend="cpu",
                                             min_bytes=SMALL).items() if e["count"]}


def compiled_collectives(collectives: Iterable[Collective]) -> Table:
    """The compiled program's collectives per ``(kind, axes)``: count and bytes, each weighted by
    its ``trip_count`` (a loop body's collectives run once per iteration); collectives of at most
    ``SMALL`` bytes are left out."""
    table: Table = {}
    for c in collectives:
        if c.bytes <= SMALL:
            continue
        if c.trip_count is None:
            raise ValueError(f"collective {c.name} sits in a loop of unknown trip count: its "
                             f"per-step bytes cannot be compared")
        entry = table.setdefault((c.kind, c.axes), {"count": 0, "bytes": 0})
        entry["count"] += c.trip_count
        entry["bytes"] += c.bytes * c.trip_count
    return table


def compare_collectives(predicted: Table, compiled: Table) -> dict[str, dict]:
    """Per collective kind present on either side: whether the count and the bytes agree.

    Returns ``{kind: {"predicted": {axes: [count, bytes]}, "compiled": {...}, "count_equal": bool,
    "bytes_within": bool}}``; ``bytes_within`` is per ``(kind, axes)`` (same axes on both sides,
    bytes within :data:`BYTES_TOLERANCE` of the HLO's), ``count_equal`` the same for counts.

    >>> compare_collectives({("all-reduce", ("d",)): {"count": 3, "bytes": 1000}},
    ...                     {("all-reduce", ("d",)): {"count": 1, "bytes": 1050}})["all-reduce"]
    {'predicted': {'d': [3, 1000]}, 'compiled': {'d': [1, 1050]}, 'count_equal': False, 'bytes_within': True}
    """
    out = {}
    for kind in sorted({k for k, _ in predicted} | {k for k, _ in compiled}):
        pred = {"+".join(a): [v["count"], v["bytes"]] for (k, a), v in predicted.items() if k == kind}
        comp = {"+".join(a): [v["count"], v["bytes"]] for (k, a), v in compiled.items() if k == kind}
        same_axes = set(pred) == set(comp)
        out[kind] = {
            "predicted": pred,
            "compiled": comp,
            "count_equal": same_axes and all(pred[a][0] == comp[a][0] for a in comp),
            "bytes_within": same_axes and all(
                abs(pred[a][1] - comp[a][1]) <= BYTES_TOLERANCE * comp[a][1] for a in comp),
        }
    return out


def compiled_memory(compiled) -> int:
    """Bytes per device the compiled program needs: arguments + temporaries + outputs - aliased
    (donated) outputs, from ``compiled.memory_analysis()`` (as ``hulkjax demo`` reports it)."""
    ma = compiled.memory_analysis()
    return int(ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
               - ma.alias_size_in_bytes)


def within(predicted: float, actual: float, tolerance: float) -> bool:
    """``|predicted - actual| <= tolerance * actual``."""
    return abs(predicted - actual) <= tolerance * actual


# ------------------------------------------------------------------------------------------------
# Quality
# ------------------------------------------------------------------------------------------------


def parameter_shapes(graph: OpGraph) -> set[tuple[int, ...]]:
    """Shapes of the step's carried state (parameters and optimizer state, which has its
    parameters' shapes), normalized by :func:`_shape_key`.

    Optimizer state is included because hulkjax's roles call some parameters optimizer state: one
    used through a same-shape elementwise op before any other (Gemma's RMSNorm ``(1 + w) * x``).
    """
    return {_shape_key(graph.values[v].shape)
            for v, role in zip(graph.inputs, graph.input_roles) if role in (PARAMETER, OPTIMIZER)}


def _shape_key(shape) -> tuple[int, ...]:
    """Dimensions sorted, size-1 dimensions dropped: XLA may reduce a gradient in the transposed
    layout its dot produced, or with a unit dimension squeezed (ViT's (1, 17, D) positions)."""
    return tuple(sorted(d for d in shape if d != 1))


def gradient_only_shapes(graph: OpGraph) -> set[tuple[int, ...]]:
    """Shapes (normalized by :func:`_shape_key`) of the backward values that only make parameter
    gradients, made by a ``reduce_sum`` (where a batch split is summed away): every path from them to the step's results goes through light operators (no
    matmul, convolution, gather or loop; a scatter-add is light) and ends in carried state.

    A parameter used through a gather of indices without a batch dimension gets its gradient from a
    reduction over the batch *before* the scatter-add into the table: T5's relative position bias
    ``table[buckets]`` (a ``(buckets, heads)`` table, ``(heads, q, k)`` bias) has
    ``d bias = sum over the batch of d scores``, then ``scatter-add`` into the table. Under data
    parallelism that sum is the gradient reduction (XLA all-reduces it as a piece of the combined
    gradient all-reduce, since the batch is summed away there and the partitioner completes a
    partial sum at the reduction that makes it), though it is shaped like the bias, not like the
    table. Such a value only feeds the state update: no activation waits for it.
    """
    state_out = {graph.outputs[o] for o in graph.carried.values()
                 if graph.outputs[o] is not None}
    other_out = {v for v in graph.outputs if v is not None} - state_out
    only_grad: dict[int, bool] = {}  # node id -> all its results reach only state results

    def light(node) -> bool:
        return node.primitive in SCATTERS or not is_leader(node)

    for node in reversed(graph.nodes):
        ok = light(node)
        for o in node.outputs:
            if not ok:
                break
            if o in other_out:
                ok = False
                break
            uses = graph.consumers(o)
            if not uses and o not in state_out:
                continue
            ok = all(only_grad.get(c, False) for c, _ in uses)
        only_grad[node.id] = ok
    return {_shape_key(graph.values[o].shape) for node in graph.nodes
            if node.backward and node.primitive is reduce_sum_p and only_grad[node.id]
            for o in node.outputs}


def non_gradient_collectives(collectives: Iterable[Collective], graph: OpGraph) -> list[dict]:
    """The collectives of a data-parallel program that are not gradient all-reduces.

    A gradient all-reduce reduces tensors of the parameters' shapes, or of a backward value that
    only makes parameter gradients (:func:`gradient_only_shapes`: T5's position-bias gradient,
    summed over the batch before its scatter-add); each element of a combined, tuple-shaped
    all-reduce is judged on its own. Everything else is activation traffic: an all-gather,
    all-to-all or collective-permute, or an all-reduce of any other tensor. Pieces of at most
    ``SMALL`` bytes (the loss's reduction) are left out. Returns one ``{"kind", "axes", "shape",
    "dtype", "bytes"}`` per offending piece.
    """
    params = parameter_shapes(graph) | gradient_only_shapes(graph)
    out = []
    for c in collectives:
        for shape, dtype in zip(c.shapes, c.dtypes):
            nbytes = c.bytes if len(c.shapes) == 1 else _piece_bytes(c, shape, dtype)
            if nbytes <= SMALL:
                continue
            if c.kind == "all-reduce" and _shape_key(shape) in params:
                continue
            out.append({"kind": c.kind, "axes": "+".join(c.axes), "shape": list(shape),
                        "dtype": dtype, "bytes": int(nbytes)})
    return out


def _piece_bytes(c: Collective, shape, dtype: str) -> int:
    """Bytes of one element of a tuple-shaped collective (its share of ``c.bytes``)."""
    sizes = [int(np.prod(s)) * _itemsize(d) for s, d in zip(c.shapes, c.dtypes)]
    return int(c.bytes * int(np.prod(shape)) * _itemsize(dtype) / max(sum(sizes), 1))


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _itemsize(hlo_dtype: str) -> int:
    if hlo_dtype not in _ITEMSIZE:
        raise ValueError(f"no element size for HLO type {hlo_dtype!r}; add it to _ITEMSIZE")
    return _ITEMSIZE[hlo_dtype]


def projection_kernels(graph: OpGraph) -> list[str]:
    """Paths of the step's projection kernels: parameters of rank >= 2 that reach an operand of a
    ``dot_general`` through value-preserving views (casts, copies, reshapes, transposes: GPT-2's
    Conv1D transposes its kernel, bf16 models cast it). Embedding tables count only where a dot
    uses them (a tied LM head). Looks at the top-level graph (the families have no scanned
    layers).
    """
    out = []
    for v, role, path in zip(graph.inputs, graph.input_roles, graph.input_paths):
        if role == PARAMETER and len(graph.values[v].shape) >= 2 and _reaches_dot(graph, v):
            out.append(path)
    return out


def _reaches_dot(graph: OpGraph, value: int) -> bool:
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for nid, _ in graph.consumers(v):
            node = graph.nodes[nid]
            if node.name == "dot_general":
                return True
            if node.primitive in PASS_THROUGH:
                todo.extend(node.outputs)
    return False


def replicated_kernels(plan: hj.Plan, kernels: Iterable[str]) -> dict[str, str]:
    """``{path: reason}`` for the ``kernels`` a tensor-parallel plan keeps replicated on purpose:
    the planner notes each kernel whose column split it rejected, and why
    (``"<path>: kept replicated, <reason>"``, :func:`hulkjax.strategies.layouts.tensor_parallel`).

    >>> from types import SimpleNamespace
    >>> replicated_kernels(SimpleNamespace(notes=["a/k: kept replicated, top_k"]), ["a/k", "a/q"])
    {'a/k': 'top_k'}
    """
    wanted = set(kernels)
    out = {}
    for note in plan.notes:
        path, sep, reason = note.partition(": kept replicated, ")
        if sep and path in wanted:
            out[path] = reason
    return out


def sharded_inputs(plan: hj.Plan) -> set[str]:
    """Paths of the plan's inputs that are split over at least one mesh axis."""
    return {t.path for t in plan.inputs if any(e is not None for e in t.spec)}


# ------------------------------------------------------------------------------------------------
# Coverage
# ------------------------------------------------------------------------------------------------


def walk(graph: OpGraph) -> Iterator:
    """Every node of ``graph`` and, recursively, of its loop bodies."""
    for node in graph.nodes:
        yield node
        for sub in node.subgraphs:
            yield from walk(sub)


# Frameworks between the model code and the primitive (Keras's backend turns `ops.stack` into
# jnp): the model's own line is the innermost frame outside them.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FRAMEWORK_DIRS = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/hulkjax/", "/keras/src/")


def model_source(node) -> str:
    """``package/path/file.py:line`` of the model code that produced ``node``: the innermost frame
    outside JAX, Flax, Optax, Keras's backend and hulkjax (``node.source`` stops at Keras's
    backend, which is not the model), relative to ``site-packages`` (or to this repository)."""
    tracebacks = node.traceback if isinstance(node.traceback, tuple) else (node.traceback,)
    for tb in tracebacks:
        for fr in getattr(tb, "frames", None) or []:
            name = fr.file_name
            if any(d in name for d in _FRAMEWORK_DIRS):
                continue
            if "-packages/" in name:
                name = name.split("-packages/")[-1]
            elif name.startswith(_ROOT + os.sep):
                name = os.path.relpath(name, _ROOT)
            return f"{name}:{fr.line_num}"
    return node.source


def primitive_census(graph: OpGraph) -> dict[str, dict]:
    """Per primitive: ``{"count", "handling", "sources": {file:line: count}}`` (loop bodies
    included; ``handling`` from :func:`hulkjax.rules.handling`, sources from
    :func:`model_source`, most frequent first)."""
    counts: Counter = Counter()
    handling: dict[str, str] = {}
    sources: dict[str, Counter] = defaultdict(Counter)
    for node in walk(graph):
        counts[node.name] += 1
        handling[node.name] = hj.rules.handling(node.primitive)
        sources[node.name][model_source(node)] += 1
    return {name: {"count": counts[name], "handling": handling[name],
                   "sources": dict(sources[name].most_common())}
            for name in sorted(counts)}


def source_commit(root: str) -> str:
    """The short commit of the checkout at ``root`` (``"unknown"`` outside git): what the
    benchmarks record next to their numbers."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
