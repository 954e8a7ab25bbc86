"""The golden-plan cases: a few zoo models x topologies x every built-in strategy.

``python -m tests.golden.cases`` rewrites ``plans.json`` from the current code. Do that only for a
change that is meant to change plans (a new rule, a cost-model fix), and say so in the commit; a
structural change must leave the file as it is (``tests/golden/test_golden.py``).
"""

from __future__ import annotations

import json
import os
import sys

MODELS = (
    ("mlp", "tiny", {}),
    ("transformer-block", "tiny", {}),
    ("gpt2", "tiny", {}),
    ("gpt2", "tiny", {"scan_layers": True}),
    ("cnn", "tiny", {}),
    ("moe", "tiny", {}),
)
TOPOLOGIES = (
    ("grid-2x4", lambda hj: hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9),
                                             latency=(5e-6, 1e-6))),
    ("dgx-h100x2", lambda hj: hj.Topology.preset("dgx-h100", nodes=2)),
    ("hetero", lambda hj: hj.Topology.preset("hetero")),
)
STRATEGIES = ("replicate", "dp", "fsdp", "megatron", "dp_tp", "ilp", "auto")
# The golden file pins SPMD plans: ``ilp`` and ``auto`` are asked for their SPMD optimum (staged
# plans, which they return where faster, are pinned by tests/strategies/test_stages.py).
OPTIONS = {"ilp": {"stages": False}, "auto": {"stages": False}}
PATH = os.path.join(os.path.dirname(__file__), "plans.json")


def case_id(model: str, size: str, overrides: dict, topo: str) -> str:
    extra = "".join(f"+{k}" for k in sorted(overrides))
    return f"{model}-{size}{extra}@{topo}"


def _spec(s) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in s]


def record(plan) -> dict:
    """What the golden file pins of a plan: every layout and the predicted cost."""
    c = plan.cost
    return {
        "in": [_spec(t.spec) for t in plan.inputs],
        "out": [_spec(t.spec) for t in plan.outputs],
        "operands": sorted([n, k, _spec(s)] for (n, k), s in plan.operand_specs.items()),
        "results": sorted([n, k, _spec(s)] for (n, k), s in plan.result_specs.items()),
        "step_time": c.step_time,
        "compute_time": c.compute_time,
        "comm_time": c.comm_time,
        "peak_memory": c.peak_memory,
    }


def plans_for(model: str, size: str, overrides: dict, topo_name: str) -> dict:
    import hulkjax as hj
    from hulkjax import zoo
    from hulkjax.errors import StrategyNotApplicableError

    m = zoo.get(model, size=size, **overrides)
    topo = dict(TOPOLOGIES)[topo_name](hj)
    graph = hj.trace(m.step, *m.abstract())
    out = {}
    for s in STRATEGIES:
        try:
            p = hj.plan(m.step, *m.abstract(), topology=topo, strategy=s, graph=graph,
                        **OPTIONS.get(s, {}))
        except StrategyNotApplicableError:
            continue
        out[s] = record(p)
    return out


def all_cases():
    for model, size, overrides in MODELS:
        for topo, _ in TOPOLOGIES:
            yield model, size, overrides, topo


def main() -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    data = {}
    for model, size, overrides, topo in all_cases():
        key = case_id(model, size, overrides, topo)
        print(key, file=sys.stderr)
        data[key] = plans_for(model, size, overrides, topo)
    # One line per (case, strategy): every value's layout is pinned, so a plan is long.
    with open(PATH, "w") as f:
        f.write("{\n")
        for i, key in enumerate(sorted(data)):
            f.write(f"{json.dumps(key)}: {{\n")
            strategies = sorted(data[key])
            for j, name in enumerate(strategies):
                sep = "," if j + 1 < len(strategies) else ""
                f.write(f"{json.dumps(name)}: {json.dumps(data[key][name], sort_keys=True)}{sep}\n")
            f.write("}" + ("," if i + 1 < len(data) else "") + "\n")
        f.write("}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
