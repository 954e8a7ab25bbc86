"""The calibrated compute model on third-party model code: measured unsharded steps against the
cost model's prediction on the device ``hulkjax calibrate`` measures.

One process, one fake CPU device. It measures the device as ``hulkjax calibrate`` does
(:func:`hulkjax.launch.calibrate.measure`: chained dense-layer training matmuls, memory passes
into fresh buffers and in place, the kernel overhead), then for each family of
``tests/realmodels/families.py`` (third-party Flax code, random-initialized) times the jitted
unsharded training step, its state donated as ``hj.emit`` runs it (median of ``--repeats`` after
a warm-up), and predicts its compute with
:class:`~hulkjax.cost.model.CostModel` on a one-device topology of that device. Run it pinned to
one core, as the WAN testbed runs each region (the rate of one core then does not depend on
what else runs)::

    taskset -c 0 python benchmarks/compute_check.py                      # about 2 minutes
    taskset -c 0 python benchmarks/compute_check.py --families gpt2 bert --size small
    taskset -c 0 python benchmarks/compute_check.py --families gpt2 llama --batches 16 8 4 2

``--profile`` traces each family's full-batch step with ``jax.profiler`` and reports the time
of its relayout copies (XLA:CPU's ``copy`` / ``transpose`` fusions). ``--batches`` runs each
step on the first ``b`` examples of its batch too (as a pipeline's microbatch would): the
prediction's error as the batch shrinks. ``--streams`` (default 1-256 MB)
times a streaming kernel into a fresh output buffer and in place: on XLA:CPU a fresh buffer above
glibc's mmap threshold is new pages, and writing it costs the page faults (what the calibration's
fresh page cost measures; its memory rate is the in-place one). The threshold rises (to 32 MB
at most) as the process frees large buffers, so the streams, timed after the families' steps,
see fewer faults at small sizes than a new process does.

Writes ``benchmarks/results/compute_check.json`` and ``benchmarks/COMPUTE.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the families live in tests/realmodels
sys.path.insert(0, HERE)  # gpu_measure, also when imported rather than run

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import hulkjax as hj  # noqa: E402
from hulkjax.cost.dots import weight_gradients  # noqa: E402
from hulkjax.cost.memory import liveness  # noqa: E402
from hulkjax.cost.model import CostModel  # noqa: E402
from hulkjax.launch.calibrate import device_spec, measure  # noqa: E402
from tests.realmodels import families  # noqa: E402

JSON_PATH = os.path.join(HERE, "results", "compute_check.json")
MD_PATH = os.path.join(HERE, "COMPUTE.md")


def stream_rates(megabytes: int, repeats: int) -> dict:
    """Bytes/s of ``y = x * a + b`` on a ``megabytes`` float32 array: into a fresh output buffer,
    and in place (the input donated, so the output reuses its pages)."""
    import resource

    import jax.numpy as jnp

    n = megabytes * (1 << 20) // 4
    traffic = 2 * 4 * n
    axpb = lambda v: v * jnp.float32(1.0001) + jnp.float32(1e-3)  # noqa: E731
    into_fresh, inplace = jax.jit(axpb), jax.jit(axpb, donate_argnums=0)
    x = jnp.ones((n,), jnp.float32)
    y = [jnp.ones((n,), jnp.float32)]  # the donated array, replaced by each call's result

    def fresh_call():
        jax.block_until_ready(into_fresh(x))

    def donated_call():
        y[0] = jax.block_until_ready(inplace(y[0]))

    (fresh, faults_fresh), (donated, faults_donated) = (
        timed_faults(fresh_call, repeats, warmup=2), timed_faults(donated_call, repeats, warmup=2))
    return {"megabytes": megabytes, "fresh": traffic / fresh, "donated": traffic / donated,
            "faults_fresh": faults_fresh, "faults_donated": faults_donated,
            "pages": 4 * n / resource.getpagesize()}


CLASSES = ("matmul", "matmul, both operands transposed", "batched matmul", "convolution",
           "elementwise", "relayout copy", "reduction", "gather / scatter", "other")
"""The operation classes of ``--profile``'s breakdown, measured (HLO) and predicted (jaxpr)."""

