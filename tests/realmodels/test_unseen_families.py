"""Models outside ``families.py``, as a new user would bring them: transformers' Flax CLIP vision
tower (its class token is ``jnp.tile``, a JAX 0.10 primitive that had no rule; once followed,
its zero-length split pieces made the reshard replay divide by zero out of ``hj.plan``).

Each step is planned on the 2 x 4 mesh under ``dp`` and ``auto`` with every hulkjax warning an
error, emitted, and compared with the unsharded step.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hulkjax as hj
from hulkjax.errors import HulkjaxWarning
from tests.helpers import assert_trees_close
from tests.realmodels import families as F
from tests.realmodels.measure import MESHES

pytest.importorskip("transformers")


def _clip_vision():
    F._quiet_transformers()
    from transformers import CLIPVisionConfig
    from transformers.models.clip.modeling_flax_clip import FlaxCLIPVisionModule

    d = F._dims("tiny")
    cfg = CLIPVisionConfig(hidden_size=d["width"], intermediate_size=d["ff"],
                           num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                           image_size=d["image"], patch_size=d["patch"], projection_dim=32)
    module = FlaxCLIPVisionModule(cfg)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(
        (d["batch"], 3, d["image"], d["image"])), jnp.float32)

    def loss_fn(params, b):
        out = module.apply({"params": params}, b["pixel_values"], deterministic=True)
        return jnp.mean(out.pooler_output ** 2)

    params = jax.jit(lambda x: module.init(jax.random.PRNGKey(0), x))(x)["params"]
    return F._train_step(loss_fn), F._state(params), {"pixel_values": x}


@pytest.mark.parametrize("strategy", ["dp", "auto"])
def test_clip_vision_plans_without_warnings_and_computes_the_unsharded_step(strategy):
    step, state, batch = _clip_vision()
    want = jax.jit(step)(state, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HulkjaxWarning)
        plan = hj.plan(step, state, batch, topology=MESHES["2x4"], strategy=strategy,
                       **({"time_limit": 10} if strategy == "auto" else {}))
    got = hj.emit(step, plan)(state, batch)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-4)
