"""Third-party models that no test, family or rule of hulkjax was written for, as steps.

Twenty-seven of transformers' Flax modules (fifteen, then twelve more once those were clean) and
eight of keras-hub's causal LMs (Keras 3 on JAX; ``kh-*``), tiny, random-initialized, nothing
downloaded, built the way :mod:`tests.realmodels.families` builds its families (value_and_grad
of a loss, AdamW): ``MODELS[name]() -> (step, state, batch)``. ``benchmarks/unseen.py`` plans, emits and checks
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


def _seq2seq(module):
    """A step for a BART-style encoder-decoder module (``input_ids, attention_mask,
    decoder_input_ids, decoder_attention_mask, position_ids, decoder_position_ids``)."""
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


def _seq2seq_config(config_cls, **kw):
    return config_cls(vocab_size=d["vocab"], d_model=d["width"], encoder_layers=1,
                      decoder_layers=1, encoder_attention_heads=d["heads"],
                      decoder_attention_heads=d["heads"], encoder_ffn_dim=d["ff"],
                      decoder_ffn_dim=d["ff"], max_position_embeddings=64, dropout=0.0, **kw)


def bart():
    from transformers import BartConfig
    from transformers.models.bart.modeling_flax_bart import FlaxBartForConditionalGenerationModule

    return _seq2seq(FlaxBartForConditionalGenerationModule(_seq2seq_config(BartConfig)))


def marian():
    from transformers import MarianConfig
    from transformers.models.marian.modeling_flax_marian import FlaxMarianMTModule

    # sinusoidal positions, a final logits bias
    return _seq2seq(FlaxMarianMTModule(_seq2seq_config(
        MarianConfig, decoder_vocab_size=d["vocab"], pad_token_id=0)))


def mbart():
    from transformers import MBartConfig
    from transformers.models.mbart.modeling_flax_mbart import (
        FlaxMBartForConditionalGenerationModule,
    )

    return _seq2seq(FlaxMBartForConditionalGenerationModule(_seq2seq_config(MBartConfig)))


def pegasus():
    from transformers import PegasusConfig
    from transformers.models.pegasus.modeling_flax_pegasus import (
        FlaxPegasusForConditionalGenerationModule,
    )

    return _seq2seq(FlaxPegasusForConditionalGenerationModule(_seq2seq_config(PegasusConfig)))


def blenderbot_small():
    from transformers import BlenderbotSmallConfig
    from transformers.models.blenderbot_small.modeling_flax_blenderbot_small import (
        FlaxBlenderbotSmallForConditionalGenerationModule,
    )

    return _seq2seq(FlaxBlenderbotSmallForConditionalGenerationModule(
        _seq2seq_config(BlenderbotSmallConfig)))


def xglm():
    from transformers import XGLMConfig
    from transformers.models.xglm.modeling_flax_xglm import FlaxXGLMForCausalLMModule

    cfg = XGLMConfig(vocab_size=d["vocab"], d_model=d["width"], ffn_dim=d["ff"], num_layers=2,
                     attention_heads=d["heads"], max_position_embeddings=64, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0)
    return families._causal_lm(FlaxXGLMForCausalLMModule(cfg), d)


def _batch_stats_classifier(module, **train):
    """A step for an image classifier with BatchNorm (its statistics carried in the state),
    called as ``(pixel_values, **train)`` in training."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 32, 32, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, (8,)), jnp.int32)
    variables = jax.jit(lambda x: module.init(jax.random.PRNGKey(0), x))(x)
    tx = families._optimizer()

    def step(state, batch):
        def loss_fn(params):
            out, upd = module.apply(
                {"params": params, "batch_stats": state["batch_stats"]},
                batch["pixel_values"],
                mutable=["batch_stats"],
                **train,
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


def resnet():
    from transformers import ResNetConfig
    from transformers.models.resnet.modeling_flax_resnet import (
        FlaxResNetForImageClassificationModule,
    )

    cfg = ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10
    )
    return _batch_stats_classifier(FlaxResNetForImageClassificationModule(cfg),
                                   deterministic=False)


