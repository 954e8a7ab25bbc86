"""``hulkjax`` command line: ``demo``, ``plan``, ``compare``, ``explain``, ``launch``, ``calibrate``.

Examples::

    hulkjax demo                                   # GPT-2 small (B=16) on 2 DGX-H100 nodes
    hulkjax compare --model gpt2 --size small --topology dgx-h100 --nodes 2 --out cmp/
    hulkjax plan --model mlp --size tiny --topology geo --strategy fsdp --out plan.json
    hulkjax explain --model gpt2 --size small --topology geo --strategy ilp
    hulkjax explain --model mymodels.py:make_step --topology cluster.json --strategy fsdp
    hulkjax launch --model mlp --size tiny --topology hetero --strategy dp megatron --out run/
    hulkjax calibrate --out cal/                   # measure this machine: cal/topology.json

``--model`` is a zoo name (``python -c "from hulkjax import zoo; print(zoo.names())"``) or your own
``module:function`` / ``path/to/file.py:function``: a function taking no arguments that returns
``(step, state, batch)``, where ``step(state, batch)`` is the training step and ``state`` / ``batch``
are pytrees of arrays or ``jax.ShapeDtypeStruct`` (nothing is allocated for the latter).

Programs are compiled on fake CPU devices (as many as the topology has) to read their collectives
and memory from XLA; nothing runs on an accelerator.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from hulkjax import api
from hulkjax.emit.hlo import summarize
from hulkjax.errors import (
    HulkjaxError,
    InvalidOptionError,
    ProcessLayoutError,
    StrategyNotApplicableError,
)
from hulkjax.explain import explain
from hulkjax.formatting import SHORT_COLLECTIVES, format_bytes, format_rate
from hulkjax.gnn.weights import WEIGHTS_DIR
from hulkjax.launch import Job, launch, run_worker
from hulkjax.launch.calibrate import calibrate
from hulkjax.loading import LoadedStep, load_step
from hulkjax.plan import Plan
from hulkjax.strategies.registry import names as strategy_names
from hulkjax.topology.model import resolve as resolve_topology
from hulkjax.trace.tracer import trace
from hulkjax.training import run as train_planner
from hulkjax.training.groups import run as train_group_head


def _ensure_devices(n: int) -> None:
    """Ask for ``n`` fake CPU devices before JAX initializes (no-op if it already has)."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        try:
            jax.config.update("jax_num_cpu_devices", max(n, 1))
        except RuntimeError:  # backends already initialized
            pass


# XLA:CPU flags for programs that are compiled only to be read (``compare`` and ``demo`` read
# their collectives and memory, and never run them): skip LLVM's optimizations and emit fusions
# with XLA's older LLVM emitters. They act after SPMD partitioning, so the collectives are the
# same (as they are in the test suite, which compiles under them: see the root conftest.py).
# XLA's memory per device is that of the programs as fused under them: the same on the demo's
# nine plans and on transformers' GPT-2 and T5 (tiny, every strategy on two DGX nodes), within
# 1% on its LLaMA (a few fusions differ). The demo took 174 s (181 s user CPU) against 216 s
# (261 s) with XLA's defaults, compiling one plan after another. A flag the user's XLA_FLAGS
# sets is left as set. (Only the CPU backend starts: ``_ensure_devices`` sets
# JAX_PLATFORMS=cpu where it is unset.)
INSPECTION_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                        "--xla_llvm_disable_expensive_passes=true",
                        "--xla_cpu_use_fusion_emitters=false")


def inspection_xla_flags(current: str) -> str:
    """``current`` (the ``XLA_FLAGS`` value) with :data:`INSPECTION_XLA_FLAGS` added, those it
    sets already left as it sets them.

    >>> inspection_xla_flags("--xla_backend_optimization_level=2").split()[:2]
    ['--xla_backend_optimization_level=2', '--xla_llvm_disable_expensive_passes=true']
    """
    flags = current.split()
    have = {f.split("=")[0] for f in flags}
    return " ".join(flags + [f for f in INSPECTION_XLA_FLAGS if f.split("=")[0] not in have])


def _topology(args):
    return resolve_topology(args.topology, nodes=args.nodes)


def _load_model(args) -> LoadedStep:
    overrides = {}
    if getattr(args, "batch", None) is not None:
        overrides["batch"] = args.batch
    return load_step(args.model, size=args.size, overrides=overrides)


