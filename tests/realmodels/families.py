"""Third-party model families as plain training steps: hulkjax's real-model measuring instrument.

Every family wraps model code written outside this project, from a pip-installable library, with
random initialization (nothing is downloaded: the modules are built from a config and initialized
with ``Module.init``, or by Keras from a seed):

==================  =====================================================  =====================
family              model (library)                                        what it exercises
==================  =====================================================  =====================
``gpt2``            ``FlaxGPT2LMHeadModule`` (transformers 4.x)            fused c_attn + split,
                                                                           Conv1D (transposed)
                                                                           kernels, tied LM head
``bert``            ``FlaxBertForMaskedLMModule`` (transformers 4.x)       encoder, separate
                                                                           q/k/v, padding mask
``t5``              ``FlaxT5ForConditionalGenerationModule``               encoder-decoder,
                    (transformers 4.x)                                     relative position
                                                                           buckets, cross-attn
``vit``             ``FlaxViTForImageClassificationModule``                patch convolution,
                    (transformers 4.x)                                     CLS token concat
``llama``           ``FlaxLlamaForCausalLMModule`` (transformers 4.x)      rotary (rotate_half),
                                                                           grouped-query repeat
``gemma-bf16``      ``FlaxGemmaForCausalLMModule`` (transformers 4.x),     bf16 kernels and
                    parameters and compute in bfloat16                     optimizer state,
                                                                           multi-query attention
``mixtral``         ``MixtralCausalLM`` (keras-hub, Keras 3 on JAX)        mixture of experts:
                                                                           router, top_k,
                                                                           batched expert bank
``unet``            ``FlaxUNet2DConditionModel`` (diffusers 0.31)          convolutions (NCHW),
                                                                           GroupNorm, up/down
                                                                           sampling, skips
                                                                           across resolutions,
                                                                           cross-attention,
                                                                           timestep embedding
==================  =====================================================  =====================

>>> from tests.realmodels import families
>>> step, state, batch = families.build("gpt2", "tiny")
>>> sorted(state), sorted(batch)
(['opt_state', 'params'], ['attention_mask', 'input_ids', 'targets'])

Each ``build(name, size)`` returns ``(step, state, batch)``: ``step(state, batch) -> (new_state,
metrics)`` is a pure function (value_and_grad of the loss, one optax adamw update; metrics hold
``"loss"``), ``state`` is ``{"params": ..., "opt_state": ...}`` and ``batch`` a dict of arrays.
Dropout is off (``deterministic=True``, rates 0). Sizes:

* ``"tiny"`` (tests): 2 layers, width 64, 4-8 heads (2 key/value heads where grouped, 1 in
  Gemma), vocab 256, sequence 16, batch 8: batch, width, heads, feed-forward and vocab divide 8,
  2 x 4 and 2 x 2 x 2 meshes (ViT's 17 tokens, 16 patches + CLS, do not).
* ``"small"`` (benchmarks): 4 layers, width 256, 8 heads, vocab 8192, sequence 128, batch 16.
* ``"base"`` (the GPU calibration, ``benchmarks/gpu.py``): BERT-base / GPT-2-small shapes, 12
  layers, width 768, 12 heads, vocab 32768, sequence 512, batch 16, 224 x 224 images.
* ``"wide"`` (the calibration's held-out check): 6 layers, width 1024, 16 heads, vocab 50304,
  sequence 1024, batch 8, 384 x 384 images.
* ``"large"`` (held out too, matmul-bound): 8 layers, width 2048, 16 heads, feed-forward 8192,
  sequence 2048, batch 4 (a 1B-class LLaMA at 8 layers).

Library versions: transformers ``>=4.50,<5`` (5.x dropped its Flax models), diffusers 0.31 (its
Flax models, deprecated in later releases) and keras-hub 0.32 with Keras 3 on the JAX backend.
keras-hub's metadata requires ``tensorflow-text`` (and so TensorFlow, 1.9 GB), which the Mixtral
backbone does not use: CI installs keras-hub with ``--no-deps`` (see ``.ci/run``); without
keras-hub, :func:`build` of ``mixtral`` raises :class:`FamilyUnavailableError` saying how to
install it.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["FAMILIES", "Family", "FamilyUnavailableError", "available", "build", "names"]

SIZES = ("tiny", "small", "base", "wide", "large")

# Architecture per size, shared by the families (each maps it to its library's config names).
_DIMS = {
    "tiny": dict(layers=2, width=64, heads=4, ff=128, vocab=256, seq=16, batch=8, image=16,
                 patch=4),
    "small": dict(layers=4, width=256, heads=8, ff=1024, vocab=8192, seq=128, batch=16, image=64,
                  patch=8),
    "base": dict(layers=12, width=768, heads=12, ff=3072, vocab=32768, seq=512, batch=16,
                 image=224, patch=16),
    "wide": dict(layers=6, width=1024, heads=16, ff=4096, vocab=50304, seq=1024, batch=8,
                 image=384, patch=16),
    "large": dict(layers=8, width=2048, heads=16, ff=8192, vocab=32768, seq=2048, batch=4,
                  image=512, patch=16),
}

Step = Callable[[dict, dict], tuple[dict, dict]]


class FamilyUnavailableError(RuntimeError):
    """A family's library is not installed (the message says how to install it)."""


