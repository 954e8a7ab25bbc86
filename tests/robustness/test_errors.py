"""Bad input fails with a clear hulkjax error: its type, and a message with the values and a fix.

One test per way users get it wrong: malformed topology files, clusters larger than the machine,
arguments that are not arrays, keyword arguments, plans for another model or another mesh, edited
plan files, stale (donated) state, and strict mode on an operator without a sharding rule.
"""

from __future__ import annotations

import functools
import inspect
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

import hulkjax as hj
from hulkjax import errors, zoo
from hulkjax.errors import (
    DonatedArgumentError,
    HulkjaxError,
    InvalidPlanError,
    InvalidTopologyError,
    NotCompiledError,
    NotEnoughDevicesError,
    PlanMismatchError,
    StrategyNotApplicableError,
    UnknownStrategyError,
    UnsupportedPrimitiveError,
    UnsupportedPrimitiveWarning,
    UnsupportedStepError,
)
from tests.helpers import TWO_D_TOPOLOGY, assert_trees_close

TOPO = TWO_D_TOPOLOGY



def _small_step(w, x):
    return jnp.tanh(x @ w).sum()


W, X = jnp.ones((4, 4)), jnp.ones((8, 4))


def test_every_error_is_a_hulkjax_error_with_a_docstring():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, Exception) and not issubclass(c, Warning)
               and c.__module__ == errors.__name__]
    assert DonatedArgumentError in classes
    for c in classes:
        assert issubclass(c, HulkjaxError), c
        assert c.__doc__, c


# ---- topology ------------------------------------------------------------------------------

def _grid_json():
    return TOPO.to_dict()


def _dgx_json():
    return hj.Topology.preset("dgx-h100").to_dict()


def _set(d, path, value):
    *head, last = path
    for k in head:
        d = d[k]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value


_DELETE = object()

# (base, path to edit, new value, regex the message must match: the field and the value)
TOPOLOGY_EDITS = [
    (_grid_json, ("mesh", "shape"), [2, 3], r"mesh\.shape=\[2, 3\] multiplies to 6 .* 8 devices"),
    (_grid_json, ("mesh", "shape"), [-2, -4], r"mesh\.shape=\[-2, -4\] has -2; .*>= 1"),
    (_grid_json, ("mesh", "axis_names"), ["a", "a"], r"mesh\.axis_names has repeated names: \['a', 'a'\]"),
    (_dgx_json, ("levels", "node", "bandwith"), 1e9, r"unknown field 'levels\.node\.bandwith'"),
    (_dgx_json, ("levels", "node", "bandwidth"), -5, r"levels\.node\.bandwidth .*got bandwidth=-5"),
    (_dgx_json, ("levels", "node", "bandwidth"), "fast", r"levels\.node\.bandwidth .*'fast'"),
    (_dgx_json, ("devices", "hierarchy", 0, "nodes", 0, "kind"), "H900",
     r"devices\.hierarchy\[0\]\.nodes\[0\]\.kind='H900' is not a known device kind.*H100"),
    (_dgx_json, ("devices", "hierarchy", 0, "nodes", 0, "count"), 0,
     r"devices\.hierarchy\[0\]\.nodes\[0\]\.count must be an int >= 1, got count=0"),
    (_dgx_json, ("name",), _DELETE, r"missing field 'name'"),
    (_dgx_json, ("version",), 2, r"version=2 is not supported"),
]


@pytest.mark.parametrize("base,path,value,message", TOPOLOGY_EDITS,
                         ids=[".".join(map(str, e[1])) + f"={e[2]!r}"[:20] for e in TOPOLOGY_EDITS])
def test_a_malformed_topology_file_names_the_file_field_and_value(tmp_path, base, path, value,
                                                                   message):
    d = base()
    _set(d, path, value)
    f = tmp_path / "cluster.json"
    f.write_text(json.dumps(d))
    with pytest.raises(InvalidTopologyError, match=message) as e:
        hj.Topology.load(f)
    assert str(e.value).startswith(f"{f}: ")
    with pytest.raises(InvalidTopologyError, match=message):  # through the public API too
        hj.plan(_small_step, W, X, topology=str(f), strategy="dp")


