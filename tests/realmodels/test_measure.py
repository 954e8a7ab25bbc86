"""The measurements behind benchmarks/REALMODELS.md and COVERAGE.md, on hand-made inputs."""

import jax
import jax.numpy as jnp
import pytest

import hulkjax as hj
from hulkjax.emit.hlo import Collective
from tests.realmodels.measure import (
    compare_collectives,
    compiled_collectives,
    non_gradient_collectives,
    primitive_census,
    projection_kernels,
)


def _step(params, batch):
    """Kernels reach dots directly, through a transpose (GPT-2's Conv1D) and through a bf16 cast;
    an embedding is gathered, a bias added, a square scale used elementwise only."""

    def loss(p):
        h = jnp.take(p["emb"], batch["ids"], axis=0)                     # gather: not a kernel
        h = h @ p["w1"] + p["b"]
        h = h @ p["w2"].T                                                # transposed kernel
        h = (h.astype(jnp.bfloat16) @ p["w3"].astype(jnp.bfloat16)).astype(jnp.float32)
        return jnp.sum((h * p["scale"][0]) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {}


PARAMS = {"emb": jnp.ones((16, 4)), "w1": jnp.ones((4, 8)), "b": jnp.ones((8,)),
          "w2": jnp.ones((4, 8)), "w3": jnp.ones((4, 4)), "scale": jnp.ones((4, 4))}
BATCH = {"ids": jnp.zeros((8, 3), jnp.int32)}


def test_projection_kernels_follow_casts_and_transposes():
    graph = hj.trace(_step, PARAMS, BATCH)
    assert sorted(p.rsplit("/", 1)[-1] for p in projection_kernels(graph)) == ["w1", "w2", "w3"]


def _collective(kind, nbytes, axes=("data",), shapes=((4, 8),), dtypes=("f32",), trip_count=1):
    return Collective(kind=kind, bytes=nbytes, axes=axes, shapes=shapes, dtypes=dtypes,
                      group_size=2, trip_count=trip_count, in_loop=trip_count != 1)


def test_compiled_collectives_weight_loops_and_drop_scalars():
    table = compiled_collectives([
        _collective("all-reduce", 128), _collective("all-reduce", 128, trip_count=3),
        _collective("all-reduce", 4, shapes=((),)), _collective("all-gather", 256)])
    assert table == {("all-reduce", ("data",)): {"count": 4, "bytes": 512},
                     ("all-gather", ("data",)): {"count": 1, "bytes": 256}}
    with pytest.raises(ValueError, match="unknown trip count"):
        compiled_collectives([_collective("all-reduce", 128, trip_count=None)])


def test_compare_collectives():
    d, m = ("data",), ("model",)
    out = compare_collectives(
        {("all-reduce", d): {"count": 2, "bytes": 1000}, ("all-gather", d): {"count": 1, "bytes": 500},
         ("all-to-all", d): {"count": 1, "bytes": 100}},
        {("all-reduce", d): {"count": 2, "bytes": 1090}, ("all-gather", m): {"count": 1, "bytes": 500},
         ("collective-permute", d): {"count": 1, "bytes": 100}})
    assert (out["all-reduce"]["count_equal"], out["all-reduce"]["bytes_within"]) == (True, True)
    # The same bytes over another axis is a mismatch.
    assert (out["all-gather"]["count_equal"], out["all-gather"]["bytes_within"]) == (False, False)
    assert out["all-to-all"]["compiled"] == {} and not out["all-to-all"]["bytes_within"]
    assert out["collective-permute"]["predicted"] == {}
    over = compare_collectives({("all-reduce", d): {"count": 1, "bytes": 1000}},
                               {("all-reduce", d): {"count": 1, "bytes": 1120}})
    assert not over["all-reduce"]["bytes_within"]


def test_non_gradient_collectives():
    graph = hj.trace(_step, PARAMS, BATCH)
    hlo = [
        # A combined gradient all-reduce: w1's gradient transposed, the loss scalar, and one
        # activation-shaped piece (8 x 3 x 8 floats).
        _collective("all-reduce", (32 + 1 + 192) * 4, shapes=((8, 4), (), (8, 3, 8)),
                    dtypes=("f32", "f32", "f32")),
        # w1's gradient with a unit dimension: still a gradient.
        _collective("all-reduce", 32 * 4, shapes=((8, 1, 4),)),
        _collective("all-reduce", 16 * 4 + 4, shapes=((1, 17),)),  # 68 bytes, no such parameter
        _collective("all-gather", 4096, shapes=((4, 8),)),
    ]
    extra = non_gradient_collectives(hlo, graph)
    assert [(e["kind"], e["shape"], e["bytes"]) for e in extra] == [
        ("all-reduce", [8, 3, 8], 768), ("all-reduce", [1, 17], 68), ("all-gather", [4, 8], 4096)]


def test_parameters_used_through_an_elementwise_op_count_as_parameter_shaped():
    # hulkjax calls `w` optimizer state here (its first use, `1 + w`, keeps its shape), so the
    # gradient all-reduce of a (1 + w) * x norm weight must still be recognized.
    def step(w, x):
        g = jax.grad(lambda w: jnp.sum((1 + w) * x))(w)
        return w - 0.1 * g

    graph = hj.trace(step, jnp.ones((6,)), jnp.ones((8, 6)))
    assert non_gradient_collectives([_collective("all-reduce", 96, shapes=((6,),))], graph) == []


def test_primitive_census_looks_inside_loops():
    def step(w, xs):
        def body(c, x):
            return c + jnp.cumsum(x @ w), None
        return jax.lax.scan(body, jnp.zeros(4), xs)[0]

    census = primitive_census(hj.trace(step, jnp.ones((4, 4)), jnp.ones((3, 4))))
    assert census["scan"]["handling"] == "loop"
    dot = census["dot_general"]
    assert (dot["count"], dot["handling"]) == (1, "leader")
    [(source, n)] = dot["sources"].items()
    assert source.startswith("tests/realmodels/test_measure.py:") and n == 1
    assert census["cumsum"]["handling"] == hj.rules.handling(jax.lax.cumsum_p)


def test_position_bias_gradient_is_a_gradient_reduction():
    # T5's relative position bias: a (buckets, heads) table gathered by batch-free bucket indices,
    # broadcast over the batch into the scores. Its gradient sums the batch away *before* the
    # scatter-add into the table, so data parallelism all-reduces a (heads, q, k) piece inside
    # the combined gradient all-reduce: a gradient reduction, not activation traffic.
    buckets = jnp.asarray((jnp.arange(8)[None, :] - jnp.arange(8)[:, None]) % 4)

    def step(p, x):
        def loss(p):
            bias = jnp.take(p["rel"], buckets, axis=0).transpose(2, 0, 1)    # (heads, q, k)
            h = x @ p["w"]                                                   # (b, q, heads*d)
            q = h.reshape(16, 8, 2, 4).transpose(0, 2, 1, 3)                 # (b, heads, q, d)
            scores = jnp.einsum("bhqd,bhkd->bhqk", q, q) + bias[None]
            return jnp.mean(jax.nn.softmax(scores) ** 2)

        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p))

    params = {"rel": jnp.ones((4, 2)) * 0.1, "w": jnp.ones((8, 8)) * 0.1}
    x = jnp.ones((16, 8, 8))
    graph = hj.trace(step, params, x)
    plan = hj.plan(step, params, x, topology=hj.Topology.grid((8,), ("data",)), strategy="dp",
                   graph=graph)
    sharded = hj.emit(step, plan)
    sharded.compile(params, x)
    hlo = sharded.collectives()
    pieces = [s for c in hlo if c.kind == "all-reduce" for s in c.shapes]
    assert (2, 8, 8) in pieces  # the bias gradient is all-reduced (summed over the batch) ...
    assert non_gradient_collectives(hlo, graph) == []  # ... and counted as a gradient reduction
    # An activation-shaped all-reduce is still activation traffic.
    act = _collective("all-reduce", 16 * 8 * 8 * 4, shapes=((16, 8, 8),))
    assert [e["shape"] for e in non_gradient_collectives([act], graph)] == [[16, 8, 8]]