@dataclass(frozen=True, slots=True)
class Family:
    """One third-party model family.

    Attributes:
      name: the family's name (``"gpt2"``).
      library: the pip package the model code comes from.
      model: the class the step wraps.
      kind: what sort of model it is (for reports).
      requires: the importable module the family needs (checked by :func:`available`).
      install: how to install it when it is missing.
      make: ``size -> (step, state, batch)``.
      tolerance: ``rtol`` / ``atol`` for comparing sharded steps with unsharded ones. adamw's
        first step divides by the root of tiny second moments, which amplifies summation-order
        noise (``_optimizer`` damps it with ``eps=1e-6``): float32 gets ``atol=1e-4``; bfloat16
        keeps 8 bits of mantissa: ``3e-2``.
    """

    name: str
    library: str
    model: str
    kind: str
    requires: str
    install: str
    make: Callable[[str], tuple[Step, dict, dict]]
    tolerance: dict = field(default_factory=lambda: dict(rtol=1e-4, atol=1e-4))


# ------------------------------------------------------------------------------------------------
# Shared pieces: optimizer, losses, the step, random batches
# ------------------------------------------------------------------------------------------------


def _optimizer() -> optax.GradientTransformation:
    # eps=1e-6 (optax's default is 1e-8): adamw's first step moves each parameter by about
    # lr * g / (|g| + eps), so a gradient element near zero (Mixtral's LM-head column of a token
    # that never occurs: |g| ~ 2e-8) moves by a fraction of lr that summation-order noise decides.
    return optax.adamw(1e-3, weight_decay=1e-4, eps=1e-6)


def _train_step(loss_fn: Callable[[Any, dict], jax.Array]) -> Step:
    """The step every family shares: value_and_grad of ``loss_fn(params, batch)``, adamw."""
    tx = _optimizer()

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {"loss": loss}

    return step


def _state(params) -> dict:
    return {"params": params, "opt_state": _optimizer().init(params)}