def test_topology_files_that_are_not_json_or_not_there(tmp_path):
    f = tmp_path / "cluster.json"
    f.write_text("{nope")
    with pytest.raises(InvalidTopologyError, match=r"cluster\.json: not valid JSON.*schema"):
        hj.plan(_small_step, W, X, topology=str(f))
    f.write_text("[1, 2]")
    with pytest.raises(InvalidTopologyError, match=r"must be a JSON object, got list"):
        hj.Topology.load(f)
    with pytest.raises(OSError, match="missing.json"):
        hj.plan(_small_step, W, X, topology=str(tmp_path / "missing.json"))
    with pytest.raises(InvalidTopologyError, match=r"unknown topology preset 'dgx-h9000'.*dgx-h100"):
        hj.plan(_small_step, W, X, topology="dgx-h9000")
    with pytest.raises(HulkjaxError, match=r"topology must be .* got int 42"):
        hj.hulk_shard(_small_step, topology=42)


@pytest.mark.parametrize("kwargs,message", [
    (dict(shape=(2, 4), axis_names=("d",)), r"one size per axis name"),
    (dict(shape=(0,), axis_names=("d",)), r"has 0; axis sizes must be ints >= 1"),
    (dict(shape=(8,), axis_names=("d",), bandwidth=-1.0), r"axis 'd'.*bandwidth=-1"),
    (dict(shape=(8,), axis_names=("d",), latency=(1e-6, 1e-6)), r"latency"),
])
def test_a_bad_grid_says_which_argument(kwargs, message):
    with pytest.raises(InvalidTopologyError, match=message):
        hj.Topology.grid(**kwargs)


def test_a_topology_larger_than_the_machine_plans_but_does_not_run(mlp):
    m, state, batch = mlp
    big = hj.Topology.grid((4, 4), ("data", "model"))
    plan = hj.plan(m.step, state, batch, topology=big, strategy="dp")  # planning needs no devices
    assert plan.mesh_shape == (4, 4)
    hint = r"needs 16 devices but JAX has 8 \(cpu\).*jax_num_cpu_devices', 16"
    with pytest.raises(NotEnoughDevicesError, match=hint):
        hj.emit(m.step, plan)
    step = hj.hulk_shard(m.step, topology=big, strategy="dp")
    with pytest.raises(NotEnoughDevicesError, match=hint):
        step(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, batch)))


def test_reading_the_program_before_it_is_compiled_says_how_to_compile_it(mlp):
    m, state, batch = mlp
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy="dp")
    step = hj.emit(m.step, plan)
    with pytest.raises(NotCompiledError, match=r"ShardedStep.hlo_text\(\).*step.compile\(\*args\)"):
        step.collectives()
    step.compile(state, batch)
    assert step.collectives()


# ---- the step's arguments -----------------------------------------------------------------

NON_ARRAYS = [
    pytest.param("adam", r"'batch/opt' is a str, not an array.*functools\.partial", id="str"),
    pytest.param(jnp.tanh, r"'batch/opt' is a \w+, not an array.*functools\.partial", id="callable"),
    pytest.param(lambda x: x, r"'batch/opt' is a function, not an array", id="lambda"),
    pytest.param(object(), r"'batch/opt' is a object, not an array", id="object"),
    # jax.jit takes Python scalars (tests/robustness/test_unusual_inputs.py), but not an int that
    # does not fit int32: neither does hulkjax.
    pytest.param(2**40, r"'batch/opt' is a Python int \(1099511627776\) that does not fit JAX's "
                        r"default dtype.*jax\.jit refuses it too", id="int-overflow"),
]


@pytest.mark.parametrize("leaf,message", NON_ARRAYS)
def test_non_array_leaves_are_refused_with_their_path(mlp, leaf, message):
    m, state, batch = mlp
    bad = {**batch, "opt": leaf}
    with pytest.raises(UnsupportedStepError, match=message):
        hj.plan(m.step, state, bad, topology=TOPO)
    step = hj.hulk_shard(m.step, topology=TOPO)
    with pytest.raises(UnsupportedStepError, match=message):
        step(state, bad)
    assert step.plan is None
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, batch)))


def test_a_static_argument_is_refused_and_functools_partial_is_the_fix():
    def step(w, x, activation):
        return activation(x @ w).sum()

    with pytest.raises(UnsupportedStepError, match=r"'activation' is a \w+, not an array"):
        hj.hulk_shard(step, topology=TOPO)(W, X, jnp.tanh)
    fixed = hj.hulk_shard(functools.partial(step, activation=jnp.tanh), topology=TOPO)
    np.testing.assert_allclose(fixed(W, X), step(W, X, jnp.tanh), rtol=1e-6)


