"""Regression tests for the plans issue 11 measured on third-party model code: each pattern below
is the issue's repro (a fused QKV split, bf16 Dense kernels, a head reshape, a broadcast mask),
planned, emitted, compiled and compared with the unsharded step.

What each used to do: (1) ``split`` had no rule and was all-gathered every layer; (2) megatron
sharded nothing when kernels were cast to bf16; (3) megatron could not follow a split through
``(B, S, H, Dh) -> (B, S, D)``; (4) ``dp`` dropped the batch split at a broadcast mask
(all-to-all + all-gathers).
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import hulkjax as hj
from hulkjax.errors import UnsupportedPrimitiveWarning
from hulkjax.rules.dims import map_dim
from tests.helpers import assert_trees_close

D8 = hj.Topology.grid((8,), ("d",))
MODEL8 = hj.Topology.grid((8,), ("model",))


def _sgd(loss):
    return lambda p, *batch: jax.tree.map(lambda a, g: a - 0.1 * g, p,
                                          jax.grad(loss)(p, *batch))


def _run(step, topology, strategy, *args):
    """``(plan, compiled collectives)`` after checking the sharded step against ``jax.jit``."""
    sharded = hj.hulk_shard(step, topology=topology, strategy=strategy)
    got = sharded(*args)
    assert_trees_close(got, jax.jit(step)(*args), rtol=1e-4, atol=1e-5)
    return sharded.plan, sharded.collectives()


def test_split_of_a_fused_projection_keeps_the_batch_split():
    def loss(w, x):
        q, k, v = jnp.split(x @ w, 3, axis=1)
        return jnp.sum(((q * k + v) @ w[:, :16]) ** 2)

    step = lambda w, x: w - 0.01 * jax.grad(loss)(w, x)  # noqa: E731
    _, collectives = _run(step, D8, "dp", jnp.ones((16, 48)) * 0.1, jnp.ones((64, 16)))
    assert [c.kind for c in collectives] == ["all-reduce"]  # the gradient, nothing gathered


def test_megatron_pairs_columns_and_rows_through_bf16_casts():
    m = nn.Sequential([nn.Dense(64, dtype=jnp.bfloat16), nn.relu, nn.Dense(16, dtype=jnp.bfloat16)])
    x = jnp.ones((32, 16))
    params = m.init(jax.random.key(0), x)
    step = _sgd(lambda p, x: jnp.mean(m.apply(p, x).astype(jnp.float32) ** 2))
    plan = hj.plan(step, params, x, topology=MODEL8, strategy="megatron")
    specs = plan.in_specs[0]["params"]
    assert specs["layers_0"]["kernel"] == P(None, "model")  # column-parallel
    assert specs["layers_2"]["kernel"] == P("model")  # row-parallel


def test_megatron_follows_heads_through_a_reshape_and_back():
    def loss(p, x):
        h = jnp.tanh((x @ p["q"]).reshape(64, 8, 32))  # (B, H, Dh)
        return jnp.mean((h.reshape(64, 256) @ p["o"]) ** 2)

    params = {"q": jnp.full((256, 256), 0.01), "o": jnp.full((256, 256), 0.01)}
    x = jnp.ones((64, 256))
    plan, collectives = _run(_sgd(loss), MODEL8, "megatron", params, x)
    assert plan.in_specs[0] == {"q": P(None, "model"), "o": P("model")}
    assert {c.kind for c in collectives} == {"all-reduce"}  # the row-parallel output, no gather


def test_dp_keeps_the_batch_split_through_a_broadcast_mask():
    def loss(p, x, m):
        scores = jnp.einsum("btd,bsd->bts", x @ p["w"], x)
        return jnp.mean(jax.nn.softmax(scores + (p["rel"][None] + (1.0 - m[:, None, :]) * -1e9)) ** 2)

    params = {"w": jnp.ones((64, 64)) * 0.01, "rel": jnp.zeros((32, 32))}
    for batch in (8, 64):  # B=8 used to all-to-all and all-gather, B=64 not
        _, collectives = _run(_sgd(loss), D8, "dp", params, jnp.ones((batch, 32, 64)),
                              jnp.ones((batch, 32)))
        assert [c.kind for c in collectives] == ["all-reduce"], batch


def test_a_tiled_class_token_has_a_rule_and_keeps_the_splits_it_can():
    """CLIP's vision embeddings (transformers' ``FlaxCLIPVisionEmbeddings``) prepend a class
    token made by ``jnp.tile(class_embedding, (B, 1, 1))``: in JAX 0.10 a ``tile`` primitive,
    which had no rule and was replicated with a warning. A dimension tiled once keeps its layout
    through it, so ``dp`` keeps the batch split (the tiled token is made in place, sliced to each
    device's batch) and a split of a dimension the tile repeats once passes through."""
    def loss(p, x):
        cls = jnp.tile(p["cls"], (x.shape[0], 1, 1))  # (B, 1, D)
        h = jnp.concatenate([cls, x @ p["w"]], axis=1)  # (B, 1 + T, D)
        return jnp.mean(jnp.tanh(h) ** 2)

    params = {"cls": jnp.full((1, 1, 32), 0.1), "w": jnp.full((32, 32), 0.01)}
    x = jnp.ones((16, 8, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        _, collectives = _run(_sgd(loss), D8, "dp", params, x)
    assert [c.kind for c in collectives] == ["all-reduce"]  # the gradients only

    def wide(x):  # (B, D) -> (B, 2 D): the batch is repeated once, the features twice
        return jnp.sum(jnp.tile(x, (1, 2)) ** 2)

    g = hj.trace(lambda x: wide(x), jnp.ones((16, 4)))
    (tile,) = [n for n in g.nodes if n.primitive.name == "tile"]
    assert map_dim(tile, g, 0, 0) == 0 and map_dim(tile, g, 0, 1) is None
