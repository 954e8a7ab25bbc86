"""Training graphs for the planner network, labelled with ILP-optimal plans and cached on disk.

A sample is a (model, topology) pair drawn from families of zoo models with random sizes (MLPs,
Transformer blocks over depth, width, heads, sequence, batch and dtype (f32 or bf16 kernels);
CNNs; MoE layers; LLaMA-style decoders with grouped-query attention and rotary embeddings) and random
topologies (1-3 mesh axes, bandwidths over four orders of magnitude, latencies from NVLink to WAN,
device kinds from H100 to T4, memory pressure from ample to tight). The label is the ILP's optimal
assignment under the shared cost model, and each candidate's *regret* (:func:`regrets`): how much
slower the step is when that group alone takes it instead, which the optional soft targets of
:mod:`hulkjax.training.train` weigh candidates by (equally good candidates equally: the ILP's
argmax among ties is one of several right answers; they did not help, see there).

>>> spec = sample_specs(1, seed=0)[0]
>>> sorted(spec)
['family', 'model', 'topology']
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from hulkjax import zoo
from hulkjax.errors import InfeasiblePlanError
from hulkjax.gnn.features import JoinedGraph, build
from hulkjax.strategies.baselines import baseline_assignments
from hulkjax.strategies.ilp import solve
from hulkjax.strategies.realize import cost_model
from hulkjax.strategies.search import local_costs, neighbours
from hulkjax.topology import DEVICE_SPECS, DeviceSpec, Topology
from hulkjax.trace import trace

log = logging.getLogger("hulkjax.training")

FAMILIES = ("mlp", "transformer-block", "cnn", "moe", "llama")
HELD_OUT_FAMILIES = ("gpt2", "bert", "vit")
DATA_VERSION = 4  # 2: the combiner-aware cost model, llama and bf16 samples; 3: a layout change
# read by several operators charged once per (value, layout); 4: per-candidate regrets, and
# reduce-scatters priced as XLA makes them on meshes with idle axes


def cache_dir() -> str:
    """Where generated samples are kept (``$HULKJAX_CACHE`` or ``~/.cache/hulkjax``)."""
    root = os.environ.get("HULKJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hulkjax"))
    return os.path.join(root, f"gnn-data-v{DATA_VERSION}")


def _model_spec(family: str, rng: np.random.Generator) -> dict:
    pick = lambda *xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    if family == "mlp":
        w = pick(64, 256, 1024, 4096)
        return dict(size="tiny", depth=int(pick(2, 3, 4, 6)), width=w, in_dim=w, out_dim=w,
                    batch=int(pick(8, 64, 512, 4096, 32768)), optimizer=pick("adamw", "sgd"))
    if family == "transformer-block":
        d = pick(64, 256, 1024)
        return dict(size="tiny", d_model=d, n_heads=int(pick(4, 8)), d_ff=4 * d,
                    n_layers=int(pick(1, 2)), seq_len=int(pick(64, 256, 1024)),
                    batch=int(pick(4, 16, 64)), dtype=pick("float32", "bfloat16"))
    if family == "llama":  # grouped-query attention, rotary embeddings, SwiGLU
        d = pick(64, 128, 256)
        heads = int(pick(4, 8))
        return dict(size="tiny", n_layers=int(pick(1, 2)), d_model=d, n_heads=heads,
                    n_kv_heads=int(pick(1, 2, heads)), d_ff=int(pick(2, 4)) * d,
                    vocab_size=int(pick(256, 1024)), seq_len=int(pick(16, 64)),
                    batch=int(pick(4, 8, 32)), dtype=pick("float32", "bfloat16"))
    if family == "cnn":
        f = int(pick(16, 32, 64))
        return dict(size="tiny", image_size=int(pick(16, 32)), features=(f, 2 * f), dense=4 * f,
                    batch=int(pick(16, 64, 256)))
    if family == "moe":
        d = pick(64, 256, 512)
        return dict(size="tiny", d_model=d, d_ff=4 * d, n_experts=int(pick(4, 8)),
                    n_layers=1, seq_len=int(pick(32, 128)), batch=int(pick(8, 32)),
                    attention=bool(pick(True, False)))
    if family in ("gpt2", "bert"):
        d = pick(64, 128, 256)
        return dict(size="tiny", n_layers=int(pick(1, 2, 3)), d_model=d, n_heads=int(pick(4, 8)),
                    seq_len=int(pick(16, 64)), batch=int(pick(4, 8, 32)))
    if family == "vit":
        d = pick(64, 128)
        return dict(size="tiny", n_layers=int(pick(1, 2)), d_model=d, n_heads=4,
                    batch=int(pick(8, 32)))
    raise ValueError(f"unknown family {family!r}")


def _topology_spec(rng: np.random.Generator, kinds=("grid", "grid", "grid", "dgx", "geo",
                                                     "hetero")) -> dict:
    kind = rng.choice(list(kinds))
    if kind == "tpu":  # held out of training
        return {"preset": "tpu-v5e"}
    if kind == "dgx":
        return {"preset": "dgx-h100", "nodes": int(rng.choice([1, 2]))}
    if kind == "geo":
        return {"preset": "geo", "regions": int(rng.choice([2, 3])), "gpus_per_region": 2}
    if kind == "hetero":
        return {"preset": "hetero"}
    n_axes = int(rng.choice([1, 2, 2, 3]))
    shape = {1: [(8,), (4,), (16,)], 2: [(2, 4), (4, 2), (2, 8), (4, 4)], 3: [(2, 2, 2), (2, 2, 4)]}
    choices = shape[n_axes]
    s = choices[int(rng.integers(len(choices)))]
    bw = [float(10 ** rng.uniform(8, 12)) for _ in s]
    lat = [float(10 ** rng.uniform(-6, -3)) for _ in s]
    device = str(rng.choice(["H100", "A100", "V100", "T4", "TPUv5e"]))
    return {"grid": list(s), "bandwidth": bw, "latency": lat, "device": device,
            "memory_scale": float(rng.choice([1.0, 1.0, 0.1, 0.01]))}


def sample_specs(n: int, *, seed: int = 0, families=FAMILIES, topologies=None) -> list[dict]:
    """``n`` random (model, topology) specs (JSON-able, deterministic for a seed).

    ``topologies`` restricts the topology kinds (``"grid"``, ``"dgx"``, ``"geo"``, ``"hetero"``,
    and ``"tpu"``, which training never sees)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        fam = str(families[int(rng.integers(len(families)))])
        model = _model_spec(fam, rng)
        topo = _topology_spec(rng) if topologies is None else _topology_spec(rng, topologies)
        out.append({"family": fam, "model": model, "topology": topo})
    return out


