"""How far correct sharded runs are from the unsharded step, in units of the float32-vs-float64 spread.

``hulkjax launch`` checks a run leaf by leaf against ``SAFETY`` x the spread between a float32 and
a float64 unsharded run of the same step (``hulkjax.launch.arrays``). This script measures the
ratio that factor must cover: for each zoo model (tiny) and strategy on a 2x2 grid of fake CPU
devices in this process, ``steps`` training steps, the largest over leaves of
``|sharded - float32 reference| / max(spread, ULPS ulp)``. Writes
``benchmarks/results/check_tolerance.json`` and prints a table::

    python benchmarks/check_tolerance.py            # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import hulkjax as hj  # noqa: E402
from hulkjax import zoo  # noqa: E402
from hulkjax.launch.arrays import SAFETY, ULPS, tree_spread  # noqa: E402

MODELS = ("gpt2", "bert", "vit", "moe", "transformer-block", "mlp", "cnn")
STRATEGIES = ("dp", "fsdp", "megatron", "dp_tp", "auto")


def _f64(x):
    a = np.asarray(x)
    return a.astype(np.float64) if jax.dtypes.issubdtype(a.dtype, np.floating) else a


def _run(step, state, batch, steps):
    for _ in range(steps):
        state, _ = step(state, batch)
    return jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.asarray, state))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "check_tolerance.json"))
    args = p.parse_args(argv)
    topo = hj.Topology.grid((2, 2), ("a", "b"), bandwidth=(1e9, 1e9), latency=(1e-6, 1e-6))
    mesh = topo.mesh(jax.devices()[:4])
    eps = float(np.finfo(np.float32).eps)
    rows = []
    for name in MODELS:
        m = zoo.get(name, size="tiny")
        state, batch = m.init(seed=0)
        ref = _run(jax.jit(m.step), state, batch, args.steps)
        with jax.enable_x64(True):
            ref64 = _run(jax.jit(m.step), jax.tree_util.tree_map(_f64, state),
                         jax.tree_util.tree_map(_f64, batch), args.steps)
        spread = tree_spread(ref, ref64)
        for strategy in STRATEGIES:
            plan = hj.plan(m.step, state, batch, topology=topo, strategy=strategy)
            got = _run(hj.emit(m.step, plan, mesh=mesh), state, batch, args.steps)
            ratio, err = 0.0, 0.0
            for x, y, s in zip(got, ref, spread):
                x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
                d = float(np.max(np.abs(x - y), initial=0.0))
                scale = max(s, ULPS * eps * float(np.max(np.abs(y), initial=0.0)))
                err = max(err, d)
                ratio = max(ratio, d / scale if scale else (0.0 if d == 0 else float("inf")))
            rows.append({"model": name, "strategy": strategy, "max_abs_err": err,
                         "max_spread": max(spread), "max_ratio": ratio})
            print(f"{name:18s} {strategy:9s} max err {err:9.2e}  spread {max(spread):9.2e}  "
                  f"worst leaf err/spread {ratio:6.2f}")
    worst = max(r["max_ratio"] for r in rows)
    print(f"worst ratio {worst:.2f}; SAFETY = {SAFETY:g}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "safety": SAFETY, "worst_ratio": worst, "rows": rows},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
