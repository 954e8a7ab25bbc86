"""Third-party models that no test, family or rule of hulkjax was written for, as steps.

Fifteen of transformers' Flax modules and eight of keras-hub's causal LMs (Keras 3 on JAX;
``kh-*``), tiny, random-initialized, nothing downloaded, built the way
:mod:`tests.realmodels.families` builds its families (value_and_grad of a loss, AdamW):
``MODELS[name]() -> (step, state, batch)``. ``benchmarks/unseen.py`` plans, emits and checks
every one of them (``benchmarks/UNSEEN.md``); ``tests/realmodels/test_unseen_families.py`` runs
the ones whose code found a bug.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tests.realmodels import families

d = families._dims("tiny")


def opt():
    from transformers import OPTConfig
    from transformers.models.opt.modeling_flax_opt import FlaxOPTForCausalLMModule

    cfg = OPTConfig(
        vocab_size=d["vocab"],
        hidden_size=d["width"],
        ffn_dim=d["ff"],
        num_hidden_layers=2,
        num_attention_heads=d["heads"],
        max_position_embeddings=64,
        word_embed_proj_dim=d["width"],
        dropout=0.0,
    )
    return families._causal_lm(FlaxOPTForCausalLMModule(cfg), d)


def gptneo():
    from transformers import GPTNeoConfig
    from transformers.models.gpt_neo.modeling_flax_gpt_neo import FlaxGPTNeoForCausalLMModule

    cfg = GPTNeoConfig(
        vocab_size=d["vocab"],
        hidden_size=d["width"],
        num_layers=2,
        attention_types=[[["global", "local"], 1]],
        num_heads=d["heads"],
        intermediate_size=d["ff"],
        max_position_embeddings=64,
        window_size=8,
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
    )
    return families._causal_lm(FlaxGPTNeoForCausalLMModule(cfg), d)


def bloom():
    from transformers import BloomConfig
    from transformers.models.bloom.modeling_flax_bloom import FlaxBloomForCausalLMModule

    cfg = BloomConfig(
        vocab_size=d["vocab"],
        hidden_size=d["width"],
        n_layer=2,
        n_head=d["heads"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    module = FlaxBloomForCausalLMModule(cfg)
    batch = families._lm_batch(d)

    def loss_fn(params, b):
        logits = module.apply(
            {"params": params}, b["input_ids"], b["attention_mask"], deterministic=True
        ).logits
        return families._token_loss(logits, b["targets"])

    params = families._init(module, batch["input_ids"], batch["attention_mask"])
    return families._train_step(loss_fn), families._state(params), batch


def mistral():
    from transformers import MistralConfig
    from transformers.models.mistral.modeling_flax_mistral import FlaxMistralForCausalLMModule

    cfg = MistralConfig(
        vocab_size=d["vocab"],
        hidden_size=d["width"],
        intermediate_size=d["ff"],
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=8,
    )
    return families._causal_lm(FlaxMistralForCausalLMModule(cfg), d)


def gptj():
    from transformers import GPTJConfig
    from transformers.models.gptj.modeling_flax_gptj import FlaxGPTJForCausalLMModule

    cfg = GPTJConfig(
        vocab_size=d["vocab"],
        n_embd=d["width"],
        n_layer=2,
        n_head=d["heads"],
        rotary_dim=8,
        n_positions=64,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return families._causal_lm(FlaxGPTJForCausalLMModule(cfg), d)


def bart():
    from transformers import BartConfig
    from transformers.models.bart.modeling_flax_bart import FlaxBartForConditionalGenerationModule

    cfg = BartConfig(
        vocab_size=d["vocab"],
        d_model=d["width"],
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=d["heads"],
        decoder_attention_heads=d["heads"],
        encoder_ffn_dim=d["ff"],
        decoder_ffn_dim=d["ff"],
        max_position_embeddings=64,
        dropout=0.0,
    )
    module = FlaxBartForConditionalGenerationModule(cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(families._tokens(rng, d))
    dec = jnp.asarray(families._tokens(rng, d))
    tgt = jnp.asarray(families._tokens(rng, d))
    mask = jnp.ones_like(ids)
    pos = families._positions(ids)
    batch = {"input_ids": ids, "decoder_input_ids": dec, "targets": tgt, "attention_mask": mask}

    def loss_fn(params, b):
        out = module.apply(
            {"params": params},
            b["input_ids"],
            b["attention_mask"],
            b["decoder_input_ids"],
            b["attention_mask"],
            families._positions(b["input_ids"]),
            families._positions(b["decoder_input_ids"]),
            deterministic=True,
        )
        return families._token_loss(out.logits, b["targets"])

    params = families._init(module, ids, mask, dec, mask, pos, pos)
    return families._train_step(loss_fn), families._state(params), batch


def resnet():
    from transformers import ResNetConfig
    from transformers.models.resnet.modeling_flax_resnet import (
        FlaxResNetForImageClassificationModule,
    )

    cfg = ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10
    )
    module = FlaxResNetForImageClassificationModule(cfg)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 32, 32, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, (8,)), jnp.int32)
    variables = jax.jit(lambda x: module.init(jax.random.PRNGKey(0), x, deterministic=True))(x)
    tx = families._optimizer()

    def step(state, batch):
        def loss_fn(params):
            out, upd = module.apply(
                {"params": params, "batch_stats": state["batch_stats"]},
                batch["pixel_values"],
                deterministic=False,
                mutable=["batch_stats"],
            )
            return families._token_loss(out.logits, batch["labels"]), upd["batch_stats"]

        (loss, bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])

        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "batch_stats": bs,
        }, {"loss": loss}

    state = {
        "params": variables["params"],
        "opt_state": tx.init(variables["params"]),
        "batch_stats": variables["batch_stats"],
    }
    return step, state, {"pixel_values": x, "labels": y}


def wav2vec2():
    from transformers import Wav2Vec2Config
    from transformers.models.wav2vec2.modeling_flax_wav2vec2 import FlaxWav2Vec2ForCTCModule

    cfg = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=d["width"],
        num_hidden_layers=2,
        num_attention_heads=d["heads"],
        intermediate_size=d["ff"],
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        layerdrop=0.0,
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
    )
    module = FlaxWav2Vec2ForCTCModule(cfg)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 400)), jnp.float32)

    def loss_fn(params, b):
        logits = module.apply({"params": params}, b["input_values"], deterministic=True)[0]
        return (logits.astype(jnp.float32) ** 2).mean()

    params = families._init(module, x)
    return families._train_step(loss_fn), families._state(params), {"input_values": x}


def clip_vision():
    from transformers import CLIPVisionConfig
    from transformers.models.clip.modeling_flax_clip import FlaxCLIPVisionModule

    cfg = CLIPVisionConfig(
        hidden_size=d["width"],
        intermediate_size=d["ff"],
        num_hidden_layers=2,
        num_attention_heads=d["heads"],
        image_size=16,
        patch_size=4,
        projection_dim=32,
    )
    module = FlaxCLIPVisionModule(cfg)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 3, 16, 16)), jnp.float32)

    def loss_fn(params, b):
        out = module.apply({"params": params}, b["pixel_values"], deterministic=True)
        return (out.pooler_output**2).mean()

    params = families._init(module, x)
    return families._train_step(loss_fn), families._state(params), {"pixel_values": x}


def bigbird():
    from transformers import BigBirdConfig
    from transformers.models.big_bird.modeling_flax_big_bird import FlaxBigBirdForMaskedLMModule

    cfg = BigBirdConfig(
        vocab_size=d["vocab"],
        hidden_size=d["width"],
        num_hidden_layers=2,
        num_attention_heads=d["heads"],
        intermediate_size=d["ff"],
        max_position_embeddings=128,
        attention_type="block_sparse",
        block_size=4,
        num_random_blocks=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    module = FlaxBigBirdForMaskedLMModule(cfg)
    dd = dict(d, seq=64)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(families._tokens(rng, dd))
    tgt = jnp.asarray(families._tokens(rng, dd))
    batch = {"input_ids": ids, "targets": tgt, "attention_mask": jnp.ones_like(ids)}

    def loss_fn(params, b):
        out = module.apply(
            {"params": params},
            b["input_ids"],
            b["attention_mask"],
            jnp.zeros_like(b["input_ids"]),
            families._positions(b["input_ids"]),
            None,
            deterministic=True,
            rngs={"indices": jax.random.PRNGKey(1)},
        )
        return families._token_loss(out.logits, b["targets"])

    params = jax.jit(
        lambda i: module.init(
            {"params": jax.random.PRNGKey(0), "indices": jax.random.PRNGKey(1)},
            i,
            jnp.ones_like(i),
            jnp.zeros_like(i),
            families._positions(i),
            None,
        )
    )(ids)["params"]
    return families._train_step(loss_fn), families._state(params), batch



def _image_classifier(module, x, labels=10):
    """A step for an image classifier module called as ``(pixel_values)``."""
    y = jnp.asarray(np.random.default_rng(1).integers(0, labels, (x.shape[0],)), jnp.int32)

    def loss_fn(params, b):
        logits = module.apply({"params": params}, b["pixel_values"], deterministic=True).logits
        return families._token_loss(logits, b["labels"])

    params = families._init(module, x)
    return families._train_step(loss_fn), families._state(params), {"pixel_values": x,
                                                                    "labels": y}


def _pixels(channels_last=False):
    shape = (d["batch"], 32, 32, 3) if channels_last else (d["batch"], 3, 32, 32)
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)


def albert():
    from transformers import AlbertConfig
    from transformers.models.albert.modeling_flax_albert import FlaxAlbertForMaskedLMModule

    cfg = AlbertConfig(vocab_size=d["vocab"], embedding_size=32, hidden_size=d["width"],
                       num_hidden_layers=3, num_hidden_groups=1, num_attention_heads=d["heads"],
                       intermediate_size=d["ff"], max_position_embeddings=64,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    module = FlaxAlbertForMaskedLMModule(cfg)  # one layer's weights shared by all three
    rng = np.random.default_rng(0)
    ids = jnp.asarray(families._tokens(rng, d))
    batch = {"input_ids": ids, "targets": jnp.asarray(families._tokens(rng, d))}

    def loss_fn(params, b):
        i = b["input_ids"]
        logits = module.apply({"params": params}, i, jnp.ones_like(i), jnp.zeros_like(i),
                              families._positions(i), deterministic=True).logits
        return families._token_loss(logits, b["targets"])

    params = families._init(module, ids, jnp.ones_like(ids), jnp.zeros_like(ids),
                            families._positions(ids))
    return families._train_step(loss_fn), families._state(params), batch


def roformer():
    from transformers import RoFormerConfig
    from transformers.models.roformer.modeling_flax_roformer import FlaxRoFormerForMaskedLMModule

    cfg = RoFormerConfig(vocab_size=d["vocab"], embedding_size=d["width"],
                         hidden_size=d["width"], num_hidden_layers=2,
                         num_attention_heads=d["heads"], intermediate_size=d["ff"],
                         max_position_embeddings=64, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    module = FlaxRoFormerForMaskedLMModule(cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(families._tokens(rng, d))
    batch = {"input_ids": ids, "targets": jnp.asarray(families._tokens(rng, d))}

    def loss_fn(params, b):
        i = b["input_ids"]
        logits = module.apply({"params": params}, i, jnp.ones_like(i), jnp.zeros_like(i), None,
                              deterministic=True).logits
        return families._token_loss(logits, b["targets"])

    params = families._init(module, ids, jnp.ones_like(ids), jnp.zeros_like(ids), None)
    return families._train_step(loss_fn), families._state(params), batch


def whisper():
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_flax_whisper import (
        FlaxWhisperForConditionalGenerationModule,
    )

    cfg = WhisperConfig(vocab_size=d["vocab"], num_mel_bins=16, encoder_layers=1,
                        decoder_layers=1, encoder_attention_heads=d["heads"],
                        decoder_attention_heads=d["heads"], encoder_ffn_dim=d["ff"],
                        decoder_ffn_dim=d["ff"], d_model=d["width"], max_source_positions=16,
                        max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0)
    module = FlaxWhisperForConditionalGenerationModule(cfg)
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.standard_normal((d["batch"], 16, 32)), jnp.float32)  # 2 x positions
    dec = jnp.asarray(families._tokens(rng, d))
    batch = {"input_features": feats, "decoder_input_ids": dec,
             "targets": jnp.asarray(families._tokens(rng, d))}

    def loss_fn(params, b):
        i = b["decoder_input_ids"]
        out = module.apply({"params": params}, b["input_features"], i, jnp.ones_like(i),
                           families._positions(i), deterministic=True)
        return families._token_loss(out.logits, b["targets"])

    params = families._init(module, feats, dec, jnp.ones_like(dec), families._positions(dec))
    return families._train_step(loss_fn), families._state(params), batch


def beit():
    from transformers import BeitConfig
    from transformers.models.beit.modeling_flax_beit import FlaxBeitForImageClassificationModule

    cfg = BeitConfig(hidden_size=d["width"], num_hidden_layers=2, num_attention_heads=d["heads"],
                     intermediate_size=d["ff"], image_size=32, patch_size=8, num_labels=10,
                     use_relative_position_bias=True, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return _image_classifier(FlaxBeitForImageClassificationModule(cfg), _pixels(True))


def dinov2():
    from transformers import Dinov2Config
    from transformers.models.dinov2.modeling_flax_dinov2 import (
        FlaxDinov2ForImageClassificationModule,
    )

    # image_size 16, pixels 32: the position embeddings are interpolated (jax.image.resize)
    cfg = Dinov2Config(hidden_size=d["width"], num_hidden_layers=2, num_attention_heads=d["heads"],
                       mlp_ratio=2, image_size=16, patch_size=8, num_labels=10,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _image_classifier(FlaxDinov2ForImageClassificationModule(cfg), _pixels(True))

MODELS = dict(
    opt=opt,
    gptneo=gptneo,
    bloom=bloom,
    mistral=mistral,
    gptj=gptj,
    bart=bart,
    resnet=resnet,
    wav2vec2=wav2vec2,
    clip_vision=clip_vision,
    bigbird=bigbird,
    albert=albert,
    roformer=roformer,
    whisper=whisper,
    beit=beit,
    dinov2=dinov2,
)


# keras-hub (Keras 3 on the JAX backend): causal LMs built as the mixtral family is
# (:func:`tests.realmodels.families._mixtral`), from their backbones' own arguments.

def _keras_causal(backbone: str, lm: str, **kw):
    keras, keras_hub = families._keras()
    keras.utils.set_random_seed(0)  # Keras initializes variables eagerly, from its global seed
    model = getattr(keras_hub.models, lm)(
        backbone=getattr(keras_hub.models, backbone)(dtype="float32", **kw), preprocessor=None)
    return families.keras_lm_step(model, d)


_KERAS = dict(vocabulary_size=d["vocab"], num_layers=2, hidden_dim=d["width"],
              intermediate_dim=d["ff"])
_KERAS_GQA = dict(_KERAS, num_query_heads=4, num_key_value_heads=2)
_KERAS_MQA = dict(_KERAS, num_query_heads=4, num_key_value_heads=1, head_dim=16)
_KERAS_MHA = dict(_KERAS, num_heads=4, max_sequence_length=64)
KERAS_MODELS = {
    "kh-gemma": lambda: _keras_causal("GemmaBackbone", "GemmaCausalLM", **_KERAS_MQA),
    "kh-gemma3": lambda: _keras_causal("Gemma3Backbone", "Gemma3CausalLM", image_size=16,
                                       **_KERAS_MQA),
    "kh-llama3": lambda: _keras_causal("Llama3Backbone", "Llama3CausalLM", **_KERAS_GQA),
    "kh-mistral": lambda: _keras_causal("MistralBackbone", "MistralCausalLM", sliding_window=8,
                                        **_KERAS_GQA),
    "kh-phi3": lambda: _keras_causal("Phi3Backbone", "Phi3CausalLM", **_KERAS_GQA),
    "kh-qwen": lambda: _keras_causal("QwenBackbone", "QwenCausalLM", **_KERAS_GQA),
    "kh-gpt2": lambda: _keras_causal("GPT2Backbone", "GPT2CausalLM", **_KERAS_MHA),
    "kh-opt": lambda: _keras_causal("OPTBackbone", "OPTCausalLM", **_KERAS_MHA),
}
MODELS.update(KERAS_MODELS)