def _progress(items, desc: str, total: int | None = None):
    """A tqdm progress bar on stderr when it is a terminal (silent in logs and tests); over
    ``items``, or (``items=None``) one the caller advances, ``total`` steps long."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, file=sys.stderr, disable=None, leave=False,
                unit="strategy")


def _compare_rows(step_fn, state, batch, topo, strategies, compile_programs: bool):
    graph = trace(step_fn, state, batch)
    plans = {}
    bar = _progress(strategies or strategy_names(), "planning")
    for name in bar:
        bar.set_postfix_str(name)
        try:  # as hj.compare: strategies that do not apply to this topology are left out
            plans[name] = api.plan(step_fn, state, batch, topology=topo, strategy=name,
                                  graph=graph)
        except StrategyNotApplicableError:
            continue
    rows = [{"strategy": name, "plan": p, "state_bytes": state_bytes_per_device(p),
             "planning_time": p.planning_time, "collectives": None, "memory": None}
            for name, p in plans.items()]
    if compile_programs:
        _compile_rows(rows, step_fn, state, batch)
    return graph, rows


def _compile_rows(rows, step_fn, state, batch) -> None:
    """Each row's plan compiled (never run), its collectives and per-device memory read back.

    Lowering a program runs Python and holds the interpreter; XLA's compile of it does not. So
    the SPMD plans are lowered here one after another and compiled on other threads
    (:func:`compile_workers`), while this thread builds the staged plans' programs, then reads
    the compiled programs' collectives and memory (``tests/test_cli.py`` holds the rows equal to
    compiling each plan alone)."""
    from concurrent.futures import ThreadPoolExecutor

    steps = [api.emit(step_fn, r["plan"]) for r in rows]
    spmd = [i for i, r in enumerate(rows) if r["plan"].stages is None]
    bar = _progress(None, "compiling", total=len(rows))

    def done(i, compiled=None) -> None:
        step, row = steps[i], rows[i]
        row["collectives"] = summarize(step.collectives(), fold_emulated=True)
        if compiled is None:  # a staged step: the largest program's footprint
            row["memory"] = step.memory_per_device()
        else:
            ma = compiled.memory_analysis()
            row["memory"] = (ma.argument_size_in_bytes + ma.temp_size_in_bytes
                             + ma.output_size_in_bytes - ma.alias_size_in_bytes)
        bar.set_postfix_str(row["strategy"])
        bar.update()

    with ThreadPoolExecutor(compile_workers(len(spmd))) as pool:
        futures = {}
        for i in spmd:
            lowered = steps[i].lower(state, batch)
            futures[i] = pool.submit(steps[i].compile, state, batch, lowered=lowered)
        for i in range(len(rows)):
            if i not in futures:  # its stage programs, built and compiled here meanwhile
                steps[i].compile(state, batch)
                done(i)
        for i, f in futures.items():
            done(i, f.result())  # (re-raises what the compile raised)
    bar.close()


def compile_workers(programs: int, cpus: int | None = None) -> int:
    """Threads that compile ``programs`` lowered programs while this one lowers and reads them:
    one fewer than the CPUs this process may use (at least one, at most ``programs``).

    >>> compile_workers(9, cpus=2), compile_workers(3, cpus=16), compile_workers(0, cpus=1)
    (1, 3, 1)
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    return max(1, min(programs, cpus - 1))


def state_bytes_per_device(plan) -> int:
    """Bytes of parameters and optimizer state one device holds under the plan."""
    import numpy as np

    meshes = {None: dict(zip(plan.axis_names, plan.mesh_shape))}
    holder = {}
    for k, st in enumerate(plan.stages or ()):  # staged: each leaf on the stage holding it
        meshes[k] = dict(zip(st.axis_names, st.mesh_shape))
        holder.update({i: k for i in st.inputs})
    totals: dict = {}
    for i, t in enumerate(plan.inputs):
        if t.role not in ("parameter", "optimizer"):
            continue
        sizes = meshes[holder.get(i)]
        n = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
        for entry in t.spec:
            for a in (entry if isinstance(entry, tuple) else (entry,) if entry else ()):
                n //= sizes[a]
        totals[holder.get(i)] = totals.get(holder.get(i), 0) + n
    return max(totals.values(), default=0)


