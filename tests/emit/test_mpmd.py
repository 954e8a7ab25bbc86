"""Staged emission: one program per stage and phase, transfers, GPipe / 1F1B over microbatches;
the staged step computes what the unsharded step computes."""

import jax
import numpy as np
import pytest

import hulkjax as hj
from hulkjax import zoo
from hulkjax.plan.stages import schedule_queues
from tests.helpers import assert_trees_close

# Unequal device groups on the 8 fake CPU devices.
TWO = hj.Topology.preset("hetero", nodes=(("A100", 6), ("V100", 2)))
THREE = hj.Topology.preset("hetero", nodes=(("A100", 4), ("V100", 2), ("T4", 2)))
FOUR = hj.Topology.preset("hetero", nodes=(("H100", 2), ("A100", 3), ("V100", 2), ("T4", 1)))

CASES = [
    # (model, config, topology, microbatches, schedule)
    ("mlp", {}, TWO, 1, "1f1b"),
    ("mlp", {}, THREE, 4, "1f1b"),
    ("mlp-nnx", {"depth": 4}, FOUR, 2, "gpipe"),
    ("transformer-block", {}, THREE, 2, "1f1b"),
    ("transformer-block-nnx", {}, TWO, 4, "gpipe"),
    ("gpt2", {"scan_layers": True}, THREE, 4, "1f1b"),     # a scan over the layers
    ("gpt2", {"remat": True}, FOUR, 2, "1f1b"),            # tied embedding across stages, metrics
]


def _ids(case):
    name, cfg, topo, M, sched = case
    return f"{name}{''.join('+' + k for k in cfg)}-{topo.num_devices and len(topo.groups('node'))}groups-M{M}-{sched}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_staged_steps_match_the_unsharded_step(case, compile_count):
    name, cfg, topo, M, schedule = case
    # SGD: Adam's first step divides each gradient by its own magnitude, so summation order
    # (microbatches) moves elements whose gradient is ~0 by up to the learning rate.
    m = zoo.get(name, size="tiny", optimizer="sgd", **cfg)
    state, batch = m.init(0)
    plan = hj.plan(m.step, state, batch, topology=topo, strategy="pipeline", microbatches=M,
                   schedule=schedule)
    assert len(plan.stages) == len(topo.groups("node")) and plan.microbatches == M
    ref = jax.jit(m.step)
    want_state, want_metrics = ref(state, batch)
    want_state2, want_metrics2 = ref(want_state, batch)
    step = hj.emit(m.step, plan)
    new_state, metrics = step(state, batch)
    compiles = compile_count()
    assert_trees_close(metrics, want_metrics)
    assert_trees_close(new_state, want_state)
    # The caller's arrays survive; the step's own outputs are donated to the next call.
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    state2, metrics2 = step(new_state, batch)
    assert compile_count() == compiles, "a second call recompiled"
    assert_trees_close(metrics2, want_metrics2)
    assert_trees_close(state2, want_state2)
    assert any(x.is_deleted() for x in jax.tree.leaves(new_state))
    # State comes back on the stage that holds it, laid out as planned.
    for i, (t, leaf) in enumerate(zip(plan.outputs, jax.tree.leaves(state2))):
        holder = [k for k, st in enumerate(plan.stages) if any(
            plan.inputs[j].path.split("/", 1)[1] == t.path.split("/", 2)[-1] for j in st.inputs)]
        assert leaf.sharding.spec == t.spec or leaf.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(step.meshes[holder[0]] if holder else step.meshes[0],
                                       t.spec), leaf.ndim) or not holder, (i, t.path)


def test_adamw_matches_within_its_learning_rate_scale():
    m = zoo.get("gpt2", size="tiny")
    state, batch = m.init(0)
    plan = hj.plan(m.step, state, batch, topology=TWO, strategy="pipeline", microbatches=2)
    new_state, metrics = hj.emit(m.step, plan, donate=False)(state, batch)
    want_state, want_metrics = jax.jit(m.step)(state, batch)
    assert_trees_close(metrics, want_metrics)
    assert_trees_close(new_state, want_state, rtol=1e-4, atol=2e-4)  # lr = 1e-3


def test_metrics_that_are_not_means_are_refused_with_several_microbatches():
    """A step returning the largest per-example loss cannot be combined from microbatches: the
    planner falls back to one microbatch, and emitting more is refused with the reason."""
    import jax.numpy as jnp
    import optax

    tx = optax.sgd(0.1)

    def step(state, batch):
        def loss_fn(w):
            per = jnp.sum((batch["x"] @ w["a"] @ w["b"] - batch["y"]) ** 2, axis=1)
            return jnp.mean(per), jnp.max(per)
        (loss, worst), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, \
            {"loss": loss, "worst": worst}

    params = {"a": jnp.ones((8, 8)) * 0.1, "b": jnp.ones((8, 4)) * 0.1}
    state = {"params": params, "opt": tx.init(params)}
    batch = {"x": jnp.ones((16, 8)), "y": jnp.zeros((16, 4))}
    plan = hj.plan(step, state, batch, topology=TWO, strategy="pipeline")
    assert plan.microbatches == 1
    assert any("not a sum" in n for n in plan.notes)
    with pytest.raises(hj.errors.InvalidOptionError, match="cannot be microbatched exactly"):
        hj.plan(step, state, batch, topology=TWO, strategy="pipeline", microbatches=2)
    got = hj.emit(step, plan)(state, batch)
    assert_trees_close(got, jax.jit(step)(state, batch))