_TRANSCENDENTAL = ("exponential", "log", "tanh", "erf", "rsqrt", "sqrt", "power", "logistic",
                   "divide", "sine", "cosine")


def hlo_classes(hlo_text: str) -> dict[str, str]:
    """The class (:data:`CLASSES`) of every instruction of a compiled XLA:CPU module, by name
    (the names ``jax.profiler``'s events carry), from what it computes: a fusion by the
    operations inside it. A ``dot`` not fused by YNNPACK whose left operand contracts its
    leading dimension and right operand its trailing one is a both-transposed matmul (Eigen's
    contraction); a dot with batch dimensions a batched matmul; a fusion of copies and shape
    operations alone a relayout copy."""
    import re

    comps: dict[str, list[tuple[str, str, str]]] = {}
    cur = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            cur = comps.setdefault(head.group(1), [])
            continue
        if line.startswith("}"):
            cur = None
            continue
        ins = re.match(r"^\s*(?:ROOT )?%(\S+) = .*? ([a-z][\w-]*)\((.*)$", line)
        if cur is not None and ins:
            cur.append((ins.group(1), ins.group(2), ins.group(3)))

    def ops_in(comp: str) -> list[tuple[str, str, str]]:
        out = []
        for name, op, rest in comps.get(comp, ()):
            out.append((name, op, rest))
            called = re.search(r"calls=%([\w.\-]+)", rest)
            if op == "fusion" and called:
                out += ops_in(called.group(1))
        return out

    classes = {}
    for comp in comps.values():
        for name, op, rest in comp:
            called = re.search(r"calls=%([\w.\-]+)", rest)
            inner = ops_in(called.group(1)) if op == "fusion" and called else [(name, op, rest)]
            kinds = {o for _, o, _ in inner}
            dots = [r for _, o, r in inner if o == "dot"]
            if dots:
                d = dots[0]
                if "batch_dims" in d:
                    cls = "batched matmul"
                elif op == "dot" and re.search(r"lhs_contracting_dims=\{0\}", d) and \
                        re.search(r"rhs_contracting_dims=\{1\}", d):
                    cls = "matmul, both operands transposed"
                else:
                    cls = "matmul"
            elif "convolution" in kinds:
                cls = "convolution"
            elif kinds & {"gather", "scatter"}:
                cls = "gather / scatter"
            elif kinds & {"reduce", "reduce-window"}:
                cls = "reduction"
            elif op in ("copy", "transpose") or (op == "fusion" and kinds <= {
                    "copy", "transpose", "bitcast", "parameter", "reshape", "broadcast",
                    "constant", "slice", "concatenate", "dynamic-slice", "dynamic-update-slice",
                    "pad"}):
                cls = "relayout copy"
            elif op == "fusion" or op in _TRANSCENDENTAL or op in ("add", "multiply", "select"):
                cls = "elementwise"
            else:
                cls = "other"
            classes[name] = cls
    return classes


def predicted_classes(cm) -> dict[str, float]:
    """The cost model's compute seconds of an unsharded step by :data:`CLASSES`, per jaxpr
    equation (loops as one node), and its fresh pages apart."""
    from jax.extend.core import primitives as P

    from hulkjax.trace.primitives import FUSIBLE, REDUCTIONS

    out = dict.fromkeys(CLASSES, 0.0)
    for node in cm.graph.nodes:
        t = cm.compute_time(node, 1)
        if node.primitive is P.dot_general_p:
            (_, _), (lb, _) = node.params["dimension_numbers"]
            cls = ("batched matmul" if lb else "matmul, both operands transposed"
                   if node.id in cm.transposed_dots else "matmul")
        elif node.primitive is P.conv_general_dilated_p:
            cls = "convolution"
        elif "gather" in node.name or "scatter" in node.name:
            cls = "gather / scatter"
        elif node.primitive in REDUCTIONS or node.name.startswith(("reduce_window", "arg", "cum")):
            cls = "reduction"
        elif node.primitive is P.transpose_p:
            cls = "relayout copy"
        elif node.primitive in FUSIBLE:
            cls = "elementwise"
        else:
            cls = "other"
        out[cls] += t
    return out


