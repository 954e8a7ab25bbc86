"""hulkjax on transformers Flax models that no test, family or rule was written for.

``benchmarks/realmodels.py`` checks eight families the rules were tuned on. This one takes ten
more of the library's Flax modules, as a new user would bring them (tiny random-initialized
configurations, nothing downloaded): OPT, GPT-Neo (local attention), BLOOM (ALiBi), Mistral
(sliding window, grouped-query), GPT-J (partial rotary), BART (encoder-decoder), ResNet (its
batch statistics carried in the state), Wav2Vec2 (convolutional feature extractor, grouped
positional convolution), CLIP's vision tower and BigBird (block-sparse attention). Each is traced,
planned on the 2 x 4 mesh under ``dp``, ``megatron``, ``dp_tp`` and ``auto``, emitted, run one
step and compared with the unsharded ``jax.jit`` step; every hulkjax warning (a primitive without
a rule) is recorded.

Results go to ``benchmarks/results/unseen.json`` and ``benchmarks/UNSEEN.md``::

    python benchmarks/unseen.py                      # every model (about 10 minutes on 2 cores)
    python benchmarks/unseen.py --models clip_vision bigbird
    python benchmarks/unseen.py --report-only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the families' shared pieces live in tests/realmodels
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import hulkjax as hj  # noqa: E402
from hulkjax.errors import HulkjaxWarning  # noqa: E402
from tests.realmodels import families  # noqa: E402
from tests.realmodels.measure import MESHES  # noqa: E402

OUT_JSON = os.path.join(HERE, "results", "unseen.json")
OUT_MD = os.path.join(HERE, "UNSEEN.md")
STRATEGIES = ("dp", "megatron", "dp_tp", "auto")
RTOL = ATOL = 1e-4  # the families' float32 tolerance (adamw's first step amplifies noise)
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

    params = jax.jit(lambda x: module.init(jax.random.PRNGKey(0), x))(x)["params"]
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

    params = jax.jit(lambda x: module.init(jax.random.PRNGKey(0), x))(x)["params"]
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
)


def _max_error(got, want) -> float:
    errs = jax.tree.leaves(
        jax.tree.map(
            lambda a, b: float(
                np.max(
                    np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                    - RTOL * np.abs(np.asarray(b, np.float64)),
                    initial=-np.inf,
                )
            ),
            got,
            want,
        )
    )
    return max(errs)


def run_model(name: str) -> list[dict]:
    families._quiet_transformers()
    step, state, batch = MODELS[name]()
    want = jax.jit(step)(state, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", HulkjaxWarning)
        graph = hj.trace(step, state, batch)
    rows = []
    for strategy in STRATEGIES:
        row = {"model": name, "nodes": len(graph.nodes), "strategy": strategy}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", HulkjaxWarning)
                t0 = time.perf_counter()
                plan = hj.plan(
                    step,
                    state,
                    batch,
                    topology=MESHES["2x4"],
                    strategy=strategy,
                    graph=graph,
                    **({"time_limit": 10} if strategy == "auto" else {}),
                )
                row["plan_s"] = time.perf_counter() - t0
            row["warnings"] = sorted(
                {f"{type(w.message).__name__}: {str(w.message)[:160]}" for w in caught}
            )
            row["predicted_step"] = plan.cost.step_time
            got = hj.emit(step, plan)(state, batch)
            # how far past the tolerance (|got - want| - rtol |want|) the worst element is
            row["excess"] = _max_error(got, want)
            row["equal"] = row["excess"] <= ATOL
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["status"] = "error"
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def report(doc: dict) -> str:
    rows = doc["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    lines = [
        "# Unseen models",
        "",
        f"Generated by `python benchmarks/unseen.py` on {doc['date']} (commit "
        f"`{doc['commit']}`, jax {doc['jax']}, transformers {doc['transformers']}). "
        "transformers' Flax modules that no test, family or rule of hulkjax was written for, "
        "tiny and random-initialized, each planned on the 2 x 4 fake CPU mesh, emitted, run "
        "one step (AdamW) and compared with the unsharded `jax.jit` step (rtol = atol = "
        "1e-4). See the script's docstring for the models.",
        "",
        f"- **Equal to the unsharded step**: {sum(r['equal'] for r in ok)}/{len(rows)} cases.",
        f"- **Errors**: {sum(r['status'] == 'error' for r in rows)}.",
        f"- **Cases with a hulkjax warning** (a primitive without a rule, replicated): "
        f"{sum(bool(r['warnings']) for r in ok)}.",
        "",
        "| model | graph nodes | strategy | equal | predicted step | planning (s) | "
        "warnings / error |",
        "|---|---:|---|---|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] == "ok":
            lines.append(
                f"| {r['model']} | {r['nodes']} | {r['strategy']} | "
                f"{'yes' if r['equal'] else 'NO'} | "
                f"{r['predicted_step'] * 1e6:.1f} us | {r['plan_s']:.1f} | "
                f"{'; '.join(r['warnings']) or '-'} |"
            )
        else:
            lines.append(
                f"| {r['model']} | {r['nodes']} | {r['strategy']} | - | - | - | {r['error']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(OUT_JSON) as f:
            doc = json.load(f)
    else:
        import subprocess
        from importlib import metadata

        from tqdm import tqdm

        rows = []
        for name in tqdm(args.models, desc="models"):
            rows += run_model(name)
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        doc = {
            "date": datetime.date.today().isoformat(),
            "commit": commit,
            "jax": jax.__version__,
            "transformers": metadata.version("transformers"),
            "rows": rows,
        }
        os.makedirs(os.path.dirname(OUT_JSON), exist_ok=True)
        with open(OUT_JSON, "w") as f:
            json.dump(doc, f, indent=1)
    with open(OUT_MD, "w") as f:
        f.write(report(doc))
    print(f"wrote {OUT_JSON} and {OUT_MD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
