"""Scanned against unrolled GPT-2: the predicted step of the same model with its blocks in one
``scan`` and unrolled, per strategy and topology (issue 14, item 2: within ~5% is the target).

Writes ``benchmarks/results/scan_gap.json`` and prints a markdown table. Predictions only (no
device needed); ``ilp`` / ``auto`` are asked for their SPMD plans (``stages=False``).

    python benchmarks/scan_gap.py [--sizes tiny small] [--strategies replicate ilp auto]
"""

from __future__ import annotations

import argparse
import json
import os

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
TOPOLOGIES = {
    "grid-2x4": lambda hj: hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9),
                                            latency=(5e-6, 1e-6)),
    "dgx-h100x2": lambda hj: hj.Topology.preset("dgx-h100", nodes=2),
}


def measure(size: str, topo_name: str, strategies: list[str]) -> list[dict]:
    import hulkjax as hj
    from hulkjax import zoo

    topo = TOPOLOGIES[topo_name](hj)
    steps: dict[tuple[str, bool], float] = {}
    for scan in (False, True):
        m = zoo.get("gpt2", size=size, scan_layers=scan)
        state, batch = m.abstract()
        g = hj.trace(m.step, state, batch)
        for s in strategies:
            opts = {"stages": False} if s in ("ilp", "auto") else {}
            p = hj.plan(m.step, state, batch, topology=topo, strategy=s, graph=g, **opts)
            steps[(s, scan)] = p.cost.step_time
    return [{"model": f"gpt2-{size}", "topology": topo_name, "strategy": s,
             "unrolled_s": steps[(s, False)], "scanned_s": steps[(s, True)],
             "ratio": steps[(s, True)] / steps[(s, False)]} for s in strategies]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--strategies", nargs="+", default=["replicate", "ilp", "auto"])
    args = ap.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    rows = []
    for size in args.sizes:
        for topo in TOPOLOGIES:
            rows.extend(measure(size, topo, args.strategies))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "scan_gap.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| model | topology | strategy | unrolled (ms) | scanned (ms) | scanned / unrolled |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['topology']} | {r['strategy']} | {r['unrolled_s'] * 1e3:.4f} "
              f"| {r['scanned_s'] * 1e3:.4f} | {r['ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
