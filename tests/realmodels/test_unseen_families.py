"""Models outside ``families.py``, as a new user would bring them
(:mod:`tests.realmodels.unseen_models`; ``benchmarks/unseen.py`` runs them all), here the ones
whose code found a bug:

* transformers' Flax CLIP vision tower: its class token is ``jnp.tile``, a JAX 0.10 primitive
  that had no rule; once followed, its zero-length split pieces made the reshard replay divide by
  zero out of ``hj.plan``;
* RoFormer: its rotary helper stacks along a new axis, which the microbatch analysis could not
  read, and a pad after it raised a ``TypeError`` out of ``hj.plan`` where the staged search ran
  (two DGX nodes); GPT-J's helper is the same;
* CLIP with its contrastive loss: every text is scored against every image of the batch, where
  the microbatch analysis loses the batch dimension (examples paired with examples); the gather
  that picks each row's label then indexed its slice sizes with ``None``, a ``TypeError`` out of
  ``hj.plan`` on two DGX nodes;
* CLIP's text tower: its pooler reads each example's last token, ``x[jnp.arange(B), idx]``,
  which the microbatch analysis refused (an iota along the batch), so it was staged with one
  microbatch.

Each step is planned with every hulkjax warning an error, emitted, and compared with the
unsharded step.
"""

from __future__ import annotations

import warnings

import jax
import pytest

import hulkjax as hj
from hulkjax.errors import HulkjaxWarning
from tests.helpers import assert_trees_close
from tests.realmodels.measure import MESHES

pytest.importorskip("transformers")

from tests.realmodels import unseen_models  # noqa: E402

TWO_NODES = hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)


@pytest.mark.parametrize("model,topology,strategy", [
    ("clip_vision", MESHES["2x4"], "dp"),
    ("clip_vision", MESHES["2x4"], "auto"),
    ("roformer", TWO_NODES, "auto"),
    ("clip", TWO_NODES, "auto"),
    ("clip_text", TWO_NODES, "auto"),
])
def test_plans_without_warnings_and_computes_the_unsharded_step(model, topology, strategy):
    step, state, batch = unseen_models.MODELS[model]()
    want = jax.jit(step)(state, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HulkjaxWarning)
        plan = hj.plan(step, state, batch, topology=topology, strategy=strategy,
                       **({"time_limit": 10} if strategy == "auto" else {}))
    if model in ("roformer", "clip_text", "clip"):
        from hulkjax.strategies.partition import partition

        split = partition(hj.trace(step, state, batch)).split
        assert plan.stages is not None  # staged over the two nodes
        # RoFormer's and CLIP's text tower microbatch exactly; CLIP's in-batch negatives couple
        # the examples: one microbatch, and the problem says why.
        assert split.exact is (model != "clip"), split.problems
        if model == "clip":
            assert plan.microbatches == 1
            assert any("pairs examples with other examples" in p for p in split.problems)
    got = hj.emit(step, plan)(state, batch)
    # adamw's first step (lr 1e-3) amplifies summation-order noise on near-zero gradients: the
    # unsharded step itself, compiled with XLA's default and with -O0 (the tests' conftest.py),
    # differs by up to 1.7e-4 on CLIP's class embedding. 3e-4 is that, with margin.
    assert_trees_close(got, want, rtol=1e-4, atol=3e-4)
