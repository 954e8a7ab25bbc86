"""Measure a real GPU for the compute model's calibration (the half of ``benchmarks/gpu.py`` that
needs the accelerator).

Plain JAX only: this script imports neither hulkjax nor anything that needs it, so it runs with
whatever JAX the GPU machine has (hulkjax pins JAX 0.10; prediction happens elsewhere, from the
same model code, in ``benchmarks/gpu.py report``). Every number is the median of timed runs after
warm-up, each run ended by ``block_until_ready``.

What it measures:

* **matmuls**: a jitted chain of ``R`` dependent ``n x n @ n x n`` products (one kernel each, so
  Python dispatch is amortized), bf16 and float32 at JAX's default and highest precision.
* **memory streaming**: ``y = x * a + b`` on float32 arrays from 1 MB to 2 GB (one fused kernel
  that reads and writes every byte).
* **per-kernel floor**: chains of ``R`` dependent tiny kernels (``16 x 16`` matmuls; reduce then
  broadcast), as XLA:GPU launches them (command buffers included).
* **training steps**: every family of ``tests/realmodels/families.py`` at the given sizes (value
  and grad, one adamw update), with XLA's own ``cost_analysis``, the compiled program's
  ``memory_analysis`` (arguments, outputs, aliases, temporaries) and the compiled HLO (kept in a
  tar, so kernel counts can be read off-line).

    python benchmarks/gpu_measure.py --out gpu_measured.json [--hlo hlo.tar]
        [--families gpt2 bert ...] [--sizes small base]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import platform
import statistics
import sys
import tarfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.realmodels import families  # noqa: E402  (plain JAX + the model libraries)


def _median_time(fn, args, repeats: int, warmup: int = 3) -> tuple[float, list[float]]:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def matmuls(sizes, chain: int, repeats: int, dtypes=None) -> list[dict]:
    rows = []
    cases = [("bfloat16", None), ("float32", "default"), ("float32", "highest")]
    cases = [c for c in cases if dtypes is None or c[0] in dtypes]
    for dtype, precision in cases:
        prec = None if precision in (None, "default") else jax.lax.Precision.HIGHEST
        for n in sizes:
            def f(x, w, prec=prec):
                for _ in range(chain):
                    x = jnp.matmul(x, w, precision=prec)
                return x
            key = jax.random.key(n)
            # Scaled in float32 and cast: a NumPy scalar would promote bfloat16 to float32.
            x = (jax.random.normal(key, (n, n)) / np.sqrt(n)).astype(dtype)
            w = (jax.random.normal(jax.random.fold_in(key, 1), (n, n)) / np.sqrt(n)).astype(dtype)
            t, _ = _median_time(jax.jit(f), (x, w), repeats)
            per = t / chain
            rows.append({"dtype": dtype, "precision": precision or "default", "n": n,
                         "chain": chain, "seconds_per_matmul": per,
                         "tflops": 2 * n ** 3 / per / 1e12})
            print(f"matmul {dtype:8s} {precision or 'default':8s} n={n:5d}: "
                  f"{per * 1e6:9.1f} us  {2 * n ** 3 / per / 1e12:7.1f} TFLOP/s", flush=True)
    return rows


def profile_data(compiled, args, steps: int):
    """JAX's profile (``jax.profiler.ProfileData``) of ``steps`` runs of ``compiled``."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        finally:
            jax.profiler.stop_trace()
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
        return ProfileData.from_file(path)


def profile_step(compiled, args, steps: int) -> dict:
    """GPU time per (profiler line, event name) over ``steps`` runs, from JAX's profiler."""
    data = profile_data(compiled, args, steps)
    out = {"steps": steps, "lines": []}
    for plane in data.planes:
        if "GPU" not in plane.name and "gpu" not in plane.name:
            continue
        for line in plane.lines:
            agg: dict[str, list] = {}
            sample = []
            for e in line.events:
                a = agg.setdefault(e.name, [0.0, 0])
                a[0] += e.duration_ns
                a[1] += 1
                if len(sample) < 3:
                    try:
                        sample.append({"name": e.name, "stats": [[str(k), str(v)] for k, v in e.stats]})
                    except Exception:  # noqa: BLE001 (stats are diagnostic only)
                        sample.append({"name": e.name})
            top = sorted(agg.items(), key=lambda kv: -kv[1][0])[:600]
            out["lines"].append({"plane": plane.name, "line": line.name,
                                 "total_ns": sum(v[0] for v in agg.values()),
                                 "events": sum(v[1] for v in agg.values()),
                                 "top": top, "sample": sample})
    return out


def streaming(sizes_mb, repeats: int) -> list[dict]:
    rows = []
    f = jax.jit(lambda x: x * 1.5 + 0.5)
    for mb in sizes_mb:
        n = int(mb * 2 ** 20) // 4
        x = jnp.ones((n,), jnp.float32)
        t, _ = _median_time(f, (x,), repeats)
        moved = 2 * n * 4
        rows.append({"megabytes": mb, "bytes_moved": moved, "seconds": t, "gbps": moved / t / 1e9})
        print(f"stream {mb:7.1f} MB: {t * 1e6:9.1f} us  {moved / t / 1e9:7.1f} GB/s", flush=True)
        del x
    return rows


