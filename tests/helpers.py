"""Shared test helpers."""

import contextlib
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import hulkjax as hj

# Strategies that make an SPMD plan on any topology (``pipeline`` needs regions or nodes; ``ilp``
# and ``auto`` make SPMD plans on a topology without device groups, as TWO_D_TOPOLOGY).
SPMD_STRATEGIES = [s for s in hj.strategies.names() if s != "pipeline"]

# The 2 x 4 mesh most tests use: a slow "data" axis and a fast "model" axis.
TWO_D_TOPOLOGY = hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9),
                                  latency=(5e-6, 1e-6))


def cpu_regions(*, hbm_bandwidth: float = 2e9, **calibration) -> hj.Topology:
    """Two regions of one CPU-like device (100 GFLOP/s) joined by a slow link (2 MB/s, 0.1 ms),
    the device's calibration numbers (``receive_overhead``, ``fresh_page_time``, ...) given."""
    spec = hj.DeviceSpec(kind="cpu-test", peak_flops=1e11, memory=1e10,
                         hbm_bandwidth=hbm_bandwidth, **calibration)
    return hj.Topology.preset("regional", regions=2, gpus_per_node=1, device=spec,
                              metro=hj.LinkSpec(bandwidth=2e6, latency=1e-4))


def tight_regional(memory: float) -> hj.Topology:
    """Two regions of four V100s of ``memory`` bytes each, a 5 Gbit/s metro link between them:
    where a tiny model stages and memory bends its stages' plans (a few MB: the tiny GPT-2 fits no
    SPMD plan at 2.5 MB)."""
    import dataclasses

    from hulkjax.topology.specs import DEVICE_SPECS

    small = dataclasses.replace(DEVICE_SPECS["V100"], kind=f"V100-{memory / 1e6:g}MB",
                                memory=memory)
    return hj.Topology.preset("regional", regions=2, gpus_per_node=4, device=small,
                              metro=hj.LinkSpec(bandwidth=5e9 / 8, latency=2e-3),
                              intra_node={small.kind: hj.LinkSpec(bandwidth=150e9, latency=5e-6)})


def assert_trees_close(a, b, *, rtol=1e-4, atol=1e-5):
    """Leaf-by-leaf allclose with a message naming the first leaf that differs."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"tree structures differ: {ta} vs {tb}"
    for (path, x), y in zip(la, lb):
        x = np.asarray(x, np.float64)
        y = np.asarray(y, np.float64)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol,
                                   err_msg=f"leaf {jax.tree_util.keystr(path)} differs")


def first_steps(step, state, batch, n=3):
    """``n`` steps of ``step`` starting from ``(state, batch)``; returns the list of (state, metrics)."""
    out = []
    for _ in range(n):
        state, metrics = step(state, batch)
        out.append((state, metrics))
    return out


def assert_steps_match(step, state, batch, refs, compile_count, **tolerance):
    """Run ``step`` from ``(state, batch)`` once per reference ``(state, metrics)`` in ``refs``
    (from :func:`first_steps` of the unsharded step): every step's results match (within
    ``tolerance``: ``rtol`` / ``atol`` of :func:`assert_trees_close`), and no call after the first
    compiles again. Returns the final state."""
    compiles = None
    for ref_state, ref_metrics in refs:
        state, metrics = step(state, batch)
        if compiles is None:
            compiles = compile_count()
        assert_trees_close(metrics, ref_metrics, **tolerance)
        assert_trees_close(state, ref_state, **tolerance)
    assert compile_count() == compiles, "a later call recompiled"
    return state


def zoo_losses_and_state(name: str, steps: int, **cfg):
    """Losses and final state of ``steps`` plain jitted steps of zoo model ``name`` (tiny) in this
    process: the reference a launched job is held against, independent of the job."""
    from hulkjax import zoo

    m = zoo.get(name, size="tiny", **cfg)
    state, batch = m.init(seed=0)
    step = jax.jit(m.step)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.tree_util.tree_map(np.asarray, state)


@contextlib.contextmanager
def benchmark_module(name: str):
    """``benchmarks/<name>.py`` imported as a module for the duration (registered in
    ``sys.modules``, where dataclasses look their module up), then forgotten."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def mlp_step(depth: int, width: int, batch: int):
    """A plain ``depth``-layer tanh MLP trained by SGD: ``(step, weights, batch)``."""

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h ** 2)

        return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]

    ws = [jnp.full((width, width), 0.01, jnp.float32) for _ in range(depth)]
    return step, ws, jnp.ones((batch, width), jnp.float32)



def hlo_collectives(hlo: str, mesh_shape, names) -> list[tuple]:
    """A compiled program's collectives as sorted ``(kind, mesh axes, bytes)``."""
    from hulkjax.emit.hlo import collectives_from_hlo

    return sorted((c.kind, tuple(c.axes), c.bytes)
                  for c in collectives_from_hlo(hlo, tuple(mesh_shape), tuple(names)))


def compiled_layout_change(mesh_shape, names, shape, src, dst, via=()) -> list[tuple]:
    """The collectives XLA compiles for the layout change ``src -> dst`` (PartitionSpecs) of a
    float32 array of ``shape``, made as the emitter makes an operand's (its hooks,
    :func:`hulkjax.emit.spmd.node_hooks`: one constraint per layout of the path ``via``, then
    ``dst``), as :func:`hlo_collectives` lists them."""
    from jax.sharding import AxisType, NamedSharding

    from hulkjax.emit.spmd import node_hooks

    mesh = jax.make_mesh(tuple(mesh_shape), tuple(names),
                         axis_types=(AxisType.Auto,) * len(names))
    on_operand, _, _ = node_hooks(mesh, {(0, 0): dst}, {}, {(0, 0): tuple(via)} if via else None)
    f = jax.jit(lambda x: on_operand(0, 0, x * 2) + 1, in_shardings=NamedSharding(mesh, src),
                out_shardings=NamedSharding(mesh, dst))
    hlo = f.lower(jax.ShapeDtypeStruct(tuple(shape), jnp.float32)).compile().as_text()
    return hlo_collectives(hlo, mesh_shape, names)


def graph_record(g):
    """Everything of a graph that planning reads (the jaxpr aside)."""
    from hulkjax.trace.graph import OpGraph

    assert isinstance(g, OpGraph)
    nodes = [(n.id, n.name, repr(sorted((k, repr(v)) for k, v in n.params.items()
                                        if "jaxpr" not in k)),
              n.inputs, n.outputs, n.flops, n.bytes, n.layer, n.backward, n.trip_count,
              tuple(b.fingerprint() for b in n.subgraphs)) for n in g.nodes]
    values = [(v.id, v.shape, v.dtype, v.producer, v.index, v.name) for v in g.values]
    return (nodes, values, g.inputs, g.outputs, g.input_paths, g.output_paths, g.input_roles,
            g.constants, g.carried, g.owners, g.in_tree, g.out_tree, g.loop_body,
            g.fingerprint(), g.total_flops)
