"""The tracer: graph structure, inlining, loop costs, names, roles, errors, and the interpreter."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.errors import UnsupportedStepError
from hulkjax.trace import DATA, OPTIMIZER, PARAMETER, interpret


def test_one_node_per_equation_with_shapes_flops_and_bytes():
    def f(w, x):
        return jnp.tanh(x @ w).sum()

    g = hj.trace(f, jnp.ones((16, 32)), jnp.ones((8, 16)))
    assert [n.name for n in g.nodes] == ["dot_general", "tanh", "reduce_sum"]
    dot, tanh, red = g.nodes
    assert g.values[dot.outputs[0]].shape == (8, 32)
    assert dot.flops == 2 * 8 * 16 * 32
    assert dot.bytes == 4 * (16 * 32 + 8 * 16 + 8 * 32)
    assert tanh.flops == 8 * 32
    assert red.flops == 8 * 32
    assert g.input_paths == ("w", "x")
    assert g.output_paths == ("out",)
    assert g.consumers(dot.outputs[0]) == [(tanh.id, 0)]


def test_conv_flops_closed_form():
    def f(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    g = hj.trace(f, jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16)))
    (conv,) = g.nodes
    assert conv.flops == 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)


def test_nested_jit_custom_jvp_custom_vjp_and_remat_are_inlined():
    @jax.custom_vjp
    def cv(x):
        return jnp.sin(x)

    cv.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))

    @jax.jit
    def inner(x):
        return jax.nn.relu(x) * 2.0  # relu is a custom_jvp

    def f(x):
        y = jax.checkpoint(lambda a: inner(a) @ a)(x)
        return cv(y).sum()

    x = jnp.arange(16.0).reshape(4, 4) / 16
    for fn in (f, jax.grad(f)):
        g = hj.trace(fn, x)
        names = {n.name for n in g.nodes}
        assert not names & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2",
                            "checkpoint"}, names
        assert "dot_general" in names and "max" in names
        # Re-running the graph reproduces the function, remat included.
        out = interpret(g.jaxpr, [x])
        np.testing.assert_allclose(out[0], fn(x), rtol=1e-6)


def test_interpreter_visits_nodes_in_graph_order():
    m = zoo.get("mlp", size="tiny")
    state, batch = m.init(0)
    g = hj.trace(m.step, state, batch)
    seen = []

    def on_result(nid, outs):
        seen.append((nid, tuple(o.shape for o in outs)))
        return outs

    jax.jit(lambda *a: interpret(g.jaxpr, a, on_result=on_result))(*jax.tree.leaves((state, batch)))
    assert [nid for nid, _ in seen] == list(range(len(g.nodes)))
    assert [s for _, s in seen] == [tuple(g.values[o].shape for o in n.outputs) for n in g.nodes]


def test_scan_while_cond_are_nodes_costed_by_trip_count():
    w = jnp.ones((8, 8))

    def f(x):
        x, _ = jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)
        x = jax.lax.cond(x.sum() > 0, lambda a: a @ w @ w, lambda a: a * 2.0, x)
        return jax.lax.while_loop(lambda a: a.sum() < 0, lambda a: a @ w, x)

    g = hj.trace(f, jnp.ones((4, 8)))
    by = {n.name: n for n in g.nodes}
    assert by["scan"].trip_count == 5
    assert by["scan"].flops == 5 * 2 * 4 * 8 * 8
    assert by["cond"].flops == 2 * (2 * 4 * 8 * 8)  # the more expensive branch
    assert len(by["while"].subgraphs) == 2
    assert by["while"].flops >= 2 * 4 * 8 * 8


@pytest.mark.parametrize("name", ["mlp", "mlp-nnx", "transformer-block", "transformer-block-nnx"])
def test_roles_from_data_flow_and_paths(name):
    m = zoo.get(name, size="tiny")
    state, batch = m.init(0)
    g = hj.trace(m.step, state, batch)
    roles = dict(zip(g.input_paths, g.input_roles))
    # Paths are rooted at the step's parameter names and follow the pytree.
    assert all(p.startswith(("state/", "batch/")) for p in g.input_paths)
    for path, role in roles.items():
        if path.startswith("batch/"):
            assert role == DATA, path
        elif path.startswith("state/params/"):
            assert role == PARAMETER, path
        elif "/mu/" in path or "/nu/" in path:
            assert role == OPTIMIZER, path
    # Every optimizer moment is owned by the parameter of the same shape it updates.
    for opt, param in g.owners.items():
        suffix = g.input_paths[opt].split("/mu/")[-1].split("/nu/")[-1]
        assert g.input_paths[param].endswith(suffix), (g.input_paths[opt], g.input_paths[param])
    # Every state leaf is carried to the result leaf at the same path.
    for i, o in g.carried.items():
        assert g.output_paths[o] == "out/0/" + g.input_paths[i][len("state/"):]
    # Layers: every matmul belongs to a named layer (nnx has no scopes: labels come from params).
    assert all(n.layer for n in g.nodes if n.name == "dot_general")


def test_abstract_tracing_of_gpt2_small_allocates_nothing():
    m = zoo.get("gpt2", size="small")
    state, batch = m.abstract()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((state, batch)))
    g = hj.trace(m.step, state, batch)
    assert len(g.nodes) > 3000
    assert sum(1 for n in g.nodes if n.name == "dot_general") >= 12 * 6 * 3
    assert g.total_flops > 6 * 124e6 * 8 * 1024  # at least 6 N D for a training step
    nx_graph = g.to_networkx()
    assert nx_graph.number_of_nodes() == len(g.nodes) + len(g.inputs)


def test_fingerprint_is_stable_and_shape_sensitive():
    f = lambda w, x: (x @ w).sum()  # noqa: E731
    a = hj.trace(f, jnp.ones((4, 4)), jnp.ones((8, 4))).fingerprint()
    b = hj.trace(f, jnp.ones((4, 4)), jnp.ones((8, 4))).fingerprint()
    c = hj.trace(f, jnp.ones((4, 4)), jnp.ones((16, 4))).fingerprint()
    assert a == b != c


def test_keyword_arguments_are_rejected_with_a_fix():
    with pytest.raises(UnsupportedStepError, match=r"keyword arguments \['lr'\].*functools.partial"):
        hj.trace(lambda x, lr: x * lr, jnp.ones(3), lr=jnp.ones(()))


@pytest.mark.parametrize("leaf, kind", [("adam", "str"), (object(), "object")])
def test_non_array_leaves_are_rejected_naming_the_path(leaf, kind):
    with pytest.raises(UnsupportedStepError, match=rf"'batch/lr' is a {kind}, not an array"):
        hj.trace(lambda state, batch: state * 2, jnp.ones(3), {"lr": leaf})


@pytest.mark.parametrize("leaf, dtype, weak", [(0.1, "float32", True), (3, "int32", True),
                                               (True, "bool", False)])
def test_python_scalars_are_inputs_as_jax_jit_takes_them(leaf, dtype, weak):
    """Weakly typed 0-d inputs (bool strongly typed), so that dtype promotion inside the step is
    jax.jit's: a bfloat16 value times a Python float stays bfloat16."""
    g = hj.trace(lambda x, batch: x * batch["lr"], jnp.ones(3, jnp.bfloat16), {"lr": leaf})
    v = g.values[g.inputs[1]]
    assert (g.input_paths[1], v.shape, v.dtype) == ("batch/lr", (), dtype)
    assert g.jaxpr.in_avals[1].weak_type is weak
    want = jax.eval_shape(lambda x, lr: x * lr, jnp.ones(3, jnp.bfloat16), leaf)
    assert g.jaxpr.out_avals[0].dtype == want.dtype


def test_partial_binds_static_settings():
    def step(x, *, scale):
        return x * scale

    g = hj.trace(functools.partial(step, scale=3.0), jnp.ones(3))
    assert [n.name for n in g.nodes] == ["mul"]


def test_reading_a_steps_equations_makes_no_reference_cycles():
    """``equations`` and ``constant_values`` (the staged search's literal operands) leave nothing
    for the cyclic collector: a recursive closure once kept every equation of the step alive
    until a full collection (a reference cycle through its own cell)."""
    import gc

    from hulkjax.trace.interpret import constant_values, equations

    inner = jax.jit(lambda x: x * 2.0 + np.arange(3.0))  # an inlined body with a constant
    closed = jax.make_jaxpr(lambda x: jnp.sin(inner(x)))(jnp.ones(3))
    gc.collect()
    gc.disable()
    try:
        eqs, consts = equations(closed), constant_values(closed)
        assert [e.eqn.primitive.name for e in eqs] == ["mul", "add", "sin"]
        assert len(consts) == 1
        del eqs, consts
        assert gc.collect() == 0
    finally:
        gc.enable()
