"""Every layout change of a 3-D array on fake CPU meshes: the cost model's collectives against XLA's.

For a ``(16, 32, 64)`` float32 array and a mesh (``2x4``: ``data`` x ``model``; ``2x2x2``:
``data`` x ``fsdp`` x ``model``), every layout that puts each mesh axis on no dimension or on one
of the three (in every order where several share a dimension) is paired with every other one, and
each ordered pair ``src -> dst`` is compiled on the fake CPU devices as the emitter places a
layout change (``x -> constraint(x * 2, dst) + 1``, the input laid out as ``src``;
``tests.helpers.compiled_layout_change``, which ``tests/cost/test_reshard.py`` compiles with):

* direct: the collectives :func:`hulkjax.cost.comm.reshard_comms` predicts (XLA's partitioner's
  ``ReshardNoCache`` replayed) against those of the compiled HLO
  (:func:`hulkjax.emit.hlo.collectives_from_hlo`), equal as a multiset of (kind, mesh axes,
  bytes);
* two steps: where :meth:`hulkjax.cost.CostModel.reshard_via` names an intermediate layout (the
  change through it is cheaper than XLA's own on ``Topology.grid``'s nominal links: 100 GB/s,
  1 us per axis), the change is compiled through the emitter's hooks
  (:func:`hulkjax.emit.spmd.node_hooks` with the path: one constraint per layout) and its
  collectives held against the ones :meth:`~hulkjax.cost.CostModel.reshard` prices, with the
  predicted speed-up of the path over the direct change (direct / path communication time).

Writes ``benchmarks/results/reshard.json`` (every miss and every path) and
``benchmarks/RESHARD.md``. The full 2x4 sweep is 342 pairs (75 s on 2 shared cores); the full
2x2x2 sweep is 11130 (about 4 pairs a second: some 45 minutes), so take a subset of it:
``--limit N`` (the first N pairs, in sorted order) or ``--sample N --seed S`` (a deterministic
random sample), for every mesh, or per mesh as ``MESH:N`` (a sample of N).

    python benchmarks/reshard.py                              # 2x4, every pair
    python benchmarks/reshard.py --mesh 2x4 2x2x2:150         # and a 150-pair sample of 2x2x2
    python benchmarks/reshard.py --mesh 2x2x2 --sample 50 --seed 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

sys.path.insert(0, ROOT)  # the compiling and the commit helpers live in tests/
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from tqdm import tqdm  # noqa: E402

import hulkjax as hj  # noqa: E402
from hulkjax.cost import CostModel  # noqa: E402
from hulkjax.cost.comm import reshard_comms  # noqa: E402
from hulkjax.plan.specs import to_pspec  # noqa: E402
from tests.helpers import compiled_layout_change  # noqa: E402
from tests.realmodels.measure import source_commit  # noqa: E402

JSON_PATH = os.path.join(HERE, "results", "reshard.json")
MD_PATH = os.path.join(HERE, "RESHARD.md")
SHAPE = (16, 32, 64)
DTYPE = "float32"
MESHES = {"2x4": ((2, 4), ("data", "model")), "2x2x2": ((2, 2, 2), ("data", "fsdp", "model"))}
SHOWN = 8  # misses per mesh listed in the markdown (the JSON has all)


def layouts(names, rank: int = len(SHAPE)) -> list[tuple[tuple[str, ...], ...]]:
    """Every spec putting each axis of ``names`` on no dimension or one of ``rank``, in every
    order where several share a dimension; sorted."""
    out = set()
    for place in itertools.product(range(rank + 1), repeat=len(names)):  # 0: on no dimension
        for order in itertools.permutations(names):
            dims: list[list[str]] = [[] for _ in range(rank)]
            for a in order:
                if place[names.index(a)]:
                    dims[place[names.index(a)] - 1].append(a)
            out.add(tuple(tuple(d) for d in dims))
    return sorted(out)


def all_pairs(names) -> list[tuple]:
    """Every ordered pair of distinct layouts, sorted."""
    specs = layouts(names)
    return [(s, d) for s in specs for d in specs if s != d]


def select(pairs: list, limit: int | None = None, sample: int | None = None,
           seed: int = 0) -> list:
    """The first ``limit`` pairs, or a random ``sample`` of them (``random.Random(seed)``, kept
    in sorted order), or all."""
    if sample is not None and sample < len(pairs):
        pairs = sorted(random.Random(seed).sample(pairs, sample))
    if limit is not None:
        pairs = pairs[:limit]
    return pairs


def _key(comms) -> list[tuple]:
    return sorted((c.kind, tuple(c.axes), c.bytes) for c in comms)


def _comms_json(key) -> list:
    return [[k, list(axes), b] for k, axes, b in key]


def _spec_json(spec) -> list:
    return [list(d) for d in spec]


def sweep(mesh_name: str, pairs: list, *, progress: bool = True) -> dict:
    """Compile every pair of ``pairs`` on mesh ``mesh_name`` (a key of :data:`MESHES`) and hold
    the predicted collectives against the compiled ones: the mesh's row of the results."""
    mesh_shape, names = MESHES[mesh_name]
    sizes = dict(zip(names, mesh_shape))
    g = hj.trace(lambda x: x * 2, jnp.ones(SHAPE, jnp.float32))
    cm = CostModel(g, hj.Topology.grid(mesh_shape, names))
    vid = g.inputs[0]
    misses, paths, errors = [], [], []
    agree = 0
    t0 = time.perf_counter()
    bar = tqdm(pairs, desc=f"reshard {mesh_name}", unit="pair", disable=not progress)
    for src, dst in bar:
        try:
            predicted = _key(reshard_comms(SHAPE, DTYPE, src, dst, sizes))
            compiled = compiled_layout_change(mesh_shape, names, SHAPE, to_pspec(src),
                                              to_pspec(dst))
            if predicted == compiled:
                agree += 1
            else:
                misses.append({"src": _spec_json(src), "dst": _spec_json(dst),
                               "predicted": _comms_json(predicted),
                               "compiled": _comms_json(compiled)})
            via = cm.reshard_via(vid, src, dst)
            if via:
                steps = cm.reshard(vid, src, dst)
                direct = cm.reshard(vid, src, dst, direct=True)
                t_path = sum(map(cm.comm_time, steps))
                t_direct = sum(map(cm.comm_time, direct))
                priced = _key(steps)
                got = compiled_layout_change(mesh_shape, names, SHAPE, to_pspec(src),
                                             to_pspec(dst), tuple(map(to_pspec, via)))
                paths.append({"src": _spec_json(src), "dst": _spec_json(dst),
                              "via": [_spec_json(v) for v in via],
                              "priced": _comms_json(priced), "compiled": _comms_json(got),
                              "as_priced": priced == got, "direct_s": t_direct, "path_s": t_path,
                              "speedup": t_direct / t_path if t_path else None})
        except Exception as e:  # recorded, and the sweep goes on
            errors.append({"src": _spec_json(src), "dst": _spec_json(dst),
                           "error": f"{type(e).__name__}: {e}"})
        bar.set_postfix(misses=len(misses), paths=len(paths), errors=len(errors))
    speedups = [p["speedup"] for p in paths if p["speedup"] is not None]
    return {
        "mesh": mesh_name, "mesh_shape": list(mesh_shape), "axes": list(names),
        "shape": list(SHAPE), "dtype": DTYPE, "pairs": len(pairs), "direct_agree": agree,
        "direct_misses": len(misses), "errors": len(errors), "paths": len(paths),
        "paths_as_priced": sum(p["as_priced"] for p in paths),
        "path_speedup_median": statistics.median(speedups) if speedups else None,
        "path_speedup_max": max(speedups) if speedups else None,
        "seconds": time.perf_counter() - t0,
        "misses": misses, "path_cases": paths, "error_cases": errors,
    }