def test_keyword_arguments_are_refused_through_every_entry_point(mlp):
    m, state, batch = mlp
    step = hj.hulk_shard(m.step, topology=TOPO)
    with pytest.raises(UnsupportedStepError, match=r"keyword arguments \['batch'\].*positional"):
        step(state, batch=batch)
    # hj.plan's keyword arguments are planner options: the step is then short of an argument.
    with pytest.raises(UnsupportedStepError,
                       match=r"positional parameters \['state', 'batch'\] but got 1 .*missing.*'batch'"
                             r".*pass every array argument positionally"):
        hj.plan(m.step, state, batch=batch, topology=TOPO)
    with pytest.raises(UnsupportedStepError, match=r"keyword arguments \['batch'\]"):
        hj.trace(m.step, state, batch=batch)
    assert step.plan is None


def test_python_control_flow_on_array_values_says_how_to_fix_it():
    def step(w, x):
        return (x @ w).sum() if x.sum() > 0 else w.sum()

    with pytest.raises(UnsupportedStepError, match=r"(?s)tracing 'step' failed.*jax\.lax\.cond"):
        hj.plan(step, W, X, topology=TOPO)


def test_a_bug_in_the_step_is_reported_as_such_with_the_original_error():
    def step(w, x):
        return (w @ x).sum()  # (4, 4) @ (8, 4): the user's bug

    with pytest.raises(UnsupportedStepError, match=r"dot_general requires contracting.*under jax\.jit"
                       ) as e:
        hj.plan(step, W, X, topology=TOPO)
    assert isinstance(e.value.__cause__, TypeError)


def test_exceptions_raised_by_the_step_itself_pass_through_unchanged():
    def step(w, x):
        raise FloatingPointError("the user's own error")

    with pytest.raises(FloatingPointError, match="the user's own error"):
        hj.hulk_shard(step, topology=TOPO)(W, X)


# ---- plans for something else ----------------------------------------------------------------

def test_an_in_memory_plan_emitted_with_another_step_is_refused(mlp):
    m, state, batch = mlp
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy="dp")
    other = zoo.get("mlp", size="tiny", optimizer="sgd", activation="tanh")  # same shapes
    with pytest.raises(PlanMismatchError, match=r"made for another step \(graph fingerprint"):
        hj.emit(other.step, plan)(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, batch)))
    # The same structure in a new function object (a re-built closure) is accepted, and runs it.
    again = zoo.get("mlp", size="tiny", optimizer="sgd")
    assert_trees_close(hj.emit(again.step, plan)(state, batch), jax.jit(again.step)(state, batch))


def test_a_saved_plan_loaded_for_another_model_is_refused(mlp, tmp_path):
    m, state, batch = mlp
    hj.plan(m.step, state, batch, topology=TOPO, strategy="fsdp").save(tmp_path / "p.json")
    other = zoo.get("mlp", size="tiny", optimizer="sgd", depth=3)
    o_state, o_batch = other.init(0)
    with pytest.raises(PlanMismatchError, match=r"another step.*Re-plan"):
        hj.emit(other.step, hj.Plan.load(tmp_path / "p.json"))(o_state, o_batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves((o_state, o_batch)))


@pytest.mark.parametrize("shape,names", [((4, 2), ("data", "model")), ((2, 4), ("a", "b")),
                                         ((8,), ("data",)), ((2, 2, 2), ("data", "model", "z"))])
def test_a_plan_on_a_mesh_of_another_shape_or_axis_names_is_refused(mlp, shape, names):
    m, state, batch = mlp
    for strategy in ("replicate", "dp", "megatron"):  # even plans that would happen to run
        plan = hj.plan(m.step, state, batch, topology=TOPO, strategy=strategy)
        mesh = hj.Topology.grid(shape, names).mesh()
        want = dict(zip(names, shape))
        with pytest.raises(PlanMismatchError,
                           match=re.escape(f"made for a mesh {{'data': 2, 'model': 4}}, but the mesh "
                                           f"is {want}")):
            hj.emit(m.step, plan, mesh=mesh)


