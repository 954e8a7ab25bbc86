"""``megatron`` on the patterns of third-party models that used to leave projections replicated
(issue 11: "megatron shards every dense and attention projection"), each a small step planned,
emitted and compared with the unsharded step.

What each used to do: (1) T5's relative position bias (an embedding gathered per head and added to
the scores) stopped the head split at its gradient's ``scatter-add``: q/k/v/o replicated; (2) a
ViT's patch-embedding convolution was split column-parallel with nothing to close it, so the
residual stream was split on the hidden size and every later projection went row-parallel or
replicated; (3) multi-query attention (Gemma: one key/value head shared by all query heads)
rejected the query's head split at the backward sum over the shared head; (4) a mixture of
experts' (experts, D, F) kernels were tried on the experts only, rejected, and left replicated.
The router (its result goes through ``top_k``) and the single key/value head stay replicated, as
in Megatron-LM.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import hulkjax as hj
from hulkjax.strategies.layouts import tensor_parallel
from hulkjax.strategies.specbuilder import SpecBuilder
from tests.helpers import TWO_D_TOPOLOGY, assert_trees_close

MODEL8 = hj.Topology.grid((8,), ("model",))
B, T, D, H = 4, 8, 64, 8
DH = D // H


def _sgd(loss):
    return lambda p, *batch: jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, *batch))


def _check(step, plan, *args, mesh=None):
    """The emitted step equals ``jax.jit(step)``."""
    assert_trees_close(hj.emit(step, plan, mesh=mesh)(*args), jax.jit(step)(*args), rtol=1e-4,
                       atol=1e-6)


def _params(shapes: dict, seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {n: 0.1 * jax.random.normal(k, s) for k, (n, s) in zip(keys, shapes.items())}


def _attention(q, k, v, bias=None):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if bias is not None:
        scores = scores + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(B, T, D)


def _layer_norm(h):
    mu = h.mean(-1, keepdims=True)
    return (h - mu) * lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-6)


def test_t5_relative_position_bias_keeps_the_head_split():
    def loss(p, x):
        q, k, v = ((x @ p[n]).reshape(B, T, H, DH) for n in ("q", "k", "v"))
        pos = jnp.arange(T)
        buckets = jnp.clip(pos[None, :] - pos[:, None] + 4, 0, 7)  # (T, T) bucket per pair
        bias = jnp.transpose(p["rel"][buckets], (2, 0, 1))[None]  # gather -> (1, H, T, T)
        return jnp.mean((_attention(q, k, v, bias) @ p["o"]) ** 2)

    params = _params({"q": (D, D), "k": (D, D), "v": (D, D), "o": (D, D), "rel": (8, H)})
    x = jnp.ones((B, T, D))
    step = _sgd(loss)
    plan = hj.plan(step, params, x, topology=MODEL8, strategy="megatron")
    specs = plan.in_specs[0]
    assert [specs[n] for n in ("q", "k", "v", "o")] == [P(None, "model")] * 3 + [P("model")]
    _check(step, plan, params, x)


def test_vit_patch_embedding_is_not_split_ahead_of_layer_norm():
    def loss(p, img):
        h = lax.conv_general_dilated(img, p["patch"], (4, 4), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = _layer_norm(h.reshape(B, 4, D))
        return jnp.mean((jax.nn.gelu(h @ p["fc1"]) @ p["fc2"]) ** 2)

    params = _params({"patch": (4, 4, 3, D), "fc1": (D, 2 * D), "fc2": (2 * D, D)})
    img = jnp.ones((B, 8, 8, 3))
    step = _sgd(loss)
    plan = hj.plan(step, params, img, topology=MODEL8, strategy="megatron")
    specs = plan.in_specs[0]
    assert specs["patch"] == P()  # LayerNorm would reduce over the split features
    assert (specs["fc1"], specs["fc2"]) == (P(None, "model"), P("model"))  # the row pair
    assert any("patch: kept replicated" in n and "reduce" in n for n in plan.notes)
    _check(step, plan, params, img)


def test_multi_query_attention_splits_the_query_heads():
    def loss(p, x):
        q = (x @ p["q"]).reshape(B, T, H, DH)
        k, v = (jnp.repeat((x @ p[n]).reshape(B, T, 1, DH), H, axis=2) for n in ("k", "v"))
        return jnp.mean((_attention(q, k, v) @ p["o"]) ** 2)

    params = _params({"q": (D, D), "k": (D, DH), "v": (D, DH), "o": (D, D)})
    x = jnp.ones((B, T, D))
    step = _sgd(loss)
    plan = hj.plan(step, params, x, topology=MODEL8, strategy="megatron")
    specs = plan.in_specs[0]
    assert (specs["q"], specs["o"]) == (P(None, "model"), P("model"))
    assert (specs["k"], specs["v"]) == (P(), P())  # one shared head: replicated (Megatron-LM too)
    _check(step, plan, params, x)


def test_mixture_of_experts_splits_each_experts_hidden_size():
    E, F, N = 4, 64, B * T

    def loss(p, x):
        probs = jax.nn.softmax(x @ p["router"], axis=-1)  # (N, E)
        top_p, top_i = lax.top_k(probs, 2)
        routing = (jax.nn.one_hot(top_i, E) * top_p[..., None]).sum(1).T  # (E, N)
        h = jax.nn.silu(jnp.einsum("edf,nd->efn", p["gate"], x))
        h = h * jnp.einsum("edf,nd->efn", p["up"], x)
        y = jnp.einsum("efn,efd->end", h, p["down"])  # (E, N, D)
        return jnp.mean((y * routing[:, :, None]).sum(0) ** 2)

    params = _params({"router": (D, E), "gate": (E, D, F), "up": (E, D, F), "down": (E, F, D)})
    x = jax.random.normal(jax.random.key(1), (N, D))
    step = _sgd(loss)
    plan = hj.plan(step, params, x, topology=TWO_D_TOPOLOGY, strategy="megatron")
    specs = plan.in_specs[0]
    both = ("data", "model")
    # F divides all 8 devices, the 4 experts only the model axis: each expert's FFN is split.
    assert specs["gate"] == specs["up"] == P(None, None, both)
    assert specs["down"] == P(None, both)
    assert specs["router"] == P()  # top_k over the experts: replicated, as in Megatron-LM
    assert any("router: kept replicated" in n and "top_k" in n for n in plan.notes)
    _check(step, plan, params, x)


def test_vocab_parallel_lm_head_with_a_tied_embedding():
    V = 256

    def loss(p, tokens):
        h = jnp.tanh(p["emb"][tokens] * p["scale"])  # (B, T, D): the lookup of a tied embedding
        logits = h @ p["emb"].T  # (B, T, V)
        logz = jax.nn.logsumexp(logits, axis=-1)
        label = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
        return jnp.mean(logz - label)

    params = _params({"emb": (V, D), "scale": (D,)})
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    step = _sgd(loss)
    graph = hj.trace(step, params, tokens)
    emb = next(i for i, p in enumerate(graph.input_paths) if p.endswith("emb"))
    off = SpecBuilder(graph, MODEL8, "megatron")
    tensor_parallel(off, ("model",), vocab_parallel=False)
    assert off.input_specs[emb] == P()
    assert any("emb: kept replicated" in n and "vocab-parallel" in n for n in off.notes)
    # On by default: a masked lookup, a split LM head, the cross-entropy's reductions.
    plan = hj.plan(step, params, tokens, topology=MODEL8, strategy="megatron", graph=graph)
    assert plan.in_specs[0]["emb"] == P("model")
    _check(step, plan, params, tokens, mesh=MODEL8.mesh())
    # The log-sum-exp's max and sum over the split vocabulary are all-reduced partial results:
    # no device gathers the (B, T, V) logits (the max gathered them before it was a partial).
    sharded = hj.emit(step, plan, mesh=MODEL8.mesh())
    sharded.compile(params, tokens)
    gathered = [c for c in sharded.collectives() if c.kind == "all-gather"]
    assert not gathered, gathered