def _spec_str(spec) -> str:
    return str(to_pspec(tuple(tuple(d) for d in spec))).removeprefix("PartitionSpec")


def _comms_str(comms) -> str:
    if not comms:
        return "none"
    return ", ".join(f"{k} {'/'.join(axes)} {b} B" for k, axes, b in comms)


def markdown(result: dict) -> str:
    out = ["# Layout changes: predicted against compiled collectives", "",
           f"Generated by `{result['command']}` at commit {result['commit']} (jax "
           f"{result['jax']}; see the script's docstring for the method). Every ordered pair of "
           f"layouts of a {tuple(result['rows'][0]['shape']) if result['rows'] else SHAPE} "
           "float32 array (each mesh axis on no dimension or one of the three, in every order) "
           "compiled on fake CPU devices. *Direct agree*: the collectives "
           "`reshard_comms` predicts equal the compiled HLO's as a multiset of (kind, mesh axes, "
           "bytes). *Two-step paths*: pairs where `CostModel.reshard_via` names an intermediate "
           "layout (cheaper than XLA's own change on `Topology.grid`'s nominal links); *as "
           "priced*: the change compiled through the emitter's constraints (`node_hooks` with the "
           "path) makes exactly the collectives `CostModel.reshard` prices. Speed-up: the "
           "predicted communication time of the direct change over the path's.", "",
           "| mesh | pairs | direct agree | misses | errors | two-step paths | as priced | "
           "median speed-up | max speed-up | seconds |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        med, mx = r["path_speedup_median"], r["path_speedup_max"]
        out.append(f"| {r['mesh']} ({' x '.join(r['axes'])}){r['subset'] and ', ' + r['subset']} "
                   f"| {r['pairs']} | {r['direct_agree']} | {r['direct_misses']} | {r['errors']} "
                   f"| {r['paths']} | {r['paths_as_priced']} | "
                   f"{'-' if med is None else f'{med:.2f}x'} | "
                   f"{'-' if mx is None else f'{mx:.2f}x'} | {r['seconds']:.0f} |")
    for r in result["rows"]:
        if r["misses"]:
            out += ["", f"## Direct misses on {r['mesh']} (first {min(SHOWN, len(r['misses']))} "
                    f"of {len(r['misses'])}; all in the JSON)", "",
                    "| src | dst | predicted | compiled |", "|---|---|---|---|"]
            out += [f"| {_spec_str(m['src'])} | {_spec_str(m['dst'])} | "
                    f"{_comms_str(m['predicted'])} | {_comms_str(m['compiled'])} |"
                    for m in r["misses"][:SHOWN]]
        bad = [p for p in r["path_cases"] if not p["as_priced"]]
        if bad:
            out += ["", f"## Paths not compiled as priced on {r['mesh']} (first "
                    f"{min(SHOWN, len(bad))} of {len(bad)})", "",
                    "| src | via | dst | priced | compiled |", "|---|---|---|---|---|"]
            out += [f"| {_spec_str(p['src'])} | {', '.join(map(_spec_str, p['via']))} | "
                    f"{_spec_str(p['dst'])} | {_comms_str(p['priced'])} | "
                    f"{_comms_str(p['compiled'])} |" for p in bad[:SHOWN]]
        if r["error_cases"]:
            out += ["", f"## Errors on {r['mesh']}", ""]
            out += [f"- {_spec_str(e['src'])} -> {_spec_str(e['dst'])}: {e['error']}"
                    for e in r["error_cases"][:SHOWN]]
        best = sorted((p for p in r["path_cases"] if p["speedup"] is not None),
                      key=lambda p: -p["speedup"])[:SHOWN]
        if best:
            out += ["", f"## Largest predicted speed-ups of a path on {r['mesh']}", "",
                    "| src | via | dst | direct (us) | path (us) | speed-up | path collectives |",
                    "|---|---|---|---:|---:|---:|---|"]
            out += [f"| {_spec_str(p['src'])} | {', '.join(map(_spec_str, p['via']))} | "
                    f"{_spec_str(p['dst'])} | {p['direct_s'] * 1e6:.2f} | "
                    f"{p['path_s'] * 1e6:.2f} | {p['speedup']:.2f}x | "
                    f"{_comms_str(p['priced'])} |" for p in best]
    return "\n".join(out) + "\n"


def _mesh_arg(text: str) -> tuple[str, int | None]:
    name, _, n = text.partition(":")
    if name not in MESHES or (n and not n.isdigit()):
        raise argparse.ArgumentTypeError(
            f"{text!r}: one of {', '.join(MESHES)}, optionally ':N' (a sample of N pairs)")
    return name, int(n) if n else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", nargs="+", type=_mesh_arg, default=[("2x4", None)],
                    metavar="MESH[:N]", help=f"meshes ({', '.join(MESHES)}); MESH:N samples N "
                    "of its pairs (--seed)")
    ap.add_argument("--limit", type=int, help="the first N pairs of each mesh")
    ap.add_argument("--sample", type=int, help="a random sample of N pairs of each mesh")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--out", default=JSON_PATH)
    ap.add_argument("--md", default=MD_PATH)
    args = ap.parse_args(argv)
    rows = []
    for name, n in args.mesh:
        every = all_pairs(MESHES[name][1])
        sample = n if n is not None else args.sample
        pairs = select(every, args.limit, sample, args.seed)
        row = sweep(name, pairs)
        parts = ([f"random sample (seed {args.seed})"] if sample is not None
                 and sample < len(every) else []) + (
            [f"first {args.limit}"] if args.limit is not None and args.limit < len(every) else [])
        row["of_pairs"] = len(every)
        row["subset"] = f"{' and '.join(parts)} of {len(every)} pairs" if parts else ""
        rows.append(row)
        print(f"{name}: {row['direct_agree']}/{row['pairs']} direct changes as predicted, "
              f"{row['errors']} errors; {row['paths']} two-step paths, "
              f"{row['paths_as_priced']} compiled as priced; {row['seconds']:.0f} s", flush=True)
    command = " ".join(["python benchmarks/reshard.py",
                        *(argv if argv is not None else sys.argv[1:])])
    result = {"command": command, "commit": source_commit(ROOT), "jax": jax.__version__,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    with open(args.md, "w") as f:
        f.write(markdown(result))


if __name__ == "__main__":
    main()
