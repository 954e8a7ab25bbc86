"""The cyclic collector is paused while hulkjax traces and plans (``hulkjax.heap``), resumes
after, and a process that disabled it keeps it disabled."""

import gc
import threading

import jax.numpy as jnp

import hulkjax as hj
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