def test_a_loss_normalized_by_a_count_passed_in_runs_with_microbatches():
    """A loss divided by the batch's number of valid tokens: computed in the step, the step
    cannot be microbatched (and the reason says to pass the count in); passed in as a scalar of
    the batch, as the reason says, the step runs with several microbatches and equals the
    unsharded step."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    from hulkjax.strategies.partition import partition

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(4):
                x = jnp.tanh(nn.Dense(8, name=f"layer{i}")(x))
            return x

    net, tx = Net(), optax.sgd(0.1)

    def make(count):
        def step(state, batch):
            def loss_fn(params):
                per = jnp.sum((net.apply(params, batch["x"]) - batch["y"]) ** 2, axis=1)
                return jnp.sum(per * batch["mask"]) / count(batch)
            loss, grads = jax.value_and_grad(loss_fn)(state["params"])
            updates, opt = tx.update(grads, state["opt"], state["params"])
            return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, \
                {"loss": loss}
        return step

    k = jax.random.split(jax.random.key(0), 3)
    params = net.init(k[0], jnp.ones((16, 8)))
    state = {"params": params, "opt": tx.init(params)}
    mask = (jax.random.uniform(k[2], (16,)) > 0.4).astype(jnp.float32)
    batch = {"x": jax.random.normal(k[1], (16, 8)), "y": jnp.zeros((16, 8)), "mask": mask}
    inside = make(lambda b: jnp.sum(b["mask"]))
    part = partition(hj.trace(inside, state, batch))
    assert not part.exact and "pass it in" in part.problems()[0], part.problems()
    # auto tells the user too, staged or not.
    plan = hj.plan(inside, state, batch, topology=TWO)
    assert any("one microbatch" in n and "pass it in" in n for n in plan.notes), plan.notes
    passed = make(lambda b: b["count"])
    batch = dict(batch, count=jnp.sum(mask))
    plan = hj.plan(passed, state, batch, topology=TWO, strategy="pipeline", microbatches=4)
    assert plan.microbatches == 4
    got = hj.emit(passed, plan, donate=False)(state, batch)
    assert_trees_close(got, jax.jit(passed)(state, batch))


def test_a_loaded_staged_plan_runs_the_same_program(tmp_path):
    m = zoo.get("mlp", size="tiny", optimizer="sgd")
    state, batch = m.init(0)
    plan = hj.plan(m.step, state, batch, topology=THREE, strategy="pipeline", microbatches=2)
    plan.save(tmp_path / "p.json")
    loaded = hj.Plan.load(tmp_path / "p.json")
    a = hj.emit(m.step, plan, donate=False)(state, batch)
    b = hj.emit(m.step, loaded, donate=False)(state, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hulk_shard_runs_staged_plans_and_reads_their_collectives():
    m = zoo.get("mlp", size="tiny", optimizer="sgd")
    state, batch = m.init(0)
    step = hj.hulk_shard(m.step, topology=THREE, strategy="pipeline", microbatches=2)
    new_state, metrics = step(state, batch)
    assert isinstance(step.sharded, hj.StagedStep)
    assert_trees_close(metrics, jax.jit(m.step)(state, batch)[1])
    progs = step.sharded.program_collectives()
    assert set(progs) >= {"F0", "B0", "F2", "B2"}
    # dp_tp on a one-axis stage is tensor parallel: activations are all-reduced inside stages.
    assert any(c.kind == "all-reduce" for cs in progs.values() for c in cs)
    assert all(a.startswith("s") and "/" in a for c in step.collectives() for a in c.axes)


def test_emitting_a_staged_plan_for_another_step_is_refused():
    m = zoo.get("mlp", size="tiny")
    other = zoo.get("mlp", size="tiny", width=64)
    plan = hj.plan(m.step, *m.abstract(), topology=TWO, strategy="pipeline")
    with pytest.raises(hj.errors.PlanMismatchError):
        hj.emit(other.step, plan)(*other.init(0))


INTERLEAVED = [("mlp", {"depth": 4}, 2), ("mlp", {"depth": 4}, 4),
               ("transformer-block", {}, 2), ("transformer-block", {}, 4)]


@pytest.mark.parametrize("name,cfg,M", INTERLEAVED,
                         ids=[f"{n}-M{M}" for n, _, M in INTERLEAVED])
def test_interleaved_staged_steps_match_the_unsharded_step(name, cfg, M, compile_count):
    """2 device groups x 2 chunks each (virtual stages): chunk j runs on group j % 2, in
    Megatron-LM's interleaved 1F1B order; the step equals the unsharded one."""
    m = zoo.get(name, size="tiny", optimizer="sgd", **cfg)
    state, batch = m.init(0)
    plan = hj.plan(m.step, state, batch, topology=TWO, strategy="pipeline", microbatches=M,
                   schedule="interleaved", virtual_stages=2)
    groups = TWO.groups("node")
    assert [st.devices for st in plan.stages] == [groups[0], groups[1]] * 2
    assert plan.virtual_stages == 2 and plan.cost.virtual_stages == 2
    ref = jax.jit(m.step)
    want_state, want_metrics = ref(state, batch)
    step = hj.emit(m.step, plan)
    new_state, metrics = step(state, batch)
    compiles = compile_count()
    assert_trees_close(metrics, want_metrics)
    assert_trees_close(new_state, want_state)
    # Every chunk runs its own programs, in each group's interleaved order.
    assert isinstance(step, hj.StagedStep)
    for d, queue in enumerate(schedule_queues("interleaved", 2, 2, M)):
        assert [x for x in step.order if x[0] % 2 == d] == queue
    want_state2, want_metrics2 = ref(want_state, batch)
    state2, metrics2 = step(new_state, batch)
    assert compile_count() == compiles, "a second call recompiled"
    assert_trees_close(metrics2, want_metrics2)
    assert_trees_close(state2, want_state2)


