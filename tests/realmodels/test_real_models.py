"""Third-party models (``tests/realmodels/families.py``): every strategy's emitted program equals
the unsharded ``jax.jit`` step.

For a (family, mesh, strategy) case: plan the family's tiny step, emit it, run two steps from the
initial state (the second fed the first one's donated state) and compare both steps' state and
metrics with two steps of the unsharded step; no call after the first may compile again.

Which cases run:

* CI (default): :data:`CI_CASES`, three per family (about two minutes on 2 cores). Every strategy
  runs on the 2 x 4 mesh for some family, and every strategy that applies to it on the 1-D mesh.
* ``HULKJAX_REALMODELS_GRID=full``: every family x {8, 2 x 4} x every strategy that applies
  (about six minutes). ``benchmarks/realmodels.py`` runs the same check on 8, 2 x 4 and
  2 x 2 x 2 meshes and records it in ``benchmarks/REALMODELS.md``.

Tolerances are the families' (``Family.tolerance``): ``atol=1e-4`` in float32 (adamw's first
step amplifies summation-order noise), ``3e-2`` for ``gemma-bf16``.
"""

from __future__ import annotations

import functools
import os
import re
from contextlib import nullcontext

import jax
import pytest

import hulkjax as hj
from hulkjax.errors import StrategyNotApplicableError, UnsupportedPrimitiveWarning
from tests.helpers import assert_steps_match, first_steps
from tests.realmodels import families
from tests.realmodels.measure import MESHES

TOPOLOGIES = {name: MESHES[name] for name in ("8", "2x4")}

# Primitives each family's plans replicate with an UnsupportedPrimitiveWarning (no sharding rule
# yet). The test checks the set exactly: add a name (with where it comes from) when a change or a
# new family makes a primitive warn, remove it when its rule lands. Every family is fully covered
# today: `split` (GPT-2's fused c_attn, ViT, rotate_half's gradient), `stack` / `unstack`
# (keras-hub's RotaryEmbedding), the router's `top_k` and every scatter have rules;
# benchmarks/COVERAGE.md lists each primitive and how it is handled.
EXPECTED_UNSUPPORTED: dict[str, frozenset[str]] = {name: frozenset() for name in families.names()}

PLANNER_OPTIONS = {"ilp": {"time_limit": 5.0}, "auto": {"time_limit": 5.0}}

# (family, mesh, strategy), three per family (expert on two more): dp and megatron on the 2 x 4
# mesh where code trips them most (broadcast masks, fused QKV + split, head reshapes,
# grouped-query repeats, experts, NCHW convolutions), the rest spread so that every strategy runs
# on both meshes somewhere.
CI_CASES = [
    ("gpt2", "2x4", "dp"), ("gpt2", "2x4", "megatron"), ("gpt2", "8", "auto"),
    ("bert", "2x4", "fsdp"), ("bert", "2x4", "auto"), ("bert", "8", "megatron"),
    ("t5", "2x4", "dp_tp"), ("t5", "2x4", "megatron"), ("t5", "8", "ilp"),
    ("vit", "2x4", "replicate"), ("vit", "2x4", "ilp"), ("vit", "8", "dp"),
    ("llama", "2x4", "dp"), ("llama", "2x4", "megatron"), ("llama", "8", "auto"),
    ("gemma-bf16", "2x4", "megatron"), ("gemma-bf16", "2x4", "auto"), ("gemma-bf16", "8", "fsdp"),
    ("mixtral", "2x4", "dp"), ("mixtral", "2x4", "megatron"), ("mixtral", "8", "replicate"),
    ("llama", "2x4", "expert"), ("bert", "8", "expert"),
    ("mixtral", "2x4", "zero"), ("gpt2", "8", "zero"),
    ("unet", "2x4", "dp"), ("unet", "2x4", "megatron"), ("unet", "8", "auto"),
]  # fmt: skip

FULL_GRID = [(f, m, s) for f in families.names() for m in TOPOLOGIES for s in hj.strategies.names()
             if not (s == "dp_tp" and m == "8") and s != "pipeline"]

CASES = FULL_GRID if os.environ.get("HULKJAX_REALMODELS_GRID") == "full" else CI_CASES


@functools.cache
def reference(family: str):
    """``(step, state, batch, graph, refs)``: the tiny step, its traced graph and two unsharded
    steps (on the host). Cached: each family is built, traced and run once per session."""
    if not families.available(family):
        fam = families.FAMILIES[family]
        pytest.skip(f"family {family!r} needs {fam.library}, not installed: {fam.install}")
    step, state, batch = families.build(family, "tiny")
    refs = jax.device_get(first_steps(jax.jit(step), state, batch, n=2))
    return step, state, batch, hj.trace(step, state, batch), refs


def unsupported_in(records) -> set[str]:
    """Primitive names of the UnsupportedPrimitiveWarnings in ``records``."""
    names = set()
    for w in records:
        m = re.match(r"no sharding rule for '([^']+)'", str(w.message))
        assert m, f"unexpected warning text: {w.message}"
        names.add(m.group(1))
    return names


@pytest.mark.parametrize("family,mesh,strategy", CASES)
def test_sharded_step_equals_unsharded(family, mesh, strategy, compile_count):
    step, state, batch, graph, refs = reference(family)
    expected = EXPECTED_UNSUPPORTED[family]
    with pytest.warns(UnsupportedPrimitiveWarning) if expected else nullcontext() as records:
        try:
            plan = hj.plan(step, state, batch, topology=TOPOLOGIES[mesh], strategy=strategy,
                           graph=graph, **PLANNER_OPTIONS.get(strategy, {}))
        except StrategyNotApplicableError as e:
            pytest.fail(f"{strategy} does not apply on mesh {mesh}: {e}; drop the case")
    assert unsupported_in(records or []) == expected
    assert_steps_match(hj.emit(step, plan), state, batch, refs, compile_count,
                       **families.FAMILIES[family].tolerance)


def test_ci_cases_cover_every_strategy_on_both_meshes():
    for mesh in TOPOLOGIES:
        ran = {s for _, m, s in CI_CASES if m == mesh}
        # pipeline places stages on device groups (nodes, regions): a grid has none, and
        # test_staged_step_equals_unsharded runs it on two nodes.
        expected = set(hj.strategies.names()) - {"pipeline"} - ({"dp_tp"} if mesh == "8" else set())
        assert ran == expected, f"mesh {mesh}: CI cases miss {sorted(expected - ran)}"
    assert {f for f, _, _ in CI_CASES} == set(families.names())
    assert len(set(CI_CASES)) == len(CI_CASES)


# Two 4-GPU nodes: the pipeline baseline puts half the layers on each (one microbatch: adamw's
# first step divides by each gradient's own magnitude, so a microbatched sum's reordering moves
# elements whose gradient is ~0 by up to the learning rate; tests/emit/test_mpmd.py checks
# microbatching with SGD).
TWO_NODES = hj.Topology.preset("hetero")
STAGED_FAMILIES = ("gpt2", "llama", "t5", "unet")  # unet: skip connections cross the stages


@pytest.mark.parametrize("family", STAGED_FAMILIES)
def test_staged_step_equals_unsharded(family, compile_count):
    step, state, batch, graph, refs = reference(family)
    plan = hj.plan(step, state, batch, topology=TWO_NODES, strategy="pipeline", graph=graph,
                   microbatches=1)
    assert plan.stages is not None and len(plan.stages) == 2
    assert all(st.layers for st in plan.stages), "each node holds some of the layers"
    assert_steps_match(hj.emit(step, plan), state, batch, refs, compile_count,
                       **families.FAMILIES[family].tolerance)