def _render(rows, title: str, console) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in ("strategy", "predicted step", "compute / comm", "efficiency", "peak mem / device",
                "XLA mem / device", "collectives in the compiled HLO", "plan s"):
        table.add_column(col, overflow="fold")
    best = min((r["plan"].cost.step_time for r in rows if r["plan"].cost.fits), default=None)
    for r in rows:
        c = r["plan"].cost
        if r["collectives"] is None:
            colls = "(not compiled)"
        elif not r["collectives"]:
            colls = "none"
        else:
            colls = "\n".join(f"{SHORT_COLLECTIVES.get(kind, kind)} {'+'.join(axes) or '-'}: {v['count']} x, "
                              f"{format_bytes(v['bytes'])}"
                              for (kind, axes), v in sorted(r["collectives"].items()))
        mem = "-" if r["memory"] is None else format_bytes(r["memory"])
        step = f"{c.step_time * 1e3:.3g} ms"
        if best is not None and c.step_time == best:
            step = f"[bold green]{step}[/bold green]"
        peak = format_bytes(c.peak_memory) + ("" if c.fits else " [red](does not fit)[/red]")
        table.add_row(r["strategy"], step, f"{c.compute_time * 1e3:.3g} / {c.comm_time * 1e3:.3g} ms",
                      f"{c.efficiency:.1%}", peak, mem, colls, f"{r['planning_time']:.2f}")
    console.print(table)


def cmd_demo(args) -> int:
    args.model, args.size = "gpt2", "small"
    return cmd_compare(args, title_prefix="hulkjax demo: ")


def cmd_compare(args, title_prefix: str = "") -> int:
    from rich.console import Console

    topo = _topology(args)
    if not args.no_compile and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        # (read when JAX starts its CPU backend, below: a backend already started keeps its own)
        os.environ["XLA_FLAGS"] = inspection_xla_flags(os.environ.get("XLA_FLAGS", ""))
    _ensure_devices(topo.num_devices)
    import jax

    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(topo.describe())
    m = _load_model(args)
    compile_programs = not args.no_compile and len(jax.devices()) >= topo.num_devices
    if not compile_programs and not args.no_compile:
        console.print(f"[yellow]JAX has {len(jax.devices())} devices, the topology needs "
                      f"{topo.num_devices}: planning only (no compiled collectives).[/yellow]")
    t0 = time.perf_counter()
    state, batch = m.args
    graph, rows = _compare_rows(m.step, state, batch, topo, args.strategies, compile_programs)
    title = f"{title_prefix}{m.describe(graph)} on {topo.name}"
    _render(rows, title, console)
    console.print("predicted: hulkjax's cost model (roofline compute + alpha-beta communication on "
                  "the topology's links); collectives: read from each plan's compiled HLO "
                  "(AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all, CP "
                  "collective-permute; XLA:CPU emits reduce-scatters as AR + slice)")
    console.print(f"traced, planned{' and compiled' if compile_programs else ''} in "
                  f"{time.perf_counter() - t0:.1f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for r in rows:
            r["plan"].save(os.path.join(args.out, f"{m.name}-{r['strategy']}.json"))
        console.print(f"plans written to {args.out}/")
        if rows:
            _write_plots(rows, f"{m.describe(graph)} on {topo.name}", args.out, console)
    return 0


def _write_plots(rows, title: str, out: str, console) -> None:
    """``comparison.png`` (every strategy) and ``graph.png`` (the best plan) into ``out``."""
    try:
        from hulkjax import viz
    except ImportError as e:  # matplotlib is an optional dependency
        console.print(f"[yellow]no plots ({e}); pip install 'hulkjax[notebooks]' for them[/yellow]")
        return
    plans = {r["strategy"]: r["plan"] for r in rows if r["plan"].cost is not None}
    if not plans:
        return
    fitting = [n for n, p in plans.items() if p.cost.fits] or list(plans)
    best = min(fitting, key=lambda n: plans[n].cost.step_time)
    viz.plot_comparison(plans, title=title, path=os.path.join(out, "comparison.png"))
    viz.plot_graph(plans[best], path=os.path.join(out, "graph.png"),
                   title=f"best plan {best!r}: operator graph coloured by layout; "
                         f"size = predicted time")
    console.print(f"plots written to {out}/comparison.png and {out}/graph.png (best: {best})")


def cmd_plan(args) -> int:
    topo = _topology(args)
    m = _load_model(args)
    plan = api.plan(m.step, *m.args, topology=topo, strategy=args.strategy)
    print(plan.summary())
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    return 0


def cmd_explain(args) -> int:
    topo = _topology(args)
    m = _load_model(args)
    plan = api.plan(m.step, *m.args, topology=topo, strategy=args.strategy)
    kw = {"depth": args.depth, "collapse": not args.no_collapse, "max_rows": args.max_rows}
    if args.format == "rich":
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 200)
        console.print(f"[bold]{m.describe(plan.graph)}[/bold]")
        console.print(explain(plan, fmt="rich", **kw))
    else:
        print(f"{m.describe(plan.graph)}\n")
        print(explain(plan, fmt=args.format, **kw))
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    if args.plot:
        from hulkjax import viz

        viz.plot_graph(plan, path=args.plot)
        print(f"graph plot written to {args.plot}")
    return 0