def test_interleaved_plans_round_trip_and_run_from_json(tmp_path):
    m = zoo.get("mlp", size="tiny", optimizer="sgd", depth=4)
    state, batch = m.init(0)
    plan = hj.plan(m.step, state, batch, topology=TWO, strategy="pipeline", microbatches=2,
                   schedule="interleaved", virtual_stages=2)
    plan.save(tmp_path / "p.json")
    loaded = hj.Plan.load(tmp_path / "p.json")
    assert loaded.virtual_stages == 2 and loaded.schedule == "interleaved"
    assert loaded.to_dict() == plan.to_dict()
    a = hj.emit(m.step, plan, donate=False)(state, batch)
    b = hj.emit(m.step, loaded, donate=False)(state, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_values_leave_their_stage_as_soon_as_they_are_computed(monkeypatch):
    """The host loop sends a microbatch's activation right after the program computing it (before
    it runs another program), and the parameters another stage reads before any program: a
    receive is posted only when the receiving process asks for it, so in a job a value sent at
    its reader waited for both host loops to get there (on the WAN testbed most of a staged
    step's sends then added up). Each value crosses once, though a stage's backward reads its
    forward's input again. The host walks the programs in their predicted start order."""
    from hulkjax.emit import mpmd

    m = zoo.get("gpt2", size="tiny", optimizer="sgd")
    state, batch = m.init(0)
    M = 4
    plan = hj.plan(m.step, state, batch, topology=THREE, strategy="pipeline", microbatches=M,
                   schedule="1f1b")
    step = hj.emit(m.step, plan)
    step(state, batch)  # compile
    events, alive = [], []  # alive: no id is reused while the events are compared
    run, move = mpmd.StagedStep._run, mpmd.transfer.move

    def logged_run(self, p, args, accs):
        outs, new = run(self, p, args, accs)
        alive.extend(outs)
        events.append(("run", p.name, {id(x) for x in outs}))
        return outs, new

    def logged_move(x, want, crossings=None):
        alive.append(x)
        events.append(("move", id(x), tuple(d.id for d in want.mesh.devices.flat)))
        return move(x, want, crossings)

    monkeypatch.setattr(mpmd.StagedStep, "_run", logged_run)
    monkeypatch.setattr(mpmd.transfer, "move", logged_move)
    step(state, batch)
    runs = [i for i, e in enumerate(events) if e[0] == "run"]
    assert len(runs) == len(step.order) + len(step.segments)
    # Parameters read on other stages (the tied embedding) move before the first program.
    assert runs[0] >= 1 and all(e[0] == "move" for e in events[:runs[0]])
    produced = {x: i for i in runs for x in events[i][2]}
    sent = [(produced[e[1]], i) for i, e in enumerate(events)
            if e[0] == "move" and e[1] in produced]
    assert len(sent) >= M * 2 * (len(plan.stages) - 1)  # activations down, gradients up
    for r, i in sent:  # no program runs between a value's producer and its send
        assert not any(events[j][0] == "run" for j in range(r + 1, i)), (events[r][1], i - r)
    to = [events[i][1:] for _, i in sent]  # (value, destination devices)
    assert len(to) == len(set(to)), "a value was sent to the same stage twice"
    # The host's order is the predicted start order of the programs.
    starts = step._predicted_starts(len(plan.stages), M, 1)
    assert [starts[key] for key in step.order] == sorted(starts[key] for key in step.order)