def regnet():
    from transformers import RegNetConfig
    from transformers.models.regnet.modeling_flax_regnet import (
        FlaxRegNetForImageClassificationModule,
    )

    # grouped convolutions, squeeze-and-excitation
    cfg = RegNetConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8,
                       num_labels=10)
    return _batch_stats_classifier(FlaxRegNetForImageClassificationModule(cfg),
                                   deterministic=False)


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


def clip():
    """CLIP with its contrastive loss: every text scored against every image of the batch (in-batch
    negatives: the loss couples the examples, so the step cannot be microbatched)."""
    from transformers import CLIPConfig
    from transformers.models.clip.modeling_flax_clip import FlaxCLIPModule

    cfg = CLIPConfig(
        text_config=dict(vocab_size=d["vocab"], hidden_size=d["width"], intermediate_size=d["ff"],
                         num_hidden_layers=1, num_attention_heads=d["heads"],
                         max_position_embeddings=32),
        vision_config=dict(hidden_size=d["width"], intermediate_size=d["ff"], num_hidden_layers=1,
                           num_attention_heads=d["heads"], image_size=16, patch_size=4),
        projection_dim=32)
    module = FlaxCLIPModule(cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(families._tokens(rng, d))
    px = jnp.asarray(rng.standard_normal((d["batch"], 3, 16, 16)), jnp.float32)
    mask = jnp.ones_like(ids)

    def loss_fn(params, b):
        out = module.apply({"params": params}, b["input_ids"], b["pixel_values"],
                           b["attention_mask"], families._positions(b["input_ids"]),
                           deterministic=True)
        logits = out.logits_per_text.astype(jnp.float32)
        labels = jnp.arange(logits.shape[0])
        ce = optax.softmax_cross_entropy_with_integer_labels
        return (ce(logits, labels).mean() + ce(logits.T, labels).mean()) / 2

    params = families._init(module, ids, px, mask, families._positions(ids))
    return families._train_step(loss_fn), families._state(params), {
        "input_ids": ids, "pixel_values": px, "attention_mask": mask}



def clip_text():
    """CLIP's text tower: its pooler reads each example's end-of-text token,
    ``last_hidden_state[jnp.arange(B), input_ids.argmax(-1)]``."""
    from transformers import CLIPTextConfig
    from transformers.models.clip.modeling_flax_clip import FlaxCLIPTextModule

    cfg = CLIPTextConfig(vocab_size=d["vocab"], hidden_size=d["width"], intermediate_size=d["ff"],
                         num_hidden_layers=2, num_attention_heads=d["heads"],
                         max_position_embeddings=32)
    module = FlaxCLIPTextModule(cfg)
    ids = jnp.asarray(families._tokens(np.random.default_rng(0), d))

    def loss_fn(params, b):
        i = b["input_ids"]
        out = module.apply({"params": params}, i, jnp.ones_like(i), families._positions(i),
                           deterministic=True)
        return (out.pooler_output.astype(jnp.float32) ** 2).mean()

    params = families._init(module, ids, jnp.ones_like(ids), families._positions(ids))
    return families._train_step(loss_fn), families._state(params), {"input_ids": ids}

def _encoder_config(config_cls, **kw):
    return config_cls(vocab_size=d["vocab"], hidden_size=d["width"], num_hidden_layers=2,
                      num_attention_heads=d["heads"], intermediate_size=d["ff"],
                      max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, **kw)


def _encoder_args(ids):
    """BERT-style modules' inputs: ids, attention mask, token types, positions, head mask."""
    return ids, jnp.ones_like(ids), jnp.zeros_like(ids), \
        jnp.broadcast_to(jnp.arange(2, 2 + ids.shape[-1]), ids.shape), None


def xlm_roberta_mc():
    """Multiple choice: (batch, choices, sequence), flattened to (batch x choices, sequence) and
    back inside the module."""
    from transformers import XLMRobertaConfig
    from transformers.models.xlm_roberta.modeling_flax_xlm_roberta import (
        FlaxXLMRobertaForMultipleChoiceModule,
    )

    module = FlaxXLMRobertaForMultipleChoiceModule(_encoder_config(XLMRobertaConfig))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, d["vocab"], (d["batch"], 4, d["seq"]), dtype=np.int32))
    labels = jnp.asarray(rng.integers(0, 4, (d["batch"],), dtype=np.int32))

    def loss_fn(params, b):
        logits = module.apply({"params": params}, *_encoder_args(b["input_ids"]),
                              deterministic=True).logits
        return families._token_loss(logits, b["labels"])

    params = families._init(module, *_encoder_args(ids))
    return families._train_step(loss_fn), families._state(params), {"input_ids": ids,
                                                                    "labels": labels}


