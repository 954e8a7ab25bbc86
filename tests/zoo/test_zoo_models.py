"""Tests of hulkjax.zoo: every model at tiny size runs, learns, and matches its abstract shapes.

Each tiny model is initialised and its step compiled once (``_trained``); the tests share that run.
Large presets are only ever built abstractly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hulkjax as hj
from hulkjax import zoo
from hulkjax.zoo.moe import route

ALL = [
    "mlp",
    "mlp-nnx",
    "transformer-block",
    "transformer-block-nnx",
    "cnn",
    "gpt2",
    "llama",
    "bert",
    "vit",
    "moe",
    "resnet",
]
STEPS = 5


@functools.cache
def _trained(name: str):
    """(model, state0, batch, losses over STEPS jitted steps, final state, last metrics)."""
    m = zoo.get(name, size="tiny")
    state0, batch = m.init(seed=0)
    step = jax.jit(m.step)
    state, losses = state0, []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return m, state0, batch, losses, state, metrics


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


def test_names():
    assert zoo.names() == ALL


def test_unknown_name_lists_valid_names():
    with pytest.raises(hj.errors.UnknownModelError) as info:
        zoo.get("gpt3")
    assert isinstance(info.value, hj.HulkjaxError)
    message = str(info.value)
    assert "'gpt3'" in message and all(name in message for name in ALL)


def test_unknown_size_and_field():
    with pytest.raises(hj.errors.UnknownModelError, match="valid sizes: 'tiny', 'small'"):
        zoo.get("gpt2", size="xxl")
    with pytest.raises(hj.errors.UnknownModelError, match=r"\['n_layer'\].*n_layers"):
        zoo.get("gpt2", n_layer=3)


@pytest.mark.parametrize(
    ("name", "overrides", "match"),
    [
        ("gpt2", dict(n_heads=5), "d_model=64 is not divisible by n_heads=5"),
        ("gpt2", dict(seq_len=128), "seq_len=128 exceeds n_positions=64"),
        ("mlp", dict(dtype="float16"), "dtype='float16'"),
        ("mlp", dict(depth=0), r"MLPConfig.depth=0 must be a positive integer"),
        ("moe", dict(top_k=3), "top_k=3"),
        ("cnn", dict(optimizer="lamb"), "optimizer='lamb'"),
        ("llama", dict(batch=4, microbatches=3), "microbatches=3 must divide batch=4"),
    ],
)
def test_invalid_values(name, overrides, match):
    with pytest.raises(zoo.InvalidModelConfigError, match=match) as info:
        zoo.get(name, size="tiny", **overrides)
    assert isinstance(info.value, hj.HulkjaxError)


def test_config_is_frozen_and_overridable():
    m = zoo.get("gpt2", size="tiny", batch=4, dtype=jnp.bfloat16)
    assert (m.name, m.config.size, m.config.batch, m.config.dtype) == (
        "gpt2",
        "tiny",
        4,
        "bfloat16",
    )
    assert m.config.n_layers == 2  # the rest of the tiny preset
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.config.batch = 2  # type: ignore[misc]
    assert zoo.get("gpt2").config.size == "small"


def test_equal_configs_get_the_same_model_and_its_compiled_programs(compile_count):
    a = zoo.get("mlp", size="tiny", batch=5, width=7)
    assert zoo.get("mlp", batch=5, size="tiny", width=7, depth=a.config.depth) is a
    assert zoo.get("mlp", size="tiny", batch=6, width=7) is not a
    assert zoo.get("mlp-nnx", size="tiny", batch=5, width=7) is not a
    state, batch = a.init(0)
    jax.jit(a.step)(state, batch)
    compiled = compile_count()
    again = zoo.get("mlp", size="tiny", batch=5, width=7)
    jax.jit(again.step)(*again.init(0))
    # both served from JAX's caches (a model built afresh has new functions: they would compile)
    assert compile_count() == compiled


@pytest.mark.parametrize("name", ALL)
def test_tiny_model_trains(name):
    m, state0, batch, losses, state, metrics = _trained(name)
    assert set(state0) >= {"params", "opt_state"}
    # The step keeps the state's structure, shapes and dtypes.
    assert jax.tree.structure(state) == jax.tree.structure(state0)
    assert _shapes(state) == _shapes(state0)
    # Metrics are float32 scalars, loss among them, finite and decreasing on a fixed batch.
    assert "loss" in metrics
    for value in metrics.values():
        assert value.shape == () and value.dtype == jnp.float32
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    # Every batch leaf has the batch on dimension 0.
    for leaf in jax.tree.leaves(batch):
        assert leaf.shape[0] == m.config.batch


@pytest.mark.parametrize("name", ALL)
def test_abstract_matches_init(name):
    m, state0, batch, *_ = _trained(name)
    abstract = m.abstract()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert jax.tree.structure(abstract) == jax.tree.structure((state0, batch))
    assert _shapes(abstract) == _shapes((state0, batch))
    assert m.param_count() == sum(x.size for x in jax.tree.leaves(state0["params"]))


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_init_is_deterministic(name):
    m, state0, batch, *_ = _trained(name)
    again, other = m.init(seed=0), m.init(seed=1)
    for a, b in zip(jax.tree.leaves((state0, batch)), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(
        jax.tree.leaves(state0["params"])[-1], jax.tree.leaves(other[0]["params"])[-1]
    )


def test_mlp_param_count_closed_form():
    for depth, width, d_in, d_out in [(2, 32, 16, 8), (4, 1024, 512, 512), (1, 7, 3, 5)]:
        m = zoo.get("mlp", size="tiny", depth=depth, width=width, in_dim=d_in, out_dim=d_out)
        expected = d_in * width + width + (depth - 1) * (width * width + width)
        expected += width * d_out + d_out
        assert m.param_count() == expected
        assert zoo.get("mlp-nnx", **dataclasses.asdict(m.config)).param_count() == expected


def test_known_parameter_counts():
    # GPT-2 small with tied embeddings and 1024 positions; scanning the layers changes nothing.
    assert zoo.get("gpt2", size="small").param_count() == 124_439_808
    assert zoo.get("gpt2", size="small", scan_layers=True).param_count() == 124_439_808
    assert zoo.get("vit", size="base").param_count() == 86_567_656  # ViT-B/16, 1000 classes
    assert zoo.get("resnet", size="50").param_count() == 25_557_032  # ResNet-50


def test_gpt2_small_traces_abstractly():
    m = zoo.get("gpt2", size="small")
    state, batch = m.abstract()
    assert batch["tokens"].shape == (8, 1024) and batch["tokens"].dtype == jnp.int32
    jaxpr = jax.make_jaxpr(m.step)(state, batch)
    assert len(jaxpr.jaxpr.eqns) > 5000  # unrolled blocks + per-parameter optimizer updates
    # The 1B preset is abstract-only: no parameter is allocated.
    assert 1.2e9 < zoo.get("gpt2", size="1b").param_count() < 1.4e9


def test_gpt2_scan_and_remat():
    m = zoo.get("gpt2", size="tiny", scan_layers=True, remat=True)
    state, batch = m.abstract()
    qkv = state["params"]["h"]["block"]["attn"]["query"]["kernel"]
    assert qkv.shape == (2, 64, 4, 16)  # (layers, d_model, heads, head_dim)
    primitives = {eqn.primitive.name for eqn in jax.make_jaxpr(m.step)(state, batch).jaxpr.eqns}
    assert "scan" in primitives
    plain = zoo.get("gpt2", size="tiny", remat=True)
    primitives = {
        eqn.primitive.name for eqn in jax.make_jaxpr(plain.step)(*plain.abstract()).jaxpr.eqns
    }
    assert "remat2" in primitives or "checkpoint" in primitives


def _stacked(params: dict, prefix: str) -> dict:
    """The unrolled blocks' parameters ``{prefix}_0 .. {prefix}_{n-1}`` stacked on a leading layer
    axis, as ``scan_layers=True`` holds them (``{prefix}/block``); other parameters as they are."""
    layers = sorted(
        (k for k in params if k.startswith(f"{prefix}_")), key=lambda k: int(k[len(prefix) + 1 :])
    )
    out = {k: v for k, v in params.items() if k not in layers}
    out[prefix] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *(params[k] for k in layers))}
    return out


@pytest.mark.parametrize(
    "name, prefix, remat",
    [("gpt2", "h", True), ("llama", "layer", True), ("llama", "layer", False)],
)
def test_scan_layers_matches_unrolled(name, prefix, remat):
    """The scanned model is the unrolled one with its blocks' parameters stacked: the same loss,
    and the same updated parameters after one step (so the same gradients), for the same params."""
    flat = zoo.get(name, size="tiny", remat=remat, optimizer="sgd")
    scanned = zoo.get(name, size="tiny", remat=remat, scan_layers=True, optimizer="sgd")
    state, batch = flat.init(seed=0)
    scan_state = dict(scanned.init(seed=0)[0], params=_stacked(state["params"], prefix))
    assert _shapes(scan_state) == _shapes(scanned.abstract()[0])
    new_flat, metrics_flat = jax.jit(flat.step)(state, batch)
    new_scan, metrics_scan = jax.jit(scanned.step)(scan_state, batch)
    np.testing.assert_allclose(metrics_scan["loss"], metrics_flat["loss"], rtol=1e-5)
    # The updates (learning rate x gradients), compared relative to their own size. An update is
    # a difference of two float32 parameters, known to their ulp (LLaMA's updates are ~1e-8 on
    # weights ~0.05: one ulp is 4e-9), and a gradient that is zero but for rounding (attention's
    # key bias: softmax ignores a shift) is compared to the largest update instead.
    step_scan = jax.tree.map(jnp.subtract, new_scan["params"], scan_state["params"])
    step_flat = _stacked(jax.tree.map(jnp.subtract, new_flat["params"], state["params"]), prefix)
    largest = max(float(np.abs(b).max()) for b in jax.tree.leaves(step_flat))
    for a, b, p in zip(
        jax.tree.leaves(step_scan),
        jax.tree.leaves(step_flat),
        jax.tree.leaves(scan_state["params"]),
        strict=True,
    ):
        ulp = float(np.spacing(np.abs(np.asarray(p)).max().astype(np.float32)))
        atol = 1e-3 * max(float(np.abs(b).max()), 1e-6 * largest) + 2 * ulp
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=atol)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_llama_gradient_accumulation_is_the_whole_batch_step(scan_layers):
    """``microbatches=k``: a scan over k slices of the batch whose mean gradient is the whole
    batch's: the same loss and the same update (float32 rounding apart), and the data-parallel
    plan of it (a scan over microbatches around the layers' scan) splits each microbatch."""
    whole = zoo.get("llama", size="tiny", batch=8, scan_layers=scan_layers, optimizer="sgd")
    accum = zoo.get("llama", size="tiny", batch=8, scan_layers=scan_layers, optimizer="sgd",
                    microbatches=4)
    state, batch = whole.init(seed=0)
    new_whole, m_whole = jax.jit(whole.step)(state, batch)
    new_accum, m_accum = jax.jit(accum.step)(state, batch)
    np.testing.assert_allclose(m_accum["loss"], m_whole["loss"], rtol=1e-5)
    for a, b, p in zip(jax.tree.leaves(new_accum["params"]), jax.tree.leaves(new_whole["params"]),
                       jax.tree.leaves(state["params"]), strict=True):
        np.testing.assert_allclose(a - p, b - p, rtol=1e-3, atol=1e-7)
    plan = hj.plan(accum.step, *accum.abstract(), topology=hj.Topology.grid((2,), ("d",)),
                   strategy="dp")
    assert {t.spec for t in plan.inputs if t.role == "data"} == {jax.sharding.PartitionSpec("d")}
    assert plan.cost.comm_bytes  # the accumulated gradients are reduced over d


@pytest.mark.parametrize("name", ["mlp-nnx", "transformer-block-nnx"])
def test_nnx_state_is_a_pytree_and_traces(name):
    m, state0, *_ = _trained(name)
    assert isinstance(state0["params"], nnx.State)
    jaxpr = jax.make_jaxpr(m.step)(*m.abstract())
    assert len(jaxpr.jaxpr.eqns) > 10


def test_bfloat16():
    m = zoo.get("mlp", size="tiny", dtype="bfloat16")
    state, batch = m.init()
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
    assert batch["x"].dtype == jnp.bfloat16
    new_state, metrics = jax.jit(m.step)(state, batch)
    assert metrics["loss"].dtype == jnp.float32 and np.isfinite(float(metrics["loss"]))
    assert _shapes(new_state) == _shapes(state)


def test_resnet_step_updates_batch_stats():
    _, state0, _, _, state, _ = _trained("resnet")
    before = jax.tree.leaves(state0["batch_stats"])
    after = jax.tree.leaves(state["batch_stats"])
    assert before and any(not np.allclose(a, b) for a, b in zip(before, after))
    assert "batch_stats" not in zoo.get("resnet", size="tiny", norm="group").abstract()[0]


def test_wide_resnet_is_alpas_and_remat_changes_nothing_it_computes():
    """``width_factor`` widens the bottleneck's 3x3 convolution as Alpa's ``wide_resnet.py`` does:
    its benchmark suite's models have the parameter counts its OSDI'22 artifact logs
    (``osdi22_artifact/results_e2e_ref.tsv``, in billions: 0.2541 for "250M", width 160 x 2;
    13.2671 for "13B", width 320 x 32) to 0.1%. ``remat`` (each block rematerialized) leaves the
    step's loss, parameters and batch statistics as they are."""
    for width, factor, alpa in ((160, 2, 0.2541), (320, 16, 6.7277), (320, 32, 13.2671)):
        n = zoo.get("resnet", size="50", width=width, width_factor=factor).param_count()
        assert abs(n / 1e9 - alpa) / alpa < 1e-3
    runs = []
    for remat in (False, True):
        m = zoo.get("resnet", size="tiny", width_factor=3, remat=remat)
        state, batch = m.init(seed=0)
        runs.append(jax.jit(m.step)(state, batch))
    assert zoo.get("resnet", size="tiny", width_factor=3).param_count() > \
        zoo.get("resnet", size="tiny").param_count()
    (plain, pm), (rem, rm) = runs
    np.testing.assert_allclose(float(pm["loss"]), float(rm["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(rem)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(hj.errors.InvalidModelConfigError):
        zoo.get("resnet", width_factor=0)


def _alpa_moe(**kw):
    """Alpa's MoE language model (its benchmark suite's moe_specs) in the zoo's ``moe``."""
    return zoo.get("moe", size="small", **{
        "n_heads": 16, "top_k": 2, "capacity_factor": 1.0, "seq_len": 1024, "batch": 2,
        "group_size": 2048, "moe_every": 2, "vocab_size": 32000, "activation": "relu", **kw})


def test_moe_expresses_alpas_language_model_and_remat_changes_nothing_it_computes():
    """Alpa's MoE (dense and MoE layers alternating, 8x-wide MLPs, 2,048-token expert groups,
    a 32k vocabulary) has the parameter counts its OSDI'22 artifact logs
    (``results_e2e_ref.tsv``, tied embeddings: ours, untied, less one ``V x H`` table) to 0.25%:
    "380M" 0.3835 B (H 768, L 8, E 8), "70B" 70.4152 B (H 2048, L 32, E 64). Expert groups span
    sequences (``G = B T / group_size``), and ``remat`` leaves the step's loss and update as
    they are, its parameters moved under ``layer_{i}``."""
    for h, layers, experts, alpa in ((768, 8, 8, 0.3835), (2048, 32, 64, 70.4152)):
        n = _alpa_moe(d_model=h, d_ff=8 * h, n_layers=layers, n_experts=experts).param_count()
        assert abs((n - 32000 * h) / 1e9 / alpa - 1) < 2.5e-3
    kw = dict(size="tiny", vocab_size=50, moe_every=2, n_layers=2, group_size=32,
              activation="relu")
    plain, rem = zoo.get("moe", **kw), zoo.get("moe", remat=True, **kw)
    s0, batch = plain.init(seed=0)
    assert batch["tokens"].shape == (8, 16) and set(s0["params"]) >= {"moe_0", "mlp_1", "embed"}
    r0, _ = rem.init(seed=0)
    nested = {k: v for k, v in s0["params"].items() if not k[-1].isdigit()}
    for k, v in s0["params"].items():
        if k[-1].isdigit():
            nested.setdefault(f"layer_{k.rsplit('_', 1)[1]}", {})[k] = v
    (a, am), (b, bm) = (jax.jit(plain.step)(s0, batch),
                        jax.jit(rem.step)({**r0, "params": nested}, batch))
    np.testing.assert_allclose(float(am["loss"]), float(bm["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(am["aux_loss"]), float(bm["aux_loss"]), rtol=1e-6)
    # (atol: remat changes the order XLA:CPU sums in, and an element updated to near zero keeps
    # that rounding, ~1e-10 on an AMD EPYC, where rtol alone asks for 1e-10 * 1e-5)
    np.testing.assert_allclose(a["params"]["mlp_1"]["fc"]["kernel"],
                               b["params"]["layer_1"]["mlp_1"]["fc"]["kernel"], rtol=1e-5,
                               atol=1e-8)
    with pytest.raises(hj.errors.InvalidModelConfigError, match="group_size=24"):
        zoo.get("moe", size="tiny", group_size=24)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_routing(top_k):
    groups, tokens, experts, capacity = 3, 16, 4, 5
    logits = jax.random.normal(jax.random.PRNGKey(top_k), (groups, tokens, experts))
    probs = jax.nn.softmax(logits, axis=-1)
    dispatch, combine, aux = jax.jit(route, static_argnums=(1, 2, 3))(
        probs, experts, top_k, capacity
    )
    dispatch, combine = np.asarray(dispatch), np.asarray(combine)
    assert dispatch.shape == combine.shape == (groups, tokens, experts, capacity)
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert dispatch.sum(axis=(2, 3)).max() <= top_k  # a token goes to <= top_k slots
    assert dispatch.sum(axis=1).max() <= 1  # a slot holds <= 1 token
    assert np.all(combine <= dispatch + 1e-6) and combine.sum(axis=(2, 3)).max() <= 1 + 1e-5
    assert np.isfinite(float(aux)) and float(aux) > 0


@pytest.mark.parametrize("strategy", ["dp", "auto"])
def test_llama_gradient_accumulation_plans_compute_the_unsharded_step(strategy, compile_count):
    """The accumulated step (a scan over microbatches around the layers' scan) planned on the
    H100 rows' 4 (dp) x 2 (cp) mesh of ``benchmarks/published.py``: the emitted program equals
    the unsharded step over two steps (the loop bodies of both plans are planned by search: at
    the benchmark's size ``dp``'s reduce-scatters each microbatch's weight gradients)."""
    from tests.helpers import assert_steps_match, first_steps

    m = zoo.get("llama", size="tiny", batch=16, scan_layers=True, microbatches=2)
    state, batch = m.init(seed=0)
    refs = jax.device_get(first_steps(jax.jit(m.step), state, batch, n=2))
    topo = hj.Topology.grid((4, 2), ("dp", "cp"))
    options = {"stages": False} if strategy == "auto" else {}
    plan = hj.plan(m.step, *m.abstract(), topology=topo, strategy=strategy, **options)
    sharded = hj.emit(m.step, plan, donate=False)
    assert_steps_match(sharded, state, batch, refs, compile_count, rtol=2e-4, atol=2e-5)