def test_a_mesh_of_the_plans_shape_and_names_is_accepted(mlp):
    m, state, batch = mlp
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy="dp_tp")
    devices = np.array(jax.devices()[::-1]).reshape(2, 4)  # other devices, same mesh
    mesh = jax.sharding.Mesh(devices, ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert_trees_close(hj.emit(m.step, plan, mesh=mesh)(state, batch), jax.jit(m.step)(state, batch))


def test_a_plan_file_whose_topology_was_edited_is_refused(mlp, tmp_path):
    m, state, batch = mlp
    d = hj.plan(m.step, state, batch, topology=TOPO, strategy="dp").to_dict()
    d["topology"]["mesh"]["shape"] = [4, 2]
    with pytest.raises(PlanMismatchError, match=r"topology fingerprint \w+ \(was the plan file edited\?\)"):
        hj.emit(m.step, hj.Plan.from_dict(d))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["inputs"][0].update(spec=["nope"]), r"names mesh axis 'nope'; the mesh has"),
    (lambda d: d["inputs"][0].update(spec=[["data", "data"]]), r"uses mesh axis 'data' twice"),
    (lambda d: d["inputs"][0].update(spec=[None, None, None]), r"has 3 entries but .* rank 1"),
    (lambda d: d["inputs"][0].update(spec=[["data", "model"]]),
     r"of 'state/opt_state/0/trace/dense_0/bias' splits dim 0 of size 6 8 ways"),
    (lambda d: d.update(result_specs=[[0, 0, ["nope"]]]),
     r"result 0 of node 0 names mesh axis 'nope'.*Node 0 is"),
    (lambda d: d.update(operand_specs=[[10**6, 0, []]]), r"operand 0 of node 1000000, which"),
])
def test_an_edited_plan_that_does_not_fit_names_the_value(edit, message):
    m = zoo.get("mlp", size="tiny", optimizer="sgd", width=6)
    state, batch = m.init(0)
    plan = hj.plan(m.step, state, batch, topology=TOPO, strategy="replicate")
    assert plan.inputs[0].shape == (6,)  # the first leaf: sgd's momentum of a bias of width 6
    d = plan.to_dict()
    edit(d)
    with pytest.raises(InvalidPlanError, match=message):
        hj.emit(m.step, hj.Plan.from_dict(d))(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, batch)))


def test_emit_needs_a_plan():
    with pytest.raises(InvalidPlanError, match=r"emit needs a hulkjax\.Plan, got dict.*Plan\.load"):
        hj.emit(_small_step, {"strategy": "dp"})


def test_unknown_and_inapplicable_strategies(mlp):
    m, state, batch = mlp
    with pytest.raises(UnknownStrategyError, match=r"unknown strategy 'zero9'; choose one of \["):
        hj.hulk_shard(m.step, topology=TOPO, strategy="zero9")  # at decoration, not first call
    one_d = hj.hulk_shard(m.step, topology=hj.Topology.grid((8,), ("d",)), strategy="dp_tp")
    with pytest.raises(StrategyNotApplicableError, match=r"at least 2 axes.*Topology\.grid\(\(2, 4\)"):
        one_d(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, batch)))


def test_stale_state_that_was_donated_says_what_to_pass_instead(mlp):
    m, state, batch = mlp
    step = hj.hulk_shard(m.step, topology=TOPO, strategy="dp")
    s1, _ = step(state, batch)
    step(s1, batch)  # donates s1
    with pytest.raises(DonatedArgumentError,
                       match=r"argument 'state/.*' \(float32\[\d+(, \d+)*\]\) has been deleted.*"
                             r"donated to an earlier call.*donate=False"):
        step(s1, batch)
    keep = hj.hulk_shard(m.step, topology=TOPO, strategy="dp", donate=False)
    k1, _ = keep(state, batch)
    keep(k1, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves(k1))


# ---- strict mode ---------------------------------------------------------------------------

# A primitive no rule table will ever know (the real ones may get rules as hulkjax grows).
mystery_p = Primitive("hulkjax_test_mystery")
mystery_p.def_impl(jnp.sin)
mystery_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(mystery_p, mlir.lower_fun(jnp.sin, multiple_results=False))


def _step_with_mystery(w, x):
    h = x @ w
    return mystery_p.bind(h).sum()  # <- the line the error must point at


_MYSTERY_LINE = inspect.getsourcelines(_step_with_mystery)[1] + 2


def test_strict_mode_names_the_primitive_and_the_users_source_line():
    where = rf"test_errors\.py:{_MYSTERY_LINE}"
    with pytest.raises(UnsupportedPrimitiveError,
                       match=rf"no sharding rule for 'hulkjax_test_mystery' \(node \d+, .*{where}\)"
                             r".*register_sharding_rule.*strict=False"):
        hj.plan(_step_with_mystery, W, X, topology=TOPO, strategy="dp", strict=True)
    step = hj.hulk_shard(_step_with_mystery, topology=TOPO, strategy="dp", strict=True)
    with pytest.raises(UnsupportedPrimitiveError, match=where):
        step(W, X)
    assert step.plan is None and not W.is_deleted()
    # Without strict: replicated, one warning with the same line, and the right answer.
    with pytest.warns(UnsupportedPrimitiveWarning, match=rf"'hulkjax_test_mystery'.*{where}"):
        plan = hj.plan(_step_with_mystery, W, X, topology=TOPO, strategy="dp")
    np.testing.assert_allclose(hj.emit(_step_with_mystery, plan)(W, X), _step_with_mystery(W, X),
                               rtol=1e-6)
