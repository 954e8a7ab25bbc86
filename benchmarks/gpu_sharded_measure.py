"""Compile and run hulkjax's sharded programs for 8 GPUs on one real GPU (the half of
``benchmarks/gpu_sharded.py`` that needs the accelerator).

Plain JAX only, like ``gpu_measure.py``: it runs with whatever JAX the GPU machine has. The
programs come from ``gpu_sharded.py export``: each a ``jax.export`` serialization of the program
``hj.emit`` compiles for one plan (its in/out shardings and every with_sharding_constraint), lowered
for CUDA on an 8-device mesh.

XLA:GPU compiles them here for 8 GPUs although the machine has one: JAX's
``jax_mock_gpu_topology`` ("1x8x1": one slice of 8 hosts with one GPU each) makes the GPU client
report 8 devices, one of them local, and run its collectives with a mock communicator
(``enable_mock_nccl``). The compiled program is the one 8 real GPUs would run: the SPMD partitioner's
collectives, the combiners' merges, the async start/done pairs and the latency-hiding scheduler's
order. Running it times the local device's compute; what a mocked collective costs is measured
too (``mock_collectives``), so that the timing can be read.

Each half runs in a child process with a timeout, so that a wait that never ends loses nothing
already written: first a probe (:data:`PROBES`: a tiny sharded program under each XLA flag set,
native stacks dumped where one hangs), then every program is compiled from abstract arguments
(no buffer made) with the first flag set that compiled, then each is run. With XLA's defaults
the compile never ends (2026-11-27: nothing compiled in 165 s; 2026-11-28, the probe's native
stack: ``xla::InMemoryKeyValueStore::Get`` in ``xla::gpu::ConfigAssignerPass``, sharded
autotuning waiting for the 7 mocked processes); ``--xla_gpu_shard_autotuning=false`` compiles.

For every program it records: compile time, ``compiled.as_text()`` (the scheduled HLO, gzipped in
the output tar), ``memory_analysis``, the median step time after warm-up, and one profiled step's
GPU events with their start and end (so the report can see what ran while a collective was in
flight).

    python benchmarks/gpu_sharded_measure.py --programs DIR --out OUT [--cpu]

``--cpu`` runs the same flow on 8 CPU devices (a check of this script where no GPU is, not a
measurement).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import tarfile
import tempfile
import time
import traceback


def _setup(cpu: bool):
    """JAX with 8 CPU devices (``cpu``) or the mocked 8-GPU client. ``XLA_FLAGS`` is the
    parent's choice (``PROBES``), set in this child's environment before JAX starts."""
    import jax

    if cpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        jax.config.update("jax_mock_gpu_topology", "1x8x1")
    return jax


PROBES = (
    # Sharded autotuning (on by default) splits autotuning among a job's processes and
    # exchanges the results through the distributed key-value store, where 7 of the 8
    # processes are mocked: the first guess at what the 2026-11-27 attempts waited for.
    ("shard-autotuning-off", "--xla_gpu_shard_autotuning=false"),
    ("default", ""),
    ("autotuning-off", "--xla_gpu_shard_autotuning=false --xla_gpu_autotune_level=0"),
)
"""XLA flag sets tried, in order, on a tiny sharded program (a matmul whose batch is split over
the 8 devices, then a sum: one GEMM, one all-reduce) before any of hulkjax's programs: each in a
child process with a timeout, which records how far it got (client, lower, compile, run) and,
where it times out, its threads' native stacks (``py-spy dump --native``, where py-spy is
installed). The programs are compiled with the first set whose tiny program compiled; they are
run only if its tiny program also ran."""


def _probe_child(args, jax, work: str) -> None:
    """Client, lower, compile and run a tiny sharded program, writing each phase's time as it
    ends (a child stopped at its timeout keeps how far it got)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    row = {"probe": args.probe, "xla_flags": os.environ.get("XLA_FLAGS", ""), "phases": {}}
    path = os.path.join(work, f"probe-{args.probe}.json")

    def phase(name, t0):
        row["phases"][name] = time.perf_counter() - t0
        with open(path, "w") as f:
            json.dump(row, f)
        print(f"probe {args.probe}: {name} in {row['phases'][name]:.1f} s", flush=True)

    t0 = time.perf_counter()
    devices = jax.devices()
    row["devices"], row["local_devices"] = len(devices), jax.local_device_count()
    phase("client", t0)
    mesh = Mesh(np.array(devices[:8]), ("d",))
    x_sharding, w_sharding = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    f = jax.jit(lambda x, w: jnp.sum(jnp.tanh(x @ w)), in_shardings=(x_sharding, w_sharding),
                out_shardings=NamedSharding(mesh, P()))
    shapes = ((8 * 256, 512), (512, 512))
    t0 = time.perf_counter()
    lowered = f.lower(*(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh)
                        for s, sh in zip(shapes, (x_sharding, w_sharding))))
    phase("lower", t0)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    phase("compile", t0)
    row["collectives"] = sorted({m for m in ("all-reduce-start", "all-reduce", "all-gather")
                                 if m in compiled.as_text()})
    t0 = time.perf_counter()
    arrays = [jax.make_array_from_callback(s, sh, lambda idx, s=s: np.ones(s, jnp.bfloat16)[idx])
              for s, sh in zip(shapes, (x_sharding, w_sharding))]
    jax.block_until_ready(compiled(*arrays))
    phase("run", t0)