PLANNER_RUN = {"samples": 360, "val_samples": 24, "epochs": 30}
# What the shipped device-group head trained with (hulkjax/gnn/weights/groups.json).
GROUPS_RUN = {"samples": 112, "val_samples": 24, "test_samples": 24, "epochs": 40}


_EXAMPLES = {
    "train-gnn": """examples:
  hulkjax train-gnn                       # 360 ILP-labelled graphs, 30 epochs (~45 min on 2 cores)
  hulkjax train-gnn --samples 40 --epochs 5 --out /tmp/gnn   # a quick run, weights in /tmp/gnn
  hulkjax train-gnn --head groups         # the device-group head: the staged search over every
                                          # order of 3-4 groups labels its data (see README)
  (use them with strategy="auto" and weights="/tmp/gnn"; labelled graphs are cached in
   $HULKJAX_CACHE or ~/.cache/hulkjax)""",
    "demo": """examples:
  hulkjax demo                        # every strategy, compiled on 16 fake CPU devices (~2 min)
  hulkjax demo --no-compile           # cost model only
  hulkjax demo --strategies dp fsdp ilp --out demo/""",
    "compare": """examples:
  hulkjax compare --model gpt2 --size small --topology dgx-h100 --nodes 2 --no-compile --out cmp/
      writes cmp/gpt2-<strategy>.json, cmp/comparison.png and cmp/graph.png (best plan)
  hulkjax compare --model mlp --size tiny --topology geo --strategies dp fsdp
  hulkjax compare --model mymodels.py:make_step --topology cluster.json""",
    "plan": """examples:
  hulkjax plan --model mlp --size tiny --topology geo --strategy fsdp --out plan.json
  hulkjax plan --model bert --size tiny --topology tpu-v5e --strategy megatron""",
    "explain": """examples:
  hulkjax explain --model gpt2 --size small --topology dgx-h100 --nodes 2 --strategy ilp
  hulkjax explain --model gpt2 --size tiny --topology geo --strategy dp --format markdown > plan.md
  hulkjax explain --model vit --size tiny --strategy fsdp --depth 2 --plot graph.png
  hulkjax explain --model mymodels:make_step --topology cluster.json --strategy dp_tp

--model module:function: a function taking no arguments that returns (step, state, batch);
step(state, batch) -> (state, metrics) is the training step, state and batch pytrees of arrays
or jax.ShapeDtypeStruct. 'module' is imported from the current directory or the Python path;
a path ending in .py is loaded from that file.""",
}


_EXAMPLES["launch"] = """examples:
  # on this machine: plan once, then 2 processes x 4 fake CPU devices (one per node of 'hetero')
  hulkjax launch --model mlp --size tiny --topology hetero --strategy dp megatron --out run/
      writes run/plan-<strategy>.json, run/job.json, run/report.json, run/worker-<i>.err
  hulkjax launch --model mymodels.py:make_step --topology cluster.json --plan plan.json

  # a real cluster: the same command on every host, process ids 0..N-1, coordinator on host 0
  hulkjax launch --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 \\
      --model gpt2 --size small --topology cluster.json --plan plan.json --out run/
  (without --plan, process 0 plans --strategy and sends the plan to the others; on CPU-only
   hosts add --local-devices N)

The topology's devices are split into --processes blocks in device order (region > node >
device): process p holds block p, one process per node or region; its devices must number
processes x local devices. The report holds the predicted step time (plan.cost), the measured
one (median over the steps after the first, slowest process), the losses, the collectives of
the compiled multi-process program, and a check against the unsharded step (process 0, one
device)."""


_EXAMPLES["calibrate"] = """examples:
  hulkjax calibrate --out cal/                      2 processes x 1 device on loopback
  hulkjax calibrate --processes 2 --local-devices 2 --out cal/ --topology-out mine.json
  hulkjax launch --topology cal/topology.json --strategy dp fsdp ...   then plan on it

Measures, with every device of every process working at once: an n x n float32 matmul per
device (FLOP/s), y = a x + b on a large array (memory bandwidth), and gloo all-reduces between
the processes at several sizes (jax.distributed over TCP, as launch jobs run; an alpha-beta fit
gives the link's bandwidth and latency). Writes cal/calibration.json (raw timings and fits) and
cal/topology.json: Topology.grid((processes, local devices), ("proc", "dev")) with the measured
device and links."""