def cotangents(cm) -> dict:
    """The step's weight gradients (:func:`hulkjax.cost.dots.weight_gradients`): how many, how
    many of them the cost model charges as both-transposed, and their cotangents' elements (what
    XLA:CPU copies into the order each weight gradient's dot wants)."""
    grads = weight_gradients(cm.graph)
    return {"weight_gradients": len(grads),
            "transposed_dots": len(cm.transposed_dots),
            "cotangent_elements": sum(math.prod(cm.graph.values[v].shape)
                                      for v in grads.values())}


def relayout_share(jitted, state, batch, steps: int = 2) -> dict:
    """Where one step's time goes on XLA:CPU, from ``jax.profiler``'s trace of ``steps`` calls:
    the seconds per step of every compiled operation (the trace's events are the HLO
    instructions XLA:CPU runs), of those that copy an array into another dimension order
    (``copy`` and ``transpose`` fusions: XLA:CPU's relayouts, which the cost model charges as
    memory traffic where the step transposes, and not at all where XLA copies a matmul's operand
    into the order its kernel wants), and by operation class (:func:`hlo_classes`)."""
    import glob
    import gzip
    import tempfile

    held = jax.tree_util.tree_map(lambda x: x.copy(), state)
    held = jax.block_until_ready(jitted(held, batch))[0]
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(steps):
            held = jax.block_until_ready(jitted(held, batch))[0]
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as fh:
            events = json.load(fh)["traceEvents"]
    per_op: dict[str, float] = {}
    for e in events:
        name = e.get("name", "")
        # host-side spans (Python, the executor's wait, the thread pool) are not operations
        if e.get("ph") == "X" and not name.startswith(("$", "ThunkExecutor", "Slinky")):
            per_op[name] = per_op.get(name, 0.0) + e["dur"] * 1e-6 / steps
    classes = hlo_classes(jitted.lower(held, batch).compile().as_text())
    by_class = dict.fromkeys(CLASSES, 0.0)
    for name, t in per_op.items():
        if name in classes:  # the rest are the runtime's spans around the program
            by_class[classes[name]] += t
    relayout = {n: t for n, t in per_op.items() if "copy" in n or "transpose" in n}
    top = sorted(relayout.items(), key=lambda kv: -kv[1])[:5]
    return {"ops": sum(per_op.values()), "relayout": sum(relayout.values()),
            "relayout_ops": len(relayout), "largest": [[n, t] for n, t in top],
            "classes": by_class}


