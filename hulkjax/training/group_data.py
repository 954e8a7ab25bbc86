"""Labels of the device-group head: the staged search over every order of a cluster's groups.

A sample is a (model, cluster) pair: zoo steps with and without a tied embedding (GPT-2 and BERT
tie theirs; LLaMA and a stack of Transformer blocks do not) at random depth, width, batch and
sequence (0.3-7B parameters, 16k-256k tokens per step: smaller steps stay on one group whatever
the order), float32 or bfloat16, with or without remat; clusters of 3-4 device groups
(:data:`MAX_GROUPS`, from ``GROUP_CONFIG``: five groups' 120 orders made labelling too slow for
the shipped run): random sites of H100 / A100 / V100 / T4 GPUs with a random link per pair of
sites (``PairLink``), and the shapes of the presets (``regional``, ``mixed``, ``hetero``,
``dtfm`` US regions) at random sizes and links. For each level of :func:`hulkjax.strategies.stages.device_groups` with 3-4 groups,
the staged search (the baselines' stage plans, no intra-stage ILP) runs along each of the ``G!``
orders alone and along its own orders; a label records, per order, the best step it found and
which group runs each layer unit in that layout.

Labelling is the slow part (a few seconds to a minute per sample on 2 cores): samples are cached
one file each in ``$HULKJAX_CACHE`` (or ``~/.cache/hulkjax``) under ``group-data-v<N>``, so a
run cut short resumes where it stopped.

>>> spec = sample_specs(1, seed=0)[0]
>>> sorted(spec)
['cluster', 'family', 'model']
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from hulkjax import zoo
from hulkjax.gnn.groups import StageGraph
from hulkjax.gnn.weights import GROUP_CONFIG
from hulkjax.strategies import stages
from hulkjax.strategies.auto import stage_graph
from hulkjax.strategies.partition import partition
from hulkjax.topology import Topology
from hulkjax.topology.model import Device, PairLink
from hulkjax.topology.specs import DEVICE_SPECS, LinkSpec
from hulkjax.trace import trace

log = logging.getLogger("hulkjax.training")

FAMILIES = ("gpt2", "llama", "bert", "transformer-block")
"""Model families the head is trained on (held out: third-party code, benchmarks/staged_orders)."""
CLUSTERS = ("pairs",) * 5 + ("mixed", "hetero", "regional", "dtfm")
KINDS = ("H100", "A100", "V100", "T4")
MIN_GROUPS, MAX_GROUPS = GROUP_CONFIG["groups"]
DATA_VERSION = 3  # 3: 3-4 groups, gradients reduced once per step; 2: 16k-256k tokens per step


def cache_dir() -> str:
    """Where labelled samples are kept (``$HULKJAX_CACHE`` or ``~/.cache/hulkjax``)."""
    root = os.environ.get("HULKJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                         "hulkjax"))
    return os.path.join(root, f"group-data-v{DATA_VERSION}")


def _model_spec(family: str, rng: np.random.Generator) -> dict:
    """A model of 0.3-7B parameters over 16k-256k tokens per step: steps heavy enough that
    spreading them over device groups can pay for the links (smaller ones stay on one group,
    whatever the order)."""
    pick = lambda *xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    dtype = pick("float32", "bfloat16")
    if family in ("gpt2", "llama"):
        d = int(pick(1536, 2048, 3072, 4096))
        heads = d // 128
        spec = dict(size="small", n_layers=int(pick(8, 12, 16, 24, 32)), d_model=d,
                    n_heads=heads, seq_len=int(pick(1024, 2048)), batch=int(pick(16, 32, 64)),
                    dtype=dtype, remat=bool(pick(True, False)))
        if family == "gpt2":
            spec["n_positions"] = spec["seq_len"]
        else:
            spec.update(n_kv_heads=int(pick(heads, heads // 4)), d_ff=int(8 * d // 3 // 256 * 256))
        return spec
    if family == "bert":
        d = int(pick(1024, 1536, 2048))
        return dict(size="base", n_layers=int(pick(12, 24)), d_model=d, n_heads=d // 64,
                    d_ff=4 * d, seq_len=512, n_positions=512, batch=int(pick(64, 128, 256)),
                    dtype=dtype)
    if family == "transformer-block":
        d = int(pick(2048, 3072, 4096))
        return dict(size="small", n_layers=int(pick(8, 16)), d_model=d, n_heads=d // 128,
                    d_ff=4 * d, seq_len=int(pick(1024, 2048)), batch=int(pick(16, 32, 64)),
                    dtype=dtype)
    raise ValueError(f"unknown family {family!r}")


def _cluster_spec(kind: str, rng: np.random.Generator) -> dict:
    # 3-5 groups, 5 only where the head is trained on them (5! = 120 orders to label).
    p = np.array([0.35, 0.45, 0.2]) * (np.arange(3, 6) <= MAX_GROUPS)
    G = int(rng.choice([3, 4, 5], p=p / p.sum()))
    gbit = lambda lo=0.5, hi=100.0: float(10 ** rng.uniform(np.log10(lo), np.log10(hi)))  # noqa: E731
    ms = lambda lo=0.5, hi=60.0: float(10 ** rng.uniform(np.log10(lo), np.log10(hi)))  # noqa: E731
    if kind == "pairs":
        return {"kind": kind, "kinds": [str(rng.choice(KINDS)) for _ in range(G)],
                "gpus": int(rng.choice([1, 2, 4])),
                "links": [[gbit(), ms()] for _ in range(G * (G - 1) // 2)]}
    if kind == "mixed":
        kinds = sorted(rng.choice(KINDS, size=G), key=KINDS.index)
        return {"kind": kind, "kinds": [str(k) for k in kinds],
                "gpus": int(rng.choice([2, 4, 8])), "link": [gbit(1, 100), ms(0.005, 1)]}
    if kind == "hetero":
        return {"kind": kind, "kinds": [str(rng.choice(KINDS)) for _ in range(G)],
                "counts": [int(rng.choice([2, 4, 8])) for _ in range(G)],
                "link": [gbit(1, 100), ms(0.005, 1)]}
    if kind == "regional":
        return {"kind": kind, "regions": G, "device": str(rng.choice(KINDS)),
                "gpus": int(rng.choice([2, 4, 8])), "link": [gbit(5, 100), ms(0.5, 10)]}
    if kind == "dtfm":
        return {"kind": kind, "gpus": int(rng.choice([1, 2, 4])),
                "device": str(rng.choice(["V100", "A100"]))}
    raise ValueError(f"unknown cluster kind {kind!r}")


def sample_specs(n: int, *, seed: int = 0, families=FAMILIES, clusters=CLUSTERS) -> list[dict]:
    """``n`` random (model, cluster) specs (JSON-able, deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        fam = str(families[int(rng.integers(len(families)))])
        model = _model_spec(fam, rng)
        cluster = _cluster_spec(str(clusters[int(rng.integers(len(clusters)))]), rng)
        out.append({"family": fam, "model": model, "cluster": cluster})
    return out


def _link(gbit: float, ms: float) -> LinkSpec:
    return LinkSpec(bandwidth=gbit * 1e9 / 8, latency=ms / 1e3)


def make_cluster(spec: dict) -> Topology:
    """The cluster of a spec (see :func:`sample_specs`)."""
    kind = spec["kind"]
    if kind == "pairs":
        G, gpus = len(spec["kinds"]), spec["gpus"]
        devices = tuple(Device(id=r * gpus + k, spec=DEVICE_SPECS[spec["kinds"][r]],
                               region=f"s{r}", node=f"s{r}-n0")
                        for r in range(G) for k in range(gpus))
        pairs = itertools.combinations(range(G), 2)
        links = tuple(PairLink(between=(f"s{a}", f"s{b}"), link=_link(*lk))
                      for (a, b), lk in zip(pairs, spec["links"]))
        axes, shape = (("region", "gpu"), (G, gpus)) if gpus > 1 else (("region",), (G,))
        return Topology(name="sites-" + "-".join(spec["kinds"]), devices=devices,
                        axis_names=axes, shape=shape,
                        node_link=LinkSpec(bandwidth=150e9, latency=1e-6) if gpus > 1 else None,
                        wan_link=_link(1.0, 50.0), links=links)
    if kind == "mixed":
        counts = {k.lower(): spec["kinds"].count(k) for k in KINDS}
        return Topology.preset("mixed", **counts, gpus_per_node=spec["gpus"],
                               inter_node=_link(*spec["link"]))
    if kind == "hetero":
        return Topology.preset("hetero", nodes=list(zip(spec["kinds"], spec["counts"])),
                               inter_node=_link(*spec["link"]))
    if kind == "regional":
        return Topology.preset("regional", regions=spec["regions"], device=spec["device"],
                               gpus_per_node=spec["gpus"], metro=_link(*spec["link"]))
    if kind == "dtfm":
        return Topology.preset("dtfm", case="us-regions", gpus_per_region=spec["gpus"],
                               device=spec["device"])
    raise ValueError(f"unknown cluster kind {kind!r}")


def make_graph(spec: dict):
    """Trace the spec's model abstractly."""
    m = zoo.get(spec["family"], **spec["model"])
    return trace(m.step, *m.abstract())


@dataclass
class Label:
    """The staged search over every order of one level's groups.

    Attributes:
      level: the level of ``device_groups`` (``"region"``, ``"node"``, ``"kind"``).  # str
      graph: the head's features of the step on the level's groups.  # StageGraph
      orders: ``[O, G]`` every order of the groups.  # int array
      steps: ``[O]`` the best step the search finds along each order alone (seconds; ``inf``
        where none fits).  # float array
      assign: ``[O, U]`` the group running each unit in that layout (``-1``: none).  # int array
      own_step: the search along its own orders (:func:`~hulkjax.strategies.stages.chains`).
      own_assign: ``[U]`` its layout's groups per unit.  # int array
      own_orders: ``[K, G]`` its orders.  # int array
    """

    level: str
    graph: StageGraph
    orders: np.ndarray
    steps: np.ndarray
    assign: np.ndarray
    own_step: float
    own_assign: np.ndarray
    own_orders: np.ndarray

    @property
    def best(self) -> float:
        """The best step of every order and of the search's own (the microbatch counts'
        local search can make one order alone worse than the search over several)."""
        return float(min(self.steps.min(), self.own_step))

    def regret(self, orders) -> float:
        """The step along ``orders`` added to the search's own, over the best: the regret of
        an order proposal (each order's step taken alone, so an estimate of the search over
        all of them)."""
        at = {tuple(o): s for o, s in zip(self.orders.tolist(), self.steps)}
        return float(min([self.own_step, *(at[tuple(o)] for o in orders)]) / self.best)


def key(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _assignment(layout, groups, U: int) -> np.ndarray:
    out = np.full(U, -1, np.int64)
    index = {tuple(g): j for j, g in enumerate(groups)}
    for devs, (a, b) in zip(layout.groups, layout.ranges):
        out[a:b] = index[tuple(devs)]
    return out


def label(spec: dict, *, progress=None) -> list[Label]:
    """The labels of a spec: one per level with :data:`MIN_GROUPS`-:data:`MAX_GROUPS` groups
    (none where no staged layout fits)."""
    graph = make_graph(spec)
    topo = make_cluster(spec["cluster"])
    part = partition(graph)
    U = len(part.units)
    out = []
    for level, groups in stages.device_groups(topo).items():
        G = len(groups)
        if not MIN_GROUPS <= G <= MAX_GROUPS or U < 2:
            continue
        sg = stage_graph(part, topo, groups)
        own = stages.search(graph, topo, keep=1, shortlist=12, levels=(level,))
        if not own.layouts:
            continue
        orders = list(itertools.permutations(range(G)))
        steps = np.full(len(orders), np.inf)
        assign = np.full((len(orders), U), -1, np.int64)
        for i, o in enumerate(orders):
            if progress is not None:
                progress(f"{level} order {i + 1}/{len(orders)}")
            res = stages.search(graph, topo, keep=1, shortlist=12, levels=(level,),
                                own_orders=False, propose=lambda *_, o=o: [o])
            if res.layouts:
                steps[i] = res.layouts[0][0]
                assign[i] = _assignment(res.layouts[0][1], groups, U)
        out.append(Label(level=level, graph=sg, orders=np.array(orders, np.int64), steps=steps,
                         assign=assign, own_step=float(own.layouts[0][0]),
                         own_assign=_assignment(own.layouts[0][1], groups, U),
                         own_orders=np.array(stages.chains(topo, groups), np.int64)))
    return out


_ARRAYS = ("orders", "steps", "assign", "own_assign", "own_orders")


def load_or_make(spec: dict, *, directory: str | None = None, progress=None) -> list[Label]:
    """The labels of a spec, from the cache or made (and cached)."""
    directory = directory or cache_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, key(spec) + ".npz")
    if not os.path.exists(path):
        labels = label(spec, progress=progress)
        arrays = {"levels": np.array([lab.level for lab in labels])}
        for i, lab in enumerate(labels):
            arrays.update({f"{i}/{f}": getattr(lab, f) for f in _ARRAYS})
            arrays.update({f"{i}/unit_x": lab.graph.unit_x, f"{i}/group_x": lab.graph.group_x,
                           f"{i}/link_x": lab.graph.link_x,
                           f"{i}/own_step": np.float64(lab.own_step)})
        tmp = path + ".tmp.npz"
        np.savez_compressed(tmp, spec=json.dumps(spec), **arrays)
        os.replace(tmp, path)
        return labels
    z = np.load(path, allow_pickle=False)
    return [Label(level=str(lev),
                  graph=StageGraph(z[f"{i}/unit_x"], z[f"{i}/group_x"], z[f"{i}/link_x"]),
                  own_step=float(z[f"{i}/own_step"]),
                  **{f: z[f"{i}/{f}"] for f in _ARRAYS})
            for i, lev in enumerate(z["levels"].tolist())]