def kernel_floor(chain: int, repeats: int) -> list[dict]:
    rows = []

    def tiny_matmuls(x, w):
        for _ in range(chain):
            x = x @ w
        return x

    def reduce_broadcast(x):
        for _ in range(chain):
            x = x - x.sum(axis=0, keepdims=True) * 1e-3
        return x

    def single(x):
        return x + 1.0

    x16 = jnp.ones((16, 16), jnp.float32)
    for name, fn, args, kernels in [
        ("tiny matmul chain", tiny_matmuls, (x16, x16 * 0.01), chain),
        ("reduce+broadcast chain", reduce_broadcast, (jnp.ones((64, 64), jnp.float32),), chain),
        ("one tiny kernel (dispatch)", single, (x16,), 1),
    ]:
        jf = jax.jit(fn)
        t, _ = _median_time(jf, args, repeats)
        hlo = jf.lower(*args).compile().as_text()
        rows.append({"case": name, "chain": kernels, "seconds": t, "seconds_per_link": t / kernels,
                     "hlo_kernels": _entry_kernels(hlo)})
        print(f"floor {name:28s}: {t * 1e6:9.1f} us total, {t / kernels * 1e6:7.2f} us per link, "
              f"{_entry_kernels(hlo)} kernels in the HLO", flush=True)
    return rows


_KERNEL_OPS = (" fusion(", " custom-call(", " convolution(", " dot(", " all-reduce(",
               " copy(", " reduce(", " scatter(", " gather(", " sort(", " while(",
               " dynamic-update-slice(", " transpose(")


def _entry_kernels(hlo: str) -> int:
    """Instructions of the entry computation that launch work (a rough kernel count)."""
    count, inside = 0, False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            if any(op in line for op in _KERNEL_OPS):
                count += 1
    return count


def _peak_bytes() -> int | None:
    """The allocator's peak since the process started (a high-water mark over every step run so
    far: it says something of a step only where it rises past the earlier steps')."""
    try:
        return int(jax.devices()[0].memory_stats()["peak_bytes_in_use"])
    except Exception:  # noqa: BLE001 (not every backend keeps allocator statistics)
        return None


def steps(names, sizes, repeats: int, hlo_tar, rows: list, save, profile: int = 0) -> list[dict]:
    """Time every family's step; ``rows`` grows one row per step and ``save()`` runs after each
    (a run cut short keeps what it measured)."""
    for size in sizes:
        for name in names:
            row = {"family": name, "size": size}
            try:
                step, state, batch = families.build(name, size)
                jstep = jax.jit(step)
                compiled = jstep.lower(state, batch).compile()
                hlo = compiled.as_text()
                ca = compiled.cost_analysis()
                ca = ca[0] if isinstance(ca, list) else ca
                t, times = _median_time(compiled, (state, batch), repeats)
                mem = compiled.memory_analysis()
                row.update({
                    "seconds": t, "times": times,
                    "xla_flops": float(ca.get("flops", 0.0)),
                    "xla_bytes_accessed": float(ca.get("bytes accessed", 0.0)),
                    "hlo_kernels": _entry_kernels(hlo),
                    "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
                    "memory": {k: int(getattr(mem, k + "_size_in_bytes", 0)) for k in
                               ("argument", "output", "alias", "temp", "generated_code")},
                    "peak_bytes_in_use": _peak_bytes(),
                    "params": int(sum(np.prod(p.shape) for p in jax.tree.leaves(state["params"]))),
                })
                if profile:
                    try:
                        row["profile"] = profile_step(compiled, (state, batch), profile)
                    except Exception as e:  # noqa: BLE001 (the timing stands without it)
                        row["profile_error"] = f"{type(e).__name__}: {e}"
                if hlo_tar is not None:  # each member compressed: a cut-short tar still reads
                    data = gzip.compress(hlo.encode())
                    info = tarfile.TarInfo(f"{name}-{size}.hlo.txt.gz")
                    info.size = len(data)
                    hlo_tar.addfile(info, io.BytesIO(data))
                print(f"step {name:11s} {size:5s}: {t * 1e3:8.2f} ms  "
                      f"{row['xla_flops'] / t / 1e12:6.1f} TFLOP/s (XLA's count)  "
                      f"{row['hlo_kernels']} kernels", flush=True)
                del step, state, batch, jstep, compiled
            except Exception as e:  # one family failing must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(row)
            save()
            if hlo_tar is not None:
                hlo_tar.fileobj.flush()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hlo", default=None, help="tar of the compiled step HLOs (gzipped members)")
    ap.add_argument("--families", nargs="*", default=[n for n in families.names()
                                                       if n != "mixtral"])
    ap.add_argument("--sizes", nargs="*", default=["small", "base"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--micro", nargs="*", default=["matmuls", "streaming", "floor"])
    ap.add_argument("--matmul-dtypes", nargs="*", default=None)
    ap.add_argument("--profile", type=int, default=0, help="profile this many steps per family")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    result = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(result, flush=True)
    micro = [] if args.skip_micro else args.micro
    if "matmuls" in micro:
        result["matmuls"] = matmuls([256, 512, 1024, 2048, 4096, 8192], 8, args.repeats,
                                    args.matmul_dtypes)
    if "streaming" in micro:
        result["streaming"] = streaming([1, 4, 16, 64, 256, 1024, 2048], args.repeats)
    if "floor" in micro:
        result["kernel_floor"] = kernel_floor(64, args.repeats)
    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    save()
    tar = tarfile.open(args.hlo, "w") if args.hlo else None
    try:
        steps(args.families, args.sizes, args.repeats, tar, result.setdefault("steps", []), save,
              args.profile)
    finally:
        if tar is not None:
            tar.close()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