def timed_faults(call, repeats: int, *, warmup: int) -> tuple[float, float]:
    """Median seconds of ``call()`` over ``repeats`` calls after ``warmup`` ones, and the
    process's minor page faults per timed call (``getrusage``)."""
    import resource

    for _ in range(warmup):
        call()
    f0, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / repeats
    return sorted(times)[len(times) // 2], faults


def donated_time(jitted, state, batch, repeats: int) -> tuple[float, float]:
    """Median seconds of ``jitted(state, batch)`` with the state donated (each call gets the
    previous call's new state; a copy of ``state``, which stays usable), after three warm-up
    calls, and the minor page faults per call."""
    held = [jax.tree_util.tree_map(lambda x: x.copy(), state)]

    def call():
        held[0] = jax.block_until_ready(jitted(held[0], batch))[0]

    return timed_faults(call, repeats, warmup=3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["gpt2", "bert", "t5", "vit", "llama"],
                    choices=families.names())
    ap.add_argument("--size", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 16, 64, 256],
                    metavar="MB", help="also time y = x * a + b at these sizes, into a fresh "
                    "output buffer and in place (donated): what the memory rate depends on")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="also run each step on the first b examples of its batch (default: "
                         "the family's own batch only)")
    ap.add_argument("--json", default=JSON_PATH, help="where to write the results")
    ap.add_argument("--md", default=MD_PATH, help="where to write the markdown report")
    ap.add_argument("--profile", action="store_true",
                    help="also profile each family's full-batch step (jax.profiler): the time "
                         "of its relayout copies against all its operations")
    args = ap.parse_args(argv)
    # One device (set here, not on import: importing must leave JAX's configuration alone).
    jax.config.update("jax_num_cpu_devices", 1)
    meas = measure(matmul_size=1024, memory_bytes=64 << 20, link_bytes=(), repeats=args.repeats)
    spec = device_spec(meas, memory=16e9)
    topo = hj.Topology.grid((1,), ("d",), device=spec, name="calibrated-1")
    print(f"calibrated: {spec.peak_flops / 1e9:.1f} GFLOP/s, {spec.hbm_bandwidth / 1e9:.2f} GB/s "
          f"in place, a fresh page {spec.fresh_page_time * 1e6:.2f} us, kernel overhead "
          f"{spec.kernel_overhead * 1e6:.1f} us, both-transposed matmuls at "
          f"{spec.transposed_dot_efficiency:.2f} of the matmul rate", flush=True)
    rows, profiles = [], []
    for name in args.families:
        if not families.available(name):
            print(f"  {name}: skipped ({families.FAMILIES[name].install})", flush=True)
            continue
        step, state, full = families.build(name, args.size)
        # As hj.emit runs a step: its state donated, the new state written into its buffers.
        jitted = jax.jit(step, donate_argnums=0)
        own = len(jax.tree_util.tree_leaves(full)[0])
        if args.profile:
            prof = relayout_share(jitted, state, full)
            profiles.append({"family": name, "batch": own, **prof})
            print(f"  {name} profile: operations {prof['ops'] * 1e3:.1f} ms, relayout copies "
                  f"{prof['relayout'] * 1e3:.1f} ms ({prof['relayout_ops']} ops)", flush=True)
        for b in args.batches or [own]:
            if b > own:
                print(f"  {name}: batch {b} skipped (its batch has {own} examples)", flush=True)
                continue
            batch = jax.tree_util.tree_map(lambda x, b=b: x[:b], full)
            graph = hj.trace(step, state, batch)
            measured, faults = donated_time(jitted, state, batch, args.repeats)
            cm = CostModel(graph, topo)
            cost = cm.evaluate(cm.replicated_assignment())
            if args.profile and b == own:
                profiles[-1]["predicted_classes"] = predicted_classes(cm)
                profiles[-1].update(cotangents(cm))
                profiles[-1]["predicted_pages"] = cost.page_time
            # the temporaries the page cost is charged for: the liveness walk's against XLA's
            temps = liveness(cm, cm.replicated_assignment()).temporaries
            compiled = jitted.lower(state, batch).compile().memory_analysis()
            rows.append({"family": name, "model": families.FAMILIES[name].model,
                         "size": args.size, "batch": b, "measured": measured,
                         "predicted": cost.compute_time, "predicted_pages": cost.page_time,
                         "page_faults": faults, "predicted_temporaries": temps,
                         "compiled_temporaries": float(compiled.temp_size_in_bytes)})
            print(f"  {name} (batch {b}): measured {measured * 1e3:.1f} ms ({faults:.0f} page "
                  f"faults a call), predicted {cost.compute_time * 1e3:.1f} ms (fresh pages "
                  f"{cost.page_time * 1e3:.1f}) ({measured / cost.compute_time:.2f})", flush=True)
    streams = [stream_rates(mb, args.repeats) for mb in args.streams]
    for r in streams:
        print(f"  stream {r['megabytes']} MB: fresh output {r['fresh'] / 1e9:.1f} GB/s "
              f"({r['faults_fresh']:.0f} page faults a call), in place "
              f"{r['donated'] / 1e9:.1f} GB/s ({r['faults_donated']:.0f})", flush=True)
    cpus = sorted(os.sched_getaffinity(0))
    res = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "cpus": cpus,
           "command": "python benchmarks/compute_check.py " + " ".join(sys.argv[1:]),
           # the allocator's settings (a run without fresh pages sets them)
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
           "device": {"peak_flops": spec.peak_flops, "hbm_bandwidth": spec.hbm_bandwidth,
                      "fresh_page_time": spec.fresh_page_time,
                      "kernel_overhead": spec.kernel_overhead,
                      "transposed_dot_efficiency": spec.transposed_dot_efficiency},
           "rows": rows,
           "profiles": profiles,
           "streams": streams}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)
    lines = ["# Calibrated compute on third-party model code", "",
             "Generated by `"
             + (f"GLIBC_TUNABLES={res['glibc_tunables']} " if res["glibc_tunables"] else "")
             + f"{'taskset -c ' + str(cpus[0]) + ' ' if len(cpus) == 1 else ''}"
             f"{res['command'].strip()}` on {res['date']} (jax {res['jax']}, cores {cpus}). "
             f"The device as `hulkjax calibrate` measures it: "
             f"{spec.peak_flops / 1e9:.1f} GFLOP/s (chained dense-layer training matmuls), "
             f"{spec.hbm_bandwidth / 1e9:.2f} GB/s (a streaming kernel in place), "
             f"{spec.fresh_page_time * 1e6:.2f} us per fresh 4 KiB page (the same kernel into "
             f"fresh buffers, over its page faults), kernel overhead "
             f"{spec.kernel_overhead * 1e6:.1f} us, matmuls with both operands transposed at "
             f"{spec.transposed_dot_efficiency:.2f} of the matmul rate "
             f"({spec.transposed_dot_efficiency * spec.peak_flops / 1e9:.1f} GFLOP/s: a weight "
             f"gradient XLA:CPU lays out that way runs on Eigen's contraction, "
             f"`hulkjax/cost/dots.py`). Each family's unsharded training step "
             f"(random-initialized, its state donated as `hj.emit` runs it, median of "
             f"{args.repeats}) against the cost model's compute prediction on that device; the "
             f"prediction's fresh pages are the temporaries of the step above XLA:CPU's "
             f"allocator threshold (32 MiB), at that page cost; page faults are the process's "
             f"minor faults per call (`getrusage`); the temporaries are the liveness walk's "
             f"(what the page cost is charged for) and the compiled program's "
             f"(`memory_analysis().temp_size_in_bytes`).", "",
             "| family | model | size | batch | measured | page faults a call | predicted | "
             "of which fresh pages | measured / predicted | measured per example | "
             "predicted per example | temporaries: predicted / compiled |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['model']} | {r['size']} | {r['batch']} | "
                     f"{r['measured'] * 1e3:.1f} ms | {r['page_faults']:.0f} | "
                     f"{r['predicted'] * 1e3:.1f} ms | {r['predicted_pages'] * 1e3:.1f} ms | "
                     f"{r['measured'] / r['predicted']:.2f} | "
                     f"{r['measured'] / r['batch'] * 1e3:.1f} ms | "
                     f"{r['predicted'] / r['batch'] * 1e3:.1f} ms | "
                     f"{r['predicted_temporaries'] / 2 ** 20:.1f} / "
                     f"{r['compiled_temporaries'] / 2 ** 20:.1f} MiB |")
    if profiles:
        lines += ["", "Where the full-batch step's time goes (`--profile`: `jax.profiler`'s trace "
                  "of two donated steps, whose events are the HLO instructions XLA:CPU runs): "
                  "its copies into another dimension order (`copy` and `transpose` fusions, "
                  "which the cost model charges as memory traffic where the step transposes, "
                  "and not at all where XLA copies a matmul's operand into the order its kernel "
                  "wants) against all of its operations.", "",
                  "| family | batch | operations | relayout copies | share | largest |",
                  "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {p['family']} | {p['batch']} | {p['ops'] * 1e3:.1f} ms | "
                  f"{p['relayout'] * 1e3:.1f} ms ({p['relayout_ops']}) | "
                  f"{p['relayout'] / p['ops']:.0%} | "
                  + ", ".join(f"`{n}` {t * 1e3:.1f} ms" for n, t in p["largest"][:3]) + " |"
                  for p in profiles]
    if any("predicted_classes" in p for p in profiles):
        lines += ["", "By operation class, the same profiles (measured: the compiled operations' "
                  "time, each HLO instruction classed by what it computes, a fusion by the "
                  "operations inside it; the page faults of fresh buffers are inside the "
                  "operations that first write them) against the cost model's compute time per "
                  "jaxpr equation of that class (fusible operators at their fused traffic; the "
                  "fresh pages apart). A matmul with both operands transposed is a `dot` "
                  "outside XLA:CPU's YNNPACK fusions whose left operand contracts its leading "
                  "dimension and right operand its trailing one (measured), or the dot "
                  "`hulkjax.cost.dots.transposed_dots` says XLA lays out that way (predicted). "
                  "Each cell: measured / predicted ms.", "",
                  "| family | batch | " + " | ".join(CLASSES) + " | fresh pages (predicted) |",
                  "|---|---:|" + "---:|" * (len(CLASSES) + 1)]
        for p in profiles:
            if "predicted_classes" not in p:
                continue
            lines.append(f"| {p['family']} | {p['batch']} | " + " | ".join(
                f"{p['classes'][c] * 1e3:.1f} / {p['predicted_classes'][c] * 1e3:.1f}"
                for c in CLASSES) + f" | {p['predicted_pages'] * 1e3:.1f} |")
        rest = [p for p in profiles if "cotangent_elements" in p]
        if rest:
            lines += ["", "What the classes leave: the elementwise and relayout-copy classes' "
                      "measured time beyond their prediction, against the elements of the "
                      "cotangents of the step's weight gradients (`dot_general`s without batch "
                      "dimensions contracting the leading dimensions of a forward operand and a "
                      "backward one, `hulkjax.cost.dots.weight_gradients`), which XLA:CPU "
                      "copies into the order each one's dot wants, fused into the operations "
                      "that make them. Not modelled: the rate of such a fused copy depends on "
                      "what XLA fuses with it.", "",
                      "| family | batch | weight gradients (both-transposed) | cotangent "
                      "elements | elementwise + relayout beyond prediction | per cotangent "
                      "element |", "|---|---:|---:|---:|---:|---:|"]
            for p in rest:
                extra = sum(p["classes"][c] - p["predicted_classes"][c]
                            for c in ("elementwise", "relayout copy"))
                lines.append(f"| {p['family']} | {p['batch']} | {p['weight_gradients']} "
                             f"({p['transposed_dots']}) | {p['cotangent_elements'] / 1e6:.1f} M | "
                             f"{extra * 1e3:.1f} ms | "
                             f"{extra / max(p['cotangent_elements'], 1) * 1e9:.2f} ns |")
    if streams:
        lines += ["", "Memory rate by buffer: `y = x * a + b` on a float32 array (one read, one "
                  "write per element), its output in a fresh buffer (as `hulkjax calibrate` "
                  "measures it, and as a step's outputs and temporaries are allocated each call) "
                  "or in the input's buffer (donated), median of the timed calls; minor page "
                  "faults per call from the process's count (`getrusage`).", "",
                  "| array | pages | fresh output | page faults a call | in place | page faults "
                  "a call |", "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['megabytes']} MB | {r['pages']:.0f} | {r['fresh'] / 1e9:.1f} GB/s | "
                  f"{r['faults_fresh']:.0f} | {r['donated'] / 1e9:.1f} GB/s | "
                  f"{r['faults_donated']:.0f} |" for r in streams]
    with open(args.md, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {args.json} and {args.md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