def cmd_calibrate(args) -> int:
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("hulkjax.launch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        topo, rec = calibrate(processes=args.processes, local_devices=args.local_devices,
                              matmul_size=args.matmul_size,
                              memory_bytes=int(args.memory_mb * (1 << 20)),
                              link_bytes=[int(m * (1 << 20)) for m in args.link_mb],
                              repeats=args.repeats, out=args.out, name=args.name,
                              timeout=args.timeout)
    finally:
        logger.removeHandler(handler)
    if args.topology_out:
        topo.save(args.topology_out)
    dev, link = rec["device"], rec["link"]
    print(topo.describe())
    print(f"measured per device: {dev['peak_flops'] / 1e9:.4g} GFLOP/s (float32 matmul "
          f"n={rec['measurements']['matmul']['n']}), memory {format_rate(dev['hbm_bandwidth'])} "
          f"(in place), {dev.get('fresh_page_time', 0.0) * 1e6:.3g} us per fresh 4 KiB page, "
          f"{dev.get('kernel_overhead', 0.0) * 1e6:.3g} us per kernel, both-transposed matmuls at "
          f"{dev.get('transposed_dot_efficiency', 1.0):.3g} of the matmul rate")
    print(f"link between processes: {format_rate(link['bandwidth'])}, latency "
          f"{link['latency'] * 1e6:.4g} us per ring step ({link['method']})")
    print(f"each collective call: {dev.get('collective_overhead', 0.0) * 1e3:.3g} ms fixed cost "
          f"(DeviceSpec.collective_overhead; XLA:CPU makes one call per operand of a combined "
          f"all-reduce)")
    if "local_link" in rec:
        loc = rec["local_link"]
        print(f"link inside a process: {format_rate(loc['bandwidth'])}, latency "
              f"{loc['latency'] * 1e6:.4g} us")
    print(f"written: {rec['run_dir']}/topology.json, {rec['run_dir']}/calibration.json"
          + (f", {args.topology_out}" if args.topology_out else ""))
    return 0


def cmd_launch(args) -> int:
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("hulkjax.launch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    overrides = {} if args.batch is None else {"batch": args.batch}
    try:
        if args.coordinator:
            return _launch_this_host(args, overrides)
        if args.num_processes is not None or args.process_id is not None:
            raise ProcessLayoutError("--num-processes / --process-id run one host of a real "
                                     "cluster and need --coordinator HOST:PORT; on this machine "
                                     "use --processes N.")
        plans = [Plan.load(p) for p in args.plan or ()]
        if plans and args.topology is None:
            topo = plans[0].topology
        else:
            args.topology = args.topology or "hetero"
            topo = _topology(args)
        print(topo.describe())
        processes = args.processes
        if processes is None:  # one per node; per-axis topologies: one per row of the first axis
            processes = topo.shape[0] if topo.axis_links is not None else len(topo.nodes)
        strategies = plans or args.strategy
        report = launch(args.model, topo, strategies=strategies, processes=processes,
                        steps=args.steps, size=args.size, overrides=overrides, seed=args.seed,
                        out=args.out, check=not args.no_check, timeout=args.timeout)
    finally:
        logger.removeHandler(handler)
    _print_launch_report(report)
    return 0 if all(r["check"] is None or r["check"]["match"] for r in report["runs"]) else 1


def _launch_this_host(args, overrides) -> int:
    """Real-cluster mode: run this host's process of the job, then leave without waiting."""
    if args.num_processes is None or args.process_id is None:
        raise ProcessLayoutError(
            f"--coordinator {args.coordinator} runs one host of a real cluster: give "
            f"--num-processes N and --process-id I (0..N-1, 0 on the coordinator's host) too.")
    if not args.plan:
        args.topology = args.topology or "hetero"
    topo = None if args.plan else _topology(args).to_dict()
    job = Job(model=args.model, size=args.size, overrides=overrides, plans=tuple(args.plan or ()),
              strategies=tuple(args.strategy), topology=topo, steps=args.steps, seed=args.seed,
              check=not args.no_check, local_devices=args.local_devices, out=args.out or ".",
              init_timeout=int(args.timeout))
    try:
        report = run_worker(job, coordinator=args.coordinator, num_processes=args.num_processes,
                            process_id=args.process_id)
    except BaseException as e:  # noqa: BLE001 -- JAX's exit-time shutdown barrier would wait for
        # peers that may be gone: report and leave now.
        if isinstance(e, HulkjaxError):
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if isinstance(e, HulkjaxError) else 1)
    import jax

    if report is not None:
        _print_launch_report(report)
        ok = all(r["check"] is None or r["check"]["match"] for r in report["runs"])
    else:
        print(f"process {args.process_id} of {args.num_processes}: done")
        ok = True
    jax.distributed.shutdown()
    return 0 if ok else 1