def electra():
    """ELECTRA's discriminator: a per-token replaced-or-not logit (sigmoid cross-entropy)."""
    from transformers import ElectraConfig
    from transformers.models.electra.modeling_flax_electra import FlaxElectraForPreTrainingModule

    module = FlaxElectraForPreTrainingModule(_encoder_config(ElectraConfig, embedding_size=32))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(families._tokens(rng, d))
    labels = jnp.asarray(rng.integers(0, 2, ids.shape), jnp.float32)

    def loss_fn(params, b):
        logits = module.apply({"params": params}, *_encoder_args(b["input_ids"]),
                              deterministic=True).logits
        return optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), b["labels"]).mean()

    params = families._init(module, *_encoder_args(ids))
    return families._train_step(loss_fn), families._state(params), {"input_ids": ids,
                                                                    "labels": labels}


def bert_pretraining():
    """BERT's two pre-training heads: masked-LM logits and next-sentence prediction."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_flax_bert import FlaxBertForPreTrainingModule

    module = FlaxBertForPreTrainingModule(_encoder_config(BertConfig))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(families._tokens(rng, d))
    nsp = jnp.asarray(rng.integers(0, 2, (d["batch"],)), jnp.int32)

    def loss_fn(params, b):
        out = module.apply({"params": params}, *_encoder_args(b["input_ids"]),
                           deterministic=True)
        return families._token_loss(out.prediction_logits, b["input_ids"]) + \
            families._token_loss(out.seq_relationship_logits, b["nsp"])

    params = families._init(module, *_encoder_args(ids))
    return families._train_step(loss_fn), families._state(params), {"input_ids": ids, "nsp": nsp}


def distilbert_qa():
    """Extractive question answering: start and end logits split off one projection."""
    from transformers import DistilBertConfig
    from transformers.models.distilbert.modeling_flax_distilbert import (
        FlaxDistilBertForQuestionAnsweringModule,
    )

    cfg = DistilBertConfig(vocab_size=d["vocab"], dim=d["width"], n_layers=2, n_heads=d["heads"],
                           hidden_dim=d["ff"], max_position_embeddings=64, dropout=0.0,
                           attention_dropout=0.0, qa_dropout=0.0)
    module = FlaxDistilBertForQuestionAnsweringModule(cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(families._tokens(rng, d))
    start, end = (jnp.asarray(rng.integers(0, d["seq"], (d["batch"],)), jnp.int32)
                  for _ in range(2))

    def loss_fn(params, b):
        out = module.apply({"params": params}, b["input_ids"], jnp.ones_like(b["input_ids"]),
                           deterministic=True)
        return (families._token_loss(out.start_logits, b["start"])
                + families._token_loss(out.end_logits, b["end"])) / 2

    params = families._init(module, ids, jnp.ones_like(ids))
    return families._train_step(loss_fn), families._state(params), {
        "input_ids": ids, "start": start, "end": end}


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
    # A second set, brought in after the first was clean (stop 42):
    marian=marian,
    mbart=mbart,
    pegasus=pegasus,
    blenderbot_small=blenderbot_small,
    xglm=xglm,
    regnet=regnet,
    clip=clip,
    clip_text=clip_text,
    xlm_roberta_mc=xlm_roberta_mc,
    electra=electra,
    bert_pretraining=bert_pretraining,
    distilbert_qa=distilbert_qa,
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