def profile_events(fn, args, steps: int = 1) -> list[dict]:
    """Every GPU event of ``steps`` runs: ``{"line", "name", "start_ns", "dur_ns"}`` per event,
    start relative to the first event (from JAX's profiler)."""
    from gpu_measure import profile_data  # this directory

    data = profile_data(fn, args, steps)
    events = []
    for plane in data.planes:
        if "gpu" not in plane.name.lower():
            continue
        for line in plane.lines:
            for e in line.events:
                events.append({"plane": plane.name, "line": line.name, "name": e.name,
                               "start_ns": int(e.start_ns), "dur_ns": int(e.duration_ns)})
    if events:
        t0 = min(e["start_ns"] for e in events)
        for e in events:
            e["start_ns"] -= t0
    return events


def _arrays(jax, exp, mesh, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    shardings = exp.in_shardings_jax(mesh)
    out = []
    for aval, sharding in zip(exp.in_avals, shardings):
        shape, dtype = tuple(aval.shape), aval.dtype
        if np.issubdtype(dtype, np.floating) or str(dtype) == "bfloat16":
            host = (0.02 * rng.standard_normal(shape)).astype(dtype)
        else:
            host = np.zeros(shape, dtype)  # token ids, positions, masks: 0 is valid everywhere
        out.append(jax.make_array_from_callback(shape, sharding, lambda idx, h=host: h[idx]))
    return out


def mock_collectives(jax, repeats: int, sizes_mb=(1, 64)) -> list[dict]:
    """What a collective costs under the mock communicator: an all-reduce and an all-gather of
    1 and 64 MB over the 8 (mocked) devices, each alone in a program, against a copy of the same
    size (the floor of a one-kernel program)."""
    import jax.numpy as jnp
    import numpy as np
    from gpu_measure import _median_time  # this directory: the same timer
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    rows = []
    for mb in sizes_mb:
        n = mb * (1 << 20) // 4
        x = jax.make_array_from_callback((8, n), NamedSharding(mesh, P("d")),
                                         lambda idx, n=n: np.ones((1, n), np.float32))
        programs = {
            "all-reduce": jax.jit(lambda x: jnp.sum(x, axis=0, keepdims=True),
                                  out_shardings=NamedSharding(mesh, P())),
            "all-gather": jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P())),
            "local copy": jax.jit(lambda x: x * 2.0, out_shardings=NamedSharding(mesh, P("d"))),
        }
        for kind, f in programs.items():
            try:
                med, _ = _median_time(f, (x,), repeats, 2)
                rows.append({"kind": kind, "megabytes": mb, "seconds": med})
            except Exception as e:  # noqa: BLE001 (reported, not fatal)
                rows.append({"kind": kind, "megabytes": mb, "error": f"{type(e).__name__}: {e}"})
    return rows