def _token_loss(logits, labels, weights=None, count=None) -> jax.Array:
    """Mean token cross-entropy in float32 (``weights`` picks the positions that count; divided
    by ``count`` where given, else by ``sum(weights)``)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    if weights is None:
        return ce.mean()
    return (ce * weights).sum() / (weights.sum() if count is None else count)


def _tokens(rng: np.random.Generator, d: dict, shape=None) -> np.ndarray:
    return rng.integers(0, d["vocab"], shape or (d["batch"], d["seq"]), dtype=np.int32)


def _lm_batch(d: dict, seed: int = 0) -> dict:
    """Causal LM batch: tokens, all-ones attention mask, next-token targets."""
    rng = np.random.default_rng(seed)
    tokens = _tokens(rng, d, (d["batch"], d["seq"] + 1))
    return {"input_ids": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "attention_mask": jnp.ones((d["batch"], d["seq"]), jnp.int32)}


def _positions(input_ids) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)


def _dims(size: str) -> dict:
    if size not in _DIMS:
        raise ValueError(f"unknown size {size!r}; use one of {list(_DIMS)}")
    return dict(_DIMS[size])


def _init(module, *args) -> dict:
    """The ``params`` collection of ``module.init`` (random: nothing is downloaded). Jitted: run
    op by op, the init of a tiny model takes seconds of dispatch."""
    return jax.jit(module.init)(jax.random.PRNGKey(0), *args)["params"]


# ------------------------------------------------------------------------------------------------
# Hugging Face transformers (Flax)
# ------------------------------------------------------------------------------------------------


def _quiet_transformers() -> None:
    # transformers 4.5x logs "TensorFlow and JAX classes are deprecated" once per process; the
    # Flax modules themselves are unchanged and we pin <5, so the notice is noise in reports.
    logging.getLogger("transformers.modeling_flax_utils").setLevel(logging.ERROR)


def _gpt2(size: str):
    _quiet_transformers()
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule

    d = _dims(size)
    cfg = GPT2Config(vocab_size=d["vocab"], n_positions=d["seq"], n_embd=d["width"],
                     n_layer=d["layers"], n_head=d["heads"], n_inner=d["ff"], resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    module = FlaxGPT2LMHeadModule(cfg)
    batch = _lm_batch(d)

    def loss_fn(params, b):
        logits = module.apply({"params": params}, b["input_ids"], b["attention_mask"],
                              _positions(b["input_ids"]), deterministic=True).logits
        return _token_loss(logits, b["targets"])

    params = _init(module, batch["input_ids"], batch["attention_mask"],
                   _positions(batch["input_ids"]))
    return _train_step(loss_fn), _state(params), batch


def _bert(size: str):
    _quiet_transformers()
    from transformers import BertConfig
    from transformers.models.bert.modeling_flax_bert import FlaxBertForMaskedLMModule

    d = _dims(size)
    cfg = BertConfig(vocab_size=d["vocab"], hidden_size=d["width"],
                     num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                     intermediate_size=d["ff"], max_position_embeddings=d["seq"],
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    module = FlaxBertForMaskedLMModule(cfg)
    rng = np.random.default_rng(0)
    shape = (d["batch"], d["seq"])
    lengths = rng.integers(d["seq"] // 2, d["seq"] + 1, d["batch"])  # padded examples
    mask = (np.arange(d["seq"])[None, :] < lengths[:, None]).astype(np.int32)
    batch = {
        "input_ids": jnp.asarray(_tokens(rng, d)),
        "attention_mask": jnp.asarray(mask),
        "token_type_ids": jnp.asarray((np.arange(d["seq"]) >= d["seq"] // 2)
                                      .astype(np.int32)[None].repeat(d["batch"], 0)),
        "labels": jnp.asarray(_tokens(rng, d)),
        # 15% of the real tokens are masked-LM targets, as in BERT pre-training.
        "label_weights": jnp.asarray(((rng.random(shape) < 0.15) & (mask > 0))
                                     .astype(np.float32)),
    }

    def logits_of(params, b):
        return module.apply({"params": params}, b["input_ids"], b["attention_mask"],
                            b["token_type_ids"], _positions(b["input_ids"]), None,
                            deterministic=True).logits

    def loss_fn(params, b):
        # A batch may carry the count of masked tokens ("label_count", computed outside the
        # step): the loss is then divided by it, which lets the step be microbatched.
        return _token_loss(logits_of(params, b), b["labels"], b["label_weights"],
                           b.get("label_count"))

    params = _init(module, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                   _positions(batch["input_ids"]), None)
    return _train_step(loss_fn), _state(params), batch


class _ClipKeywordsCompat(types.ModuleType):
    """``jax.numpy`` with ``clip`` also taking the ``a_min`` / ``a_max`` keywords that JAX 0.10
    removed (deprecated since 0.4.27); transformers 4.57's Flax T5 still passes ``a_max``."""

    def __init__(self):
        super().__init__("jax.numpy")

    def __getattr__(self, name):
        return getattr(jnp, name)

    @staticmethod
    def clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002 (jnp's names)
        return jnp.clip(x, a_min if min is None else min, a_max if max is None else max)


def _t5(size: str):
    _quiet_transformers()
    from transformers import T5Config
    from transformers.models.t5 import modeling_flax_t5
    from transformers.models.t5.modeling_flax_t5 import FlaxT5ForConditionalGenerationModule

    # Only this module's name `jnp` is replaced: jax.numpy itself is untouched.
    if not isinstance(modeling_flax_t5.jnp, _ClipKeywordsCompat):
        modeling_flax_t5.jnp = _ClipKeywordsCompat()

    d = _dims(size)
    # T5 v1.1 / Flan-T5 style: gated-GELU feed-forward, untied LM head.
    cfg = T5Config(vocab_size=d["vocab"], d_model=d["width"], d_kv=d["width"] // d["heads"],
                   d_ff=d["ff"], num_layers=d["layers"], num_decoder_layers=d["layers"],
                   num_heads=d["heads"], relative_attention_num_buckets=8,
                   relative_attention_max_distance=d["seq"], dropout_rate=0.0,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                   decoder_start_token_id=0)
    module = FlaxT5ForConditionalGenerationModule(cfg)
    rng = np.random.default_rng(0)
    labels = _tokens(rng, d)
    batch = {
        "input_ids": jnp.asarray(_tokens(rng, d)),
        "attention_mask": jnp.ones((d["batch"], d["seq"]), jnp.int32),
        # Teacher forcing: the decoder sees the labels shifted right behind the start token.
        "decoder_input_ids": jnp.asarray(np.concatenate(
            [np.zeros((d["batch"], 1), np.int32), labels[:, :-1]], axis=1)),
        "decoder_attention_mask": jnp.ones((d["batch"], d["seq"]), jnp.int32),
        "labels": jnp.asarray(labels),
    }

    def loss_fn(params, b):
        logits = module.apply({"params": params}, b["input_ids"], b["attention_mask"],
                              b["decoder_input_ids"], b["decoder_attention_mask"],
                              deterministic=True).logits
        return _token_loss(logits, b["labels"])

    params = _init(module, batch["input_ids"], batch["attention_mask"],
                   batch["decoder_input_ids"], batch["decoder_attention_mask"])
    return _train_step(loss_fn), _state(params), batch


def _vit(size: str):
    _quiet_transformers()
    from transformers import ViTConfig
    from transformers.models.vit.modeling_flax_vit import FlaxViTForImageClassificationModule

    d = _dims(size)
    num_labels = 16
    cfg = ViTConfig(hidden_size=d["width"], num_hidden_layers=d["layers"],
                    num_attention_heads=d["heads"], intermediate_size=d["ff"],
                    image_size=d["image"], patch_size=d["patch"], num_channels=3,
                    num_labels=num_labels, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    module = FlaxViTForImageClassificationModule(cfg)
    rng = np.random.default_rng(0)
    batch = {  # the Flax module takes NHWC (the PreTrainedModel wrapper transposes from NCHW)
        "pixel_values": jnp.asarray(rng.standard_normal(
            (d["batch"], d["image"], d["image"], 3)).astype(np.float32)),
        "labels": jnp.asarray(rng.integers(0, num_labels, d["batch"], dtype=np.int32)),
    }

    def loss_fn(params, b):
        logits = module.apply({"params": params}, b["pixel_values"], deterministic=True).logits
        return _token_loss(logits, b["labels"])

    params = _init(module, batch["pixel_values"])
    return _train_step(loss_fn), _state(params), batch


def _causal_lm(module, d: dict, dtype=None):
    """A step for a transformers causal LM module called as ``(ids, mask, positions)``;
    ``dtype``: cast the initialized parameters (the Flax modules create float32 ones)."""
    batch = _lm_batch(d)

    def loss_fn(params, b):
        logits = module.apply({"params": params}, b["input_ids"], b["attention_mask"],
                              _positions(b["input_ids"]), deterministic=True).logits
        return _token_loss(logits, b["targets"])

    params = _init(module, batch["input_ids"], batch["attention_mask"],
                   _positions(batch["input_ids"]))
    if dtype is not None:
        params = jax.tree.map(lambda p: p.astype(dtype), params)
    return _train_step(loss_fn), _state(params), batch


def _rope_positions(d: dict, head_dim: int) -> int:
    """``max_position_embeddings`` for the Flax LLaMA-family rotary tables: their
    ``create_sinusoidal_positions`` slices the last axis (2 x head_dim) to ``num_pos``, so a table
    with fewer positions than ``2 * head_dim`` comes out too narrow (real configs have thousands)."""
    return max(d["seq"], 2 * head_dim)


def _llama(size: str, dtype=None):
    """``dtype``: compute and parameters in that dtype (the module's ``dtype`` and the cast
    parameters, as the ``gemma-bf16`` family runs); default float32, as the library writes it."""
    _quiet_transformers()
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_flax_llama import FlaxLlamaForCausalLMModule

    d = _dims(size)
    heads = 2 * d["heads"]  # 8 query heads sharing 2 key/value heads (tiny): grouped-query
    cfg = LlamaConfig(vocab_size=d["vocab"], hidden_size=d["width"],
                      intermediate_size=d["ff"], num_hidden_layers=d["layers"],
                      num_attention_heads=heads, num_key_value_heads=heads // 4,
                      max_position_embeddings=_rope_positions(d, d["width"] // heads),
                      tie_word_embeddings=False,
                      attention_dropout=0.0)
    if dtype is None:
        return _causal_lm(FlaxLlamaForCausalLMModule(cfg), d)
    return _causal_lm(FlaxLlamaForCausalLMModule(cfg, dtype=dtype), d, dtype=dtype)


def _gemma_bf16(size: str):
    _quiet_transformers()
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_flax_gemma import FlaxGemmaForCausalLMModule

    d = _dims(size)
    # Gemma-2B style: one key/value head (multi-query), tied embeddings, GeLU-tanh gated MLP.
    cfg = GemmaConfig(vocab_size=d["vocab"], hidden_size=d["width"],
                      intermediate_size=d["ff"], num_hidden_layers=d["layers"],
                      num_attention_heads=d["heads"], num_key_value_heads=1,
                      head_dim=d["width"] // d["heads"],
                      max_position_embeddings=_rope_positions(d, d["width"] // d["heads"]),
                      hidden_activation="gelu_pytorch_tanh", attention_dropout=0.0)
    module = FlaxGemmaForCausalLMModule(cfg, dtype=jnp.bfloat16)
    return _causal_lm(module, d, dtype=jnp.bfloat16)


# ------------------------------------------------------------------------------------------------
# diffusers (Flax)
# ------------------------------------------------------------------------------------------------


def _unet(size: str):
    """A latent-diffusion UNet's denoising step (Stable Diffusion's architecture, scaled down):
    ``FlaxUNet2DConditionModel`` predicts the noise added to NCHW latents at random timesteps,
    cross-attending to a text-like context, trained with the mean squared error. Two resolutions
    (one cross-attention block down and up, one plain), ``layers`` / 2 resnet layers per block."""
    from diffusers import FlaxUNet2DConditionModel

    d = _dims(size)
    latent = d["image"] // 2
    module = FlaxUNet2DConditionModel(
        sample_size=latent, in_channels=4, out_channels=4,
        block_out_channels=(d["width"] // 2, d["width"]),
        layers_per_block=max(1, d["layers"] // 2), cross_attention_dim=d["width"],
        attention_head_dim=d["heads"],  # (diffusers' name for the number of heads here)
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    rng = np.random.default_rng(0)
    b = d["batch"]
    batch = {
        "latents": jnp.asarray(rng.standard_normal((b, 4, latent, latent)).astype(np.float32)),
        "timesteps": jnp.asarray(rng.integers(0, 1000, b, dtype=np.int32)),
        "context": jnp.asarray(rng.standard_normal((b, d["seq"] // 2, d["width"]))
                               .astype(np.float32)),
        "noise": jnp.asarray(rng.standard_normal((b, 4, latent, latent)).astype(np.float32)),
    }

    def loss_fn(params, x):
        pred = module.apply({"params": params}, x["latents"], x["timesteps"],
                            x["context"]).sample
        return jnp.mean((pred - x["noise"]) ** 2)

    params = _init(module, batch["latents"], batch["timesteps"], batch["context"])
    return _train_step(loss_fn), _state(params), batch


# ------------------------------------------------------------------------------------------------
# keras-hub (Keras 3 on the JAX backend)
# ------------------------------------------------------------------------------------------------


def _keras():
    """Import Keras on the JAX backend (the backend is fixed when Keras is first imported)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    import keras_hub

    if keras.backend.backend() != "jax":
        raise FamilyUnavailableError(
            f"Keras was imported with the {keras.backend.backend()!r} backend; the 'mixtral' "
            f"family needs KERAS_BACKEND=jax set before Keras is first imported.")
    return keras, keras_hub


def _mixtral(size: str):
    keras, keras_hub = _keras()
    d = _dims(size)
    keras.utils.set_random_seed(0)  # Keras initializes variables eagerly, from its global seed
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=d["vocab"], num_layers=d["layers"], num_query_heads=d["heads"],
        num_key_value_heads=d["heads"] // 2, hidden_dim=d["width"], intermediate_dim=d["ff"],
        num_experts=4, top_k=2, sliding_window=d["seq"], dropout=0.0, dtype="float32")
    model = keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)
    if model.non_trainable_variables:
        raise RuntimeError(f"MixtralCausalLM has non-trainable variables "
                           f"{[v.path for v in model.non_trainable_variables]}: the harness "
                           f"assumes none (it would have to carry them in the state).")
    return keras_lm_step(model, d)


def keras_lm_step(model, d: dict):
    """``(step, state, batch)`` of a keras-hub causal LM (built with ``preprocessor=None``):
    ``stateless_call`` on ``{variable path: array}`` parameters (readable names in plans; the
    model wants its list), its non-trainable variables held as constants, a causal LM batch."""
    paths = [v.path for v in model.trainable_variables]
    if len(set(paths)) != len(paths):
        raise RuntimeError(f"{type(model).__name__} has variables with the same path")
    fixed = [v.value for v in model.non_trainable_variables]
    batch = _lm_batch(d)

    def loss_fn(params, b):
        logits, _ = model.stateless_call(
            [params[p] for p in paths], fixed,
            {"token_ids": b["input_ids"], "padding_mask": b["attention_mask"]}, training=False)
        return _token_loss(logits, b["targets"])

    params = {p: jnp.asarray(v.value) for p, v in zip(paths, model.trainable_variables)}
    return _train_step(loss_fn), _state(params), batch


# ------------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------------

_HF = "pip install 'transformers>=4.50,<5'"
# keras-hub's metadata requires tensorflow-text (TensorFlow, 1.9 GB), which the Mixtral backbone
# does not use: install it without its dependencies.
_KERAS_HUB = "pip install 'keras>=3.15,<4' 'tokenizers>=0.22' && pip install --no-deps keras-hub==0.32.0"
_DIFFUSERS = "pip install 'diffusers==0.31.0'"
_BF16 = dict(rtol=3e-2, atol=3e-2)

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("gpt2", "transformers", "FlaxGPT2LMHeadModule", "decoder-only, fused QKV",
           "transformers", _HF, _gpt2),
    Family("bert", "transformers", "FlaxBertForMaskedLMModule", "encoder-only, masked LM",
           "transformers", _HF, _bert),
    Family("t5", "transformers", "FlaxT5ForConditionalGenerationModule", "encoder-decoder",
           "transformers", _HF, _t5),
    Family("vit", "transformers", "FlaxViTForImageClassificationModule", "vision",
           "transformers", _HF, _vit),
    Family("llama", "transformers", "FlaxLlamaForCausalLMModule",
           "LLaMA: rotary, grouped-query attention", "transformers", _HF, _llama),
    Family("gemma-bf16", "transformers", "FlaxGemmaForCausalLMModule",
           "LLaMA-style in bfloat16, multi-query attention", "transformers", _HF, _gemma_bf16,
           tolerance=_BF16),
    Family("mixtral", "keras-hub", "MixtralCausalLM", "mixture of experts (top-2 of 4)",
           "keras_hub", _KERAS_HUB, _mixtral),
    Family("unet", "diffusers", "FlaxUNet2DConditionModel",
           "diffusion UNet: convolutions, GroupNorm, skip connections", "diffusers", _DIFFUSERS,
           _unet),
]}


def names() -> list[str]:
    """The families, in table order."""
    return list(FAMILIES)


def available(name: str) -> bool:
    """Whether the family's library is installed."""
    return importlib.util.find_spec(FAMILIES[name].requires) is not None


def build(name: str, size: str = "tiny", *, dtype=None) -> tuple[Step, dict, dict]:
    """``(step, state, batch)`` of family ``name`` at ``size`` (one of ``SIZES``); ``dtype``
    (``llama`` only): compute and parameters in that dtype instead of float32.

    Raises:
      KeyError: an unknown family (the message lists them).
      ValueError: ``dtype`` for a family that has no such option.
      FamilyUnavailableError: the family's library is not installed.
    """
    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; known: {names()}")
    family = FAMILIES[name]
    if not available(name):
        raise FamilyUnavailableError(
            f"family {name!r} needs {family.library} ({family.requires!r} is not importable). "
            f"Install it: {family.install}")
    if dtype is None:
        return family.make(size)
    if "dtype" not in inspect.signature(family.make).parameters:
        raise ValueError(f"family {name!r} has no dtype option (it runs as its library writes "
                         f"it); llama has one")
    return family.make(size, dtype=dtype)