def make_topology(spec: dict):
    """The spec's topology (a preset, or a grid of scaled device specs)."""
    if "preset" in spec:
        kw = {k: v for k, v in spec.items() if k != "preset"}
        return Topology.preset(spec["preset"], **kw)
    base = DEVICE_SPECS[spec["device"]]
    dev = DeviceSpec(kind=f"{base.kind}", peak_flops=base.peak_flops,
                     memory=base.memory * spec.get("memory_scale", 1.0),
                     hbm_bandwidth=base.hbm_bandwidth)
    names = ("x", "y", "z")[:len(spec["grid"])]
    return Topology.grid(tuple(spec["grid"]), names, bandwidth=tuple(spec["bandwidth"]),
                         latency=tuple(spec["latency"]), device=dev)


def make_graph(spec: dict):
    """Trace the spec's model abstractly."""
    kw = dict(spec["model"])
    if "features" in kw:
        kw["features"] = tuple(kw["features"])
    m = zoo.get(spec["family"], **kw)
    state, batch = m.abstract()
    return trace(m.step, state, batch)


@dataclass
class Sample:
    """One labelled training graph: features, the ILP's choice per group, its objective, and
    every candidate's regret (:func:`regrets`)."""

    spec: dict
    features: object  # JoinedGraph
    label: np.ndarray  # [G] int, candidate index per group
    objective: float
    regret: np.ndarray  # [G, K] float seconds (K: the features' candidates), inf where none


def regrets(cm, assignment, k: int) -> np.ndarray:
    """``[G, k]``: for each group and each of its first ``k`` candidates, the objective with that
    group alone on the candidate, the others on ``assignment``, less the objective at
    ``assignment`` (seconds; :func:`~hulkjax.strategies.search.local_costs`, exact). ``inf``
    where a group has no such candidate, or where the candidate would take the additive memory
    the ILP constrains (:meth:`~hulkjax.cost.model.CostModel.memory`) over the device's
    capacity (over the assignment's own, where that is already over). Below 0 where one group's
    move alone improves on ``assignment`` (repeated layers are tied in the ILP; a move unties
    one)."""
    nb = neighbours(cm)
    total = cm.memory(assignment)
    limit = max(cm.capacity, total)
    out = np.full((len(cm.groups), k), np.inf)
    for grp in cm.groups:
        cands = list(range(min(len(grp.candidates), k)))
        if len(cands) < 2:
            if cands:
                out[grp.id, 0] = 0.0
            continue
        t = local_costs(cm, nb, grp.id, assignment, cands)
        a = assignment[grp.id]
        here = float(t[a]) if a < len(cands) else float(
            local_costs(cm, nb, grp.id, assignment, [a])[0])
        mem = np.array([cm.table(grp.id, c).memory for c in cands])
        own = cm.table(grp.id, assignment[grp.id]).memory
        ok = total - own + mem <= limit * (1 + 1e-9)
        out[grp.id, :len(cands)] = np.where(ok, t - here, np.inf)
    return out


def key(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def label(spec: dict, *, time_limit: float = 30.0):
    """Cost model and ILP solution of a spec (``None`` if infeasible)."""
    g = make_graph(spec)
    topo = make_topology(spec["topology"])
    cm = cost_model(g, topo)
    try:
        res = solve(cm, seeds=list(baseline_assignments(g, topo).values()),
                    time_limit=time_limit)
    except InfeasiblePlanError:
        return cm, None
    return cm, res


def load_or_make(spec: dict, *, directory: str | None = None) -> Sample | None:
    """The sample of a spec, from the cache or generated (and cached)."""
    directory = directory or cache_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, key(spec) + ".npz")
    if os.path.exists(path):
        z = np.load(path, allow_pickle=False)
        if z["label"].size == 0:
            return None
        jg = JoinedGraph(**{f: z[f] for f in JoinedGraph.__dataclass_fields__})
        return Sample(spec, jg, z["label"], float(z["objective"]), z["regret"])
    cm, res = label(spec)
    if res is None:
        np.savez_compressed(path, label=np.zeros(0, np.int32), objective=np.float64(0))
        return None
    jg = build(cm)
    lab = np.array(res.assignment, np.int32)
    reg = regrets(cm, res.assignment, jg.cand_mask.shape[1])
    np.savez_compressed(path, label=lab, objective=np.float64(res.objective), regret=reg,
                        **{f: getattr(jg, f) for f in JoinedGraph.__dataclass_fields__})
    return Sample(spec, jg, lab, res.objective, reg)