def _mesh(jax, manifest: dict):
    """The programs' mesh over the first 8 devices (mocked but one)."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:8]).reshape(manifest["mesh_shape"]),
                tuple(manifest["axis_names"]))


def _compile_child(args, jax, manifest, work: str) -> None:
    """Compile every program (the scheduled HLO and memory analysis into ``work``)."""
    mesh = _mesh(jax, manifest)
    began = time.perf_counter()
    for entry in _selected(manifest, args.only):
        name = entry["name"]
        if time.perf_counter() - began > args.budget:
            print(f"{name}: skipped (over the --budget of {args.budget:.0f} s)", flush=True)
            continue
        row = {"name": name}
        try:
            fn, exp = _program(jax, args.programs, entry, mesh)
            abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                        for a, s in zip(exp.in_avals, exp.in_shardings_jax(mesh))]
            print(f"{name}: compiling", flush=True)
            t0 = time.perf_counter()
            compiled = fn.lower(*abstract).compile()
            row["compile_seconds"] = time.perf_counter() - t0
            with open(os.path.join(work, f"{name}.hlo.txt.gz"), "wb") as f:
                f.write(gzip.compress(compiled.as_text().encode()))
            try:
                m = compiled.memory_analysis()
                row["memory"] = {k: int(getattr(m, k)) for k in (
                    "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                    "temp_size_in_bytes") if hasattr(m, k)}
            except Exception as e:  # noqa: BLE001
                row["memory_error"] = f"{type(e).__name__}: {e}"
            print(f"{name}: compiled in {row['compile_seconds']:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 (one program's failure is recorded, not fatal)
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        with open(os.path.join(work, f"{name}.compile.json"), "w") as f:
            json.dump(row, f)


def _selected(manifest: dict, only) -> list[dict]:
    """The manifest's programs named in ``only``, in its order (all, in the manifest's order,
    when ``only`` is empty): the first named are compiled first."""
    if not only:
        return list(manifest["programs"])
    by_name = {e["name"]: e for e in manifest["programs"]}
    return [by_name[n] for n in only if n in by_name]


def _run_child(args, jax, manifest, work: str) -> None:
    """Run the compiled programs (from the compilation cache) and time them; then what a mocked
    collective costs. Each program's row is written as soon as it is timed, and again with its
    profile: a child stopped at its timeout keeps what it measured."""
    from gpu_measure import _median_time  # this directory: the same timer

    mesh = _mesh(jax, manifest)
    for entry in manifest["programs"]:
        name = entry["name"]
        if not os.path.exists(os.path.join(work, f"{name}.hlo.txt.gz")):
            continue
        row = {"name": name}

        def save(row=row, name=name):
            with open(os.path.join(work, f"{name}.run.json"), "w") as f:
                json.dump(row, f)

        try:
            fn, exp = _program(jax, args.programs, entry, mesh)
            print(f"{name}: placing the arguments", flush=True)
            arrays = _arrays(jax, exp, mesh, seed=0)
            compiled = fn.lower(*arrays).compile()
            row["seconds"], row["times"] = _median_time(compiled, arrays, args.repeats,
                                                        args.warmup)
            print(f"{name}: step {row['seconds'] * 1e3:.2f} ms", flush=True)
            save()
            if args.profile:
                row["events"] = profile_events(compiled, arrays, 1)
        except Exception as e:  # noqa: BLE001 (one program's failure is recorded, not fatal)
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        save()
    rows = mock_collectives(jax, args.repeats, args.collective_mb)
    with open(os.path.join(work, "mock_collectives.json"), "w") as f:
        json.dump(rows, f)


def _program(jax, folder: str, entry: dict, mesh):
    with open(os.path.join(folder, entry["file"]), "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    fn = jax.jit(exp.call, in_shardings=exp.in_shardings_jax(mesh),
                 out_shardings=exp.out_shardings_jax(mesh))
    return fn, exp


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", required=True, help="the folder gpu_sharded.py export wrote")
    ap.add_argument("--out", required=True, help="output folder (measured.json, hlo.tar, log)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="program names (default: all)")
    ap.add_argument("--budget", type=float, default=1e9,
                    help="start compiling no program after this many seconds")
    ap.add_argument("--compile-timeout", type=float, default=600)
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--profile", action="store_true", help="profile one step of each program")
    ap.add_argument("--collective-mb", type=int, nargs="*", default=[1, 64],
                    help="sizes of the mocked collectives timed alone (MB)")
    ap.add_argument("--cpu", action="store_true", help="8 CPU devices: check the flow, no GPU")
    ap.add_argument("--probe-timeout", type=float, default=60,
                    help="seconds each probe (a tiny sharded program) may take")
    ap.add_argument("--probes", nargs="*", choices=[name for name, _ in PROBES],
                    help="the flag sets to probe, in order (default: all of PROBES)")
    ap.add_argument("--no-run", action="store_true", help="compile only")
    ap.add_argument("--child", choices=("probe", "compile", "run"), help=argparse.SUPPRESS)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    manifest = json.load(open(os.path.join(args.programs, "manifest.json")))
    if args.child:
        import faulthandler

        # A hang prints where Python waits (py-spy, in the parent, reads the native stacks).
        faulthandler.dump_traceback_later(30, repeat=True)
        print(f"{args.child}: starting JAX, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
              flush=True)
        jax = _setup(args.cpu)
        if args.child == "probe":
            _probe_child(args, jax, args.work)
            return
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.work, "cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        info = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                "devices": jax.device_count(), "local_devices": jax.local_device_count()}
        print(f"{args.child}: {info}", flush=True)
        with open(os.path.join(args.work, f"{args.child}.info.json"), "w") as f:
            json.dump(info, f)
        (_compile_child if args.child == "compile" else _run_child)(args, jax, manifest, args.work)
        return
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_sharded_")
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    base_flags = os.environ.get("XLA_FLAGS", "")
    result = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
              "mock_gpu_topology": None if args.cpu else "1x8x1", "children": {},
              "probes": [], "xla_flags": None, "programs": []}
    with open(os.path.join(args.out, "log.txt"), "w") as log:
        def child(kind, limit, flags, *extra):
            env = dict(os.environ, XLA_FLAGS=(base_flags + " " + flags).strip(),
                       PYTHONUNBUFFERED="1")
            return _run_with_timeout([sys.executable, os.path.abspath(__file__), *passthrough,
                                      "--child", kind, "--work", work, *extra], env, limit, log)

        chosen = None
        probes = [p for p in PROBES if p[0] in args.probes] if args.probes else PROBES
        for i, (name, flags) in enumerate(probes[:1] if args.cpu else probes):
            if chosen is not None and i >= 2:
                break  # a set that works, and the default tried beside it
            status = child("probe", args.probe_timeout, flags, "--probe", name)
            path = os.path.join(work, f"probe-{name}.json")
            row = json.load(open(path)) if os.path.exists(path) else {"probe": name}
            row.update(status)
            result["probes"].append(row)
            print(f"probe {name}: {row.get('phases')} {status.get('timed_out_after', '')}",
                  flush=True)
            if chosen is None and "compile" in row.get("phases", {}):
                chosen = row
        if chosen is not None:
            flags = dict(PROBES)[chosen["probe"]]
            result["xla_flags"] = chosen["xla_flags"]
            result["children"]["compile"] = child("compile", args.compile_timeout, flags)
            if args.no_run:
                result["children"]["run"] = {"skipped": "--no-run"}
            elif "run" in chosen["phases"]:
                result["children"]["run"] = child("run", args.run_timeout, flags)
            else:
                result["children"]["run"] = {"skipped": "the probe's tiny program did not run"}
        else:
            result["children"]["compile"] = {"skipped": "no probe's tiny program compiled"}
    for kind in ("compile", "run"):
        path = os.path.join(work, f"{kind}.info.json")
        if os.path.exists(path):
            result.update(json.load(open(path)))
    path = os.path.join(work, "mock_collectives.json")
    result["mock_collectives"] = json.load(open(path)) if os.path.exists(path) else None
    with tarfile.open(os.path.join(args.out, "hlo.tar"), "w") as tar:
        for entry in manifest["programs"]:
            name, row = entry["name"], {"name": entry["name"]}
            for part in ("compile", "run"):
                path = os.path.join(work, f"{name}.{part}.json")
                if os.path.exists(path):
                    row.update(json.load(open(path)))
            hlo = os.path.join(work, f"{name}.hlo.txt.gz")
            if os.path.exists(hlo):
                tar.add(hlo, arcname=f"{name}.hlo.txt.gz")
            if len(row) > 1:
                result["programs"].append(row)
    with open(os.path.join(args.out, "measured.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{len(result['programs'])} programs: {os.path.join(args.out, 'measured.json')}")


def _run_with_timeout(cmd, env, limit: float, log) -> dict:
    """Run a child, its output into ``log``; past ``limit`` seconds, first write its threads'
    native stacks into the log (``py-spy dump --native``, where py-spy is on the PATH or beside
    this Python), then kill it. Returns ``{"returncode"}`` or ``{"timed_out_after"}``, with the
    seconds it took."""
    import shutil
    import subprocess

    t0 = time.perf_counter()
    log.write(f"\n$ {' '.join(cmd[1:])}\n")
    log.flush()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        status = {"returncode": p.wait(timeout=limit)}
    except subprocess.TimeoutExpired:
        status = {"timed_out_after": limit}
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        spy = spy if os.path.exists(spy) else os.environ.get("PY_SPY")
        if spy and os.path.exists(spy):
            log.write(f"\n--- {spy} dump --native --pid {p.pid} ---\n")
            log.flush()
            try:
                subprocess.run([spy, "dump", "--native", "--pid", str(p.pid)], stdout=log,
                               stderr=subprocess.STDOUT, timeout=60)
            except subprocess.TimeoutExpired:
                log.write("(py-spy did not answer in 60 s)\n")
        else:
            log.write("\n(no py-spy: no native stacks)\n")
        p.kill()
        p.wait()
    status["seconds"] = time.perf_counter() - t0
    log.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