def _tolerance_words(check: dict) -> str:
    """The check's tolerance in a few words: the measured scale, or the fixed rtol/atol."""
    tol = check.get("tolerance") or {"source": "given", "rtol": check["final_state"]["rtol"],
                                     "atol": check["final_state"]["atol"]}
    if tol["source"] == "float64 reference":
        ratio = max(check["metrics"]["worst_ratio"] or 0.0, check["final_state"]["worst_ratio"] or 0.0)
        return (f"{ratio:.2g}x its tolerance = {tol['safety']:g} x the float32-vs-float64 spread, "
                f"up to {tol['final_state_spread']:.2g}")
    why = f", {tol['reason']}" if tol.get("reason") else ""
    return f"rtol {tol['rtol']:g}, atol {tol['atol']:g}{why}"


def _print_launch_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    lay = report["layout"]
    table = Table(title=f"{report['model']} on {report['topology']['name']}: "
                        f"{lay['processes']} processes x {lay['local_devices']} "
                        f"{report['platform']} devices (one per {lay['level']}; axes crossing "
                        f"processes: {', '.join(lay['process_axes']) or 'none'})")
    for col in ("strategy", "predicted step", "measured step", "losses",
                "collectives (x = crosses processes)", "vs unsharded"):
        table.add_column(col, overflow="fold")
    for r in report["runs"]:
        pred = r["predicted"]
        colls = "\n".join(f"{SHORT_COLLECTIVES.get(c['kind'], c['kind'])} {'+'.join(c['axes']) or '-'}: "
                          f"{c['count']} x, {format_bytes(c['bytes'])}"
                          f"{' x' if c['crosses_processes'] else ''}"
                          for c in r["collectives"]) or "none"
        if r.get("transfers"):  # a staged plan: values sent between its stages' processes
            colls += "".join(f"\nsend p{'+'.join(map(str, t['from_processes']))}->"
                             f"p{'+'.join(map(str, t['to_processes']))}: {t['count']} x, "
                             f"{format_bytes(t['bytes'])} x" for t in r["transfers"])
        if r["check"] is None:
            check = "not checked"
        else:
            c = r["check"]
            err = max(c["metrics"]["max_abs_err"], c["final_state"]["max_abs_err"])
            check = ("[green]match[/green]" if c["match"] else
                     f"[red]MISMATCH[/red]: "
                     f"{', '.join((c['metrics']['mismatched_leaves'] + c['final_state']['mismatched_leaves'])[:3])}")
            check += f" (max err {err:.2g}; {_tolerance_words(c)})"
        losses = " ".join(f"{x:.4g}" for x in r["losses"] if x is not None)
        table.add_row(r["strategy"],
                      "-" if pred is None else f"{pred['step_time'] * 1e3:.3g} ms",
                      f"{r['step_time'] * 1e3:.3g} ms", losses, colls, check)
    console.print(table)
    console.print("predicted: the cost model on the topology's devices and links; measured: wall "
                  "time of one step on these processes (median after the first step, slowest "
                  "process). Fake CPU devices share this machine's cores, so measured times say "
                  "nothing about the topology's speed.")
    if "launcher" in report:
        console.print(f"report, plans and logs written to {report['launcher']['run_dir']}/")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hulkjax", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def parser(name, help_):
        return sub.add_parser(name, help=help_, description=help_, epilog=_EXAMPLES[name],
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def common(sp, model=True):
        if model:
            sp.add_argument("--model", default="gpt2",
                            help="zoo model name, or module:function returning (step, state, "
                                 "batch) (default gpt2)")
            sp.add_argument("--size", default="small", help="zoo size preset (default small)")
        sp.add_argument("--topology", default="dgx-h100",
                        help="preset name (dgx-h100, tpu-v5e, geo, hetero) or topology JSON "
                             "path (default dgx-h100)")
        sp.add_argument("--nodes", type=int, default=None, help="nodes for node-based presets")

    d = parser("demo", "GPT-2 small on 2 DGX-H100 nodes with every strategy")
    common(d, model=False)
    # 16 sequences of 1024 tokens: one per GPU, so every strategy can split the batch evenly.
    d.set_defaults(nodes=2, batch=16)
    d.add_argument("--strategies", nargs="*", default=None)
    d.add_argument("--no-compile", action="store_true", help="plan only")
    d.add_argument("--out", default=None,
                   help="directory for the plan JSON files, comparison.png and graph.png")
    d.set_defaults(func=cmd_demo)

    c = parser("compare", "one plan per strategy for a model: table, JSONs and plots")
    common(c)
    c.add_argument("--batch", type=int, default=None, help="override the model's batch size")
    c.add_argument("--strategies", nargs="*", default=None,
                   help="strategy names (default: every registered strategy)")
    c.add_argument("--no-compile", action="store_true", help="plan only")
    c.add_argument("--out", default=None,
                   help="directory for the plan JSON files, comparison.png and graph.png")
    c.set_defaults(func=cmd_compare)

    pl = parser("plan", "plan one strategy and print its summary")
    common(pl)
    pl.add_argument("--batch", type=int, default=None, help="override the model's batch size")
    pl.add_argument("--strategy", default="dp")
    pl.add_argument("--out", default=None, help="write the plan JSON here")
    pl.set_defaults(func=cmd_plan)

    ex = parser("explain", "explain one plan per layer: layouts, collectives per link class, "
                           "time and memory")
    common(ex)
    ex.add_argument("--batch", type=int, default=None, help="override the model's batch size")
    ex.add_argument("--strategy", default="dp", help="strategy name (default dp)")
    ex.add_argument("--format", choices=("rich", "text", "markdown"), default="rich",
                    help="rich table (default), plain text, or markdown")
    ex.add_argument("--depth", type=int, default=None,
                    help="cut layer names to this many scope components (coarser rows)")
    ex.add_argument("--no-collapse", action="store_true",
                    help="one row per layer, even for repeated identical layers")
    ex.add_argument("--max-rows", type=int, default=None, help="show at most this many rows")
    ex.add_argument("--out", default=None, help="also write the plan JSON here")
    ex.add_argument("--plot", default=None, help="also write the operator-graph plot (PNG) here")
    ex.set_defaults(func=cmd_explain)

    la = parser("launch", "run planned steps as a real multi-process JAX job (one process per "
                          "node or region) and check them against the unsharded step")
    # As common(), with defaults that run in seconds on fake CPU devices.
    la.add_argument("--model", default="mlp",
                    help="zoo model name, or module:function returning (step, state, batch) with "
                         "concrete arrays (default mlp)")
    la.add_argument("--size", default="tiny", help="zoo size preset (default tiny)")
    la.add_argument("--topology", default=None,
                    help="preset name (dgx-h100, tpu-v5e, geo, hetero) or topology JSON path "
                         "(default: the --plan's topology, else hetero: 2 nodes of 4 GPUs)")
    la.add_argument("--nodes", type=int, default=None, help="nodes for node-based presets")
    la.add_argument("--batch", type=int, default=None, help="override the model's batch size")
    la.add_argument("--strategy", nargs="+", default=["dp"],
                    help="one or more strategy names, run one after another in the same job "
                         "(default dp)")
    la.add_argument("--plan", nargs="+", default=None,
                    help="plan JSON file(s) to run instead of planning --strategy")
    la.add_argument("--processes", type=int, default=None,
                    help="processes on this machine (default: one per node of the topology; for "
                         "per-axis topologies one per index of the first mesh axis)")
    la.add_argument("--steps", type=int, default=3, help="timed steps per plan (default 3)")
    la.add_argument("--seed", type=int, default=0, help="zoo init seed (default 0)")
    la.add_argument("--out", default=None,
                    help="directory for report.json, the plan JSONs and worker logs "
                         "(default: a new temporary directory)")
    la.add_argument("--timeout", type=float, default=600.0,
                    help="seconds before the job is stopped (default 600)")
    la.add_argument("--no-check", action="store_true",
                    help="skip the comparison with the unsharded step")
    cl = la.add_argument_group("real cluster: run this host's process only")
    cl.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (the same on every host)")
    cl.add_argument("--num-processes", type=int, default=None, help="processes in the job")
    cl.add_argument("--process-id", type=int, default=None, help="this host's process, 0..N-1")
    cl.add_argument("--local-devices", type=int, default=None,
                    help="fake CPU devices for this process (CPU-only hosts; default: the "
                         "platform's devices)")
    la.set_defaults(func=cmd_launch)

    ca = parser("calibrate", "measure this machine's device throughput, memory bandwidth and "
                             "the link between processes; write a topology JSON with them")
    ca.add_argument("--processes", type=int, default=2, help="processes (default 2)")
    ca.add_argument("--local-devices", type=int, default=1,
                    help="fake CPU devices per process (default 1)")
    ca.add_argument("--matmul-size", type=int, default=1024,
                    help="n of the n x n activations and weights of the dense-layer matmuls")
    ca.add_argument("--memory-mb", type=float, default=64.0,
                    help="MiB per device for the memory bandwidth and the cost of a fresh page "
                         "(default 64: above 32, so fresh buffers are new pages)")
    ca.add_argument("--link-mb", type=float, nargs="+", default=[1.0, 8.0, 32.0],
                    help="all-reduce sizes in MiB the link is fitted on (default 1 8 32)")
    ca.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    ca.add_argument("--name", default="calibrated", help="the topology's name")
    ca.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    ca.add_argument("--topology-out", default=None, help="also write the topology JSON here")
    ca.add_argument("--timeout", type=float, default=600.0)
    ca.set_defaults(func=cmd_calibrate)

    tg = parser("train-gnn", "train the planner network on ILP-labelled graphs, or its "
                "device-group head on the staged search's best orders")
    tg.add_argument("--head", choices=("planner", "groups"), default="planner",
                    help="planner: the layout network (default); groups: the device-group head")

    def both(key: str) -> str:  # a default of each head's run
        return f"default {PLANNER_RUN[key]}; --head groups: {GROUPS_RUN[key]}"

    tg.add_argument("--samples", type=int, default=None,
                    help=f"training graphs ({both('samples')} (model, cluster) pairs)")
    tg.add_argument("--val-samples", type=int, default=None,
                    help=f"held-out graphs ({both('val_samples')})")
    tg.add_argument("--test-samples", type=int, default=None,
                    help=f"--head groups: test (model, cluster) pairs, evaluated once on the "
                         f"weights kept (default {GROUPS_RUN['test_samples']})")
    tg.add_argument("--epochs", type=int, default=None, help=both("epochs"))
    tg.add_argument("--targets", choices=("hard", "soft"), default=None,
                    help="the planner network's targets: hard (default; the ILP's candidate) or "
                         "soft (each candidate weighed by its regret, how much slower the step "
                         "is with it: worse, see benchmarks/GNN_TARGETS.md)")
    tg.add_argument("--seed", type=int, default=0)
    tg.add_argument("--out", default=None,
                    help="directory for the weights (default: the package's shipped weights)")
    tg.set_defaults(func=cmd_train_gnn)
    return p


def cmd_train_gnn(args) -> int:
    defaults = GROUPS_RUN if args.head == "groups" else PLANNER_RUN
    run = train_group_head if args.head == "groups" else train_planner
    if args.head == "groups":
        if args.targets is not None:
            raise InvalidOptionError("--targets is for the planner network (the device-group "
                                     "head's targets are always soft)")
        extra = {"test_samples": (defaults["test_samples"] if args.test_samples is None
                                  else args.test_samples),
                 "command": "hulkjax " + " ".join(
                     a for a in (args.argv or []) if a != args.out and a != "--out")}
    else:
        if args.test_samples is not None:
            raise InvalidOptionError("--test-samples is for --head groups (the planner "
                                     "network's held-out graphs are --val-samples)")
        extra = {"targets": args.targets or "hard"}
    history = run(samples=defaults["samples"] if args.samples is None else args.samples,
                  val_samples=(defaults["val_samples"] if args.val_samples is None
                               else args.val_samples),
                  epochs=defaults["epochs"] if args.epochs is None else args.epochs,
                  seed=args.seed, out_dir=args.out, progress=True, **extra)
    print(f"weights written to {args.out or WEIGHTS_DIR}")
    for key in ("train_loss", "val_loss", "val_argmax_ratio", "val_search_ratio",
                "val_own_regret", "val_head_regret", "val_random_regret"):
        if history.get(key):
            print(f"{key}: {history[key][0]:.4f} -> {history[key][-1]:.4f}")
    for n, metrics in (history.get("test") or {}).items():
        print(f"test, {n} order(s) proposed: " + ", ".join(f"{k} {v:.4f}"
                                                          for k, v in metrics.items()))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a run records it was
    try:
        return args.func(args)
    except HulkjaxError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
