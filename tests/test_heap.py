"""The cyclic collector is paused while hulkjax traces and plans (``hulkjax.heap``), resumes
after, and a process that disabled it keeps it disabled."""

import gc
import threading
import weakref

import jax.numpy as jnp

import hulkjax as hj
from hulkjax import zoo
from hulkjax.heap import collector_paused
from hulkjax.strategies.registry import strategies


def _step(w, x):
    return w - 0.1 * jnp.mean(x @ w, axis=0)


def test_trace_and_plan_run_with_the_collector_paused():
    seen = {}

    @hj.strategies.register_strategy("test-gc-probe")
    def probe(graph, topology):
        seen["planning"] = gc.isenabled()
        return hj.strategies.get_strategy("dp").fn(graph, topology)

    try:
        def step(w, x):
            seen["tracing"] = gc.isenabled()
            return _step(w, x)

        hj.plan(step, jnp.ones((4, 4)), jnp.ones((8, 4)), topology=hj.Topology.grid((8,), ("d",)),
                strategy="test-gc-probe")
    finally:
        del strategies["test-gc-probe"]
    assert seen == {"tracing": False, "planning": False}
    assert gc.isenabled()


def test_pauses_nest_and_a_disabled_collector_stays_disabled():
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_resumes_when_the_last_thread_leaves():
    inside, leave = threading.Event(), threading.Event()

    def other():
        with collector_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    with collector_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause is still open
    leave.set()
    t.join(10)
    assert gc.isenabled()


class _Cycle:
    def __init__(self):
        self.me = self


def test_a_sweeping_block_frees_its_cycles_and_a_pause_keeps_none_young():
    gc.collect()
    with collector_paused(sweep=True):
        swept = weakref.ref(_Cycle())
        assert swept() is not None  # the collector is paused inside
    assert swept() is None  # freed when the block ended
    with collector_paused():
        kept = weakref.ref(_Cycle())
    # Moved to the oldest generation unwalked: a young collection does not find it, a full one
    # frees it (no automatic collection in between).
    gc.disable()
    try:
        gc.collect(0)
        gc.collect(1)
        assert kept() is not None
        assert gc.collect() > 0 and kept() is None
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0


def test_objects_the_caller_froze_stay_frozen():
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector_paused():
            with collector_paused(sweep=True):
                swept = weakref.ref(_Cycle())
            young = weakref.ref(_Cycle())
        assert gc.get_freeze_count() == frozen
        assert swept() is None and young() is None  # one young collection instead
    finally:
        gc.unfreeze()


def test_planning_leaves_no_cyclic_garbage():
    """The pauses move what planning allocated to the oldest generation unwalked, trusting that
    planning makes no reference cycles (tracing does: its sweep frees them). A planner that
    made some would leave garbage for the next full collection: the staged search's literal
    operands did (a recursive closure kept every equation of the step alive)."""
    m = zoo.get("llama", size="tiny", batch=8, remat=True)
    topo = hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=2)
    g = hj.trace(m.step, *m.abstract())
    gc.collect()
    plan = hj.plan(m.step, *m.abstract(), topology=topo, strategy="auto", graph=g)
    assert g.memo.get("microbatch_graphs"), "the staged search traced no microbatch"
    assert plan.cost.step_time > 0
    assert gc.collect() == 0
