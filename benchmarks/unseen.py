"""hulkjax on third-party models that no test, family or rule was written for.

``benchmarks/realmodels.py`` checks eight families the rules were tuned on. This one takes
twenty-seven more of the library's Flax modules, as a new user would bring them (tiny
random-initialized configurations, nothing downloaded): OPT, GPT-Neo (local attention), BLOOM
(ALiBi), Mistral (sliding window, grouped-query), GPT-J (partial rotary), BART
(encoder-decoder), ResNet (its batch statistics carried in the state), Wav2Vec2 (convolutional
feature extractor, grouped positional convolution), CLIP's vision tower, BigBird (block-sparse
attention), ALBERT (one layer's weights shared by every layer), RoFormer (rotary), Whisper
(convolutional audio encoder, encoder-decoder), BEiT (relative position bias) and DINOv2
(position embeddings interpolated with ``jax.image.resize``); then, once those were clean,
Marian (sinusoidal positions, a final logits bias), mBART, Pegasus, BlenderbotSmall, XGLM,
RegNet (grouped convolutions, squeeze-and-excitation, batch statistics), CLIP with its
contrastive loss (in-batch negatives: the examples are coupled), CLIP's text tower (its pooler
reads each example's last token, ``x[jnp.arange(B), idx]``), XLM-RoBERTa for multiple
choice (batch x choices flattened inside), ELECTRA's discriminator, BERT's two pre-training heads
and DistilBERT for question answering. LongT5 is left out: its Flax module calls
``jnp.clip(a_max=...)``, which JAX 0.10 removed, so it fails without hulkjax. And eight of
keras-hub's causal LMs on Keras 3's JAX backend (``kh-*``: Gemma, Gemma 3, Llama 3, Mistral,
Phi-3, Qwen, GPT-2, OPT), called through ``stateless_call`` as the ``mixtral`` family is.

Each is traced, planned under ``dp``, ``megatron``, ``dp_tp``, ``ilp`` and ``auto`` on the
2 x 4 fake CPU mesh and on 8 H100s in 2 DGX nodes (where ``auto`` and ``ilp`` stage these
launch-bound tiny steps: staged emission on code we did not write), emitted, run one step and compared with the unsharded ``jax.jit`` step; every hulkjax
warning (a primitive without a rule) is recorded, and ``auto``'s predicted step is set against
``ilp``'s and the best baseline's.

Results go to ``benchmarks/results/unseen.json`` and ``benchmarks/UNSEEN.md``::

    python benchmarks/unseen.py                      # every model (about 35-50 minutes on 2 cores)
    python benchmarks/unseen.py --models clip_vision bigbird
    python benchmarks/unseen.py --merge --models clip regnet   # the rest kept from the JSON
    python benchmarks/unseen.py --report-only
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the families' shared pieces live in tests/realmodels
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import hulkjax as hj  # noqa: E402
from hulkjax.errors import HulkjaxWarning  # noqa: E402
from tests.helpers import assert_trees_close  # noqa: E402
from tests.realmodels import families, unseen_models  # noqa: E402
from tests.realmodels.measure import MESHES  # noqa: E402

OUT_JSON = os.path.join(HERE, "results", "unseen.json")
OUT_MD = os.path.join(HERE, "UNSEEN.md")
STRATEGIES = ("dp", "megatron", "dp_tp", "ilp", "auto")
BASELINES = ("dp", "megatron", "dp_tp")
# The fake CPU mesh the fidelity tests use, and 8 H100s in 2 DGX nodes (planned with the GPU
# cost model, where tiny models are launch-bound and `auto` / `ilp` stage them; emitted and
# run on the 8 fake CPU devices all the same).
TOPOLOGIES = {"cpu 2x4": MESHES["2x4"],
              "2 DGX-H100 x 4": hj.Topology.preset("dgx-h100", nodes=2, gpus_per_node=4)}
RTOL = ATOL = 1e-4  # the families' float32 tolerance (adamw's first step amplifies noise)
MODELS = unseen_models.MODELS


def run_model(name: str) -> list[dict]:
    families._quiet_transformers()
    try:
        step, state, batch = MODELS[name]()
        want = jax.jit(step)(state, batch)
    except Exception as e:  # noqa: BLE001 - the library's module fails without hulkjax
        return [{"model": name, "mesh": "-", "nodes": 0, "strategy": "-", "status": "error",
                 "error": f"unsharded step fails (not hulkjax): {type(e).__name__}: {e}"[:300]}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", HulkjaxWarning)
        graph = hj.trace(step, state, batch)
    rows = []
    for (mesh, topology), strategy in itertools.product(TOPOLOGIES.items(), STRATEGIES):
        row = {"model": name, "mesh": mesh, "nodes": len(graph.nodes), "strategy": strategy}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", HulkjaxWarning)
                t0 = time.perf_counter()
                plan = hj.plan(
                    step,
                    state,
                    batch,
                    topology=topology,
                    strategy=strategy,
                    graph=graph,
                    **({"time_limit": 10} if strategy in ("auto", "ilp") else {}),
                )
                row["plan_s"] = time.perf_counter() - t0
            row["warnings"] = sorted(
                {f"{type(w.message).__name__}: {str(w.message)[:160]}" for w in caught}
            )
            row["predicted_step"] = plan.cost.step_time
            row["plan"] = ("SPMD" if plan.stages is None else
                           f"{len(plan.stages)} stages x {plan.microbatches} mb")
            got = hj.emit(step, plan)(state, batch)
            try:  # the test suite's comparison, leaf by leaf
                assert_trees_close(got, want, rtol=RTOL, atol=ATOL)
                row["equal"] = True
            except AssertionError as e:
                row["equal"] = False
                row["mismatch"] = " ".join(str(e).split())[:300]
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["status"] = "error"
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    one = one_example(graph)  # after the plans: its trace at one example is cached on the graph
    return [{**r, **one} for r in rows]


def one_example(graph) -> dict:
    """Whether the step traces to other operators at one example per microbatch (its per-node
    plans then do not apply there), and whether a broadcast of a size-1 dimension to the batch
    (:func:`hulkjax.trace.microbatch.broadcast_to_the_batch`) tells the staged search so without
    that trace."""
    from hulkjax.errors import UnsupportedStepError
    from hulkjax.strategies.partition import partition
    from hulkjax.trace.microbatch import (
        batch_size,
        broadcast_to_the_batch,
        microbatch_graph,
        structure_mismatch,
    )

    b = batch_size(graph)
    if b is None or b < 2 or partition(graph).split is None:  # (the partition's trace)
        return {}
    try:
        one = microbatch_graph(graph, b)
    except UnsupportedStepError:
        return {}
    return {"one_example_differs": bool(structure_mismatch(graph, one)),
            "broadcast_to_batch": broadcast_to_the_batch(graph) is not None}


def report(doc: dict) -> str:
    rows = doc["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    lines = [
        "# Unseen models",
        "",
        f"Generated by `python benchmarks/unseen.py` on {doc['date']} ({_commits(doc)}, "
        f"jax {doc['jax']}, transformers {doc['transformers']}, "
        f"keras-hub {doc.get('keras_hub', '-')}). "
        "transformers' Flax modules and keras-hub's causal LMs (`kh-*`) that no test, family "
        "or rule of hulkjax was written for, "
        "tiny and random-initialized, each planned on the 2 x 4 fake CPU mesh and on 8 H100s "
        "in 2 DGX nodes (the GPU cost model; `plan` says where `auto` and `ilp` staged the "
        "step), emitted on 8 fake CPU devices, run one step (AdamW) and compared with the "
        "unsharded `jax.jit` step (rtol = atol = 1e-4). See the script's docstring for the "
        "models.",
        "",
        f"- **Equal to the unsharded step**: {sum(r['equal'] for r in ok)}/{len(rows)} cases.",
        f"- **Errors**: {sum(r['status'] == 'error' for r in rows)}.",
        f"- **Cases with a hulkjax warning** (a primitive without a rule, replicated): "
        f"{sum(bool(r['warnings']) for r in ok)}.",
        *_one_example_line(rows),
        *(line for mesh in dict.fromkeys(r.get("mesh", "cpu 2x4") for r in ok)
          for line in _quality(mesh, [r for r in ok if r.get("mesh", "cpu 2x4") == mesh])),
        "",
        "| model | graph nodes | topology | strategy | plan | equal | predicted step | "
        "planning (s) | warnings / error |",
        "|---|---:|---|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['nodes']} | {r.get('mesh', 'cpu 2x4')} | {r['strategy']} |"
        if r["status"] == "ok":
            lines.append(
                f"{head} {r.get('plan', 'SPMD')} | {'yes' if r['equal'] else 'NO'} | "
                f"{r['predicted_step'] * 1e6:.1f} us | {r['plan_s']:.1f} | "
                f"{'; '.join(r['warnings']) or '-'} |"
            )
        else:
            lines.append(f"{head} - | - | - | - | {r['error']} |")
    return "\n".join(lines) + "\n"


def _one_example_line(rows) -> list[str]:
    by = {r["model"]: r for r in rows if "one_example_differs" in r}
    if not by:
        return []
    differ = sum(r["one_example_differs"] for r in by.values())
    told = sum(r["broadcast_to_batch"] for r in by.values())
    wrong = sorted(m for m, r in by.items() if r["broadcast_to_batch"]
                   and not r["one_example_differs"])
    return [f"- **One example per microbatch**: {differ} of {len(by)} models trace to other "
            f"operators there (the staged search cannot use that count); {told} stretch a size-1 "
            f"dimension to the batch, which tells the search so without that trace"
            + (f" (wrongly for {', '.join(wrong)})" if wrong else "") + "."]


def _commits(doc: dict) -> str:
    """The commit of the rows (``--merge`` keeps rows of earlier runs: each says its own)."""
    n: dict[str, set] = {}
    for r in doc["rows"]:
        n.setdefault(r.get("commit", doc["commit"]), set()).add(r["model"])
    if len(n) == 1:
        return f"commit `{next(iter(n))}`"
    return "commits " + ", ".join(f"`{c}` ({len(m)} models)" for c, m in n.items())


def _quality(mesh: str, rows) -> list[str]:
    """``auto``'s predicted step against ``ilp``'s (the cost model's optimum within its time
    limit) and against the best of the baselines run, per model, on one topology: summary
    lines."""
    by = {(r["model"], r["strategy"]): r["predicted_step"] for r in rows}
    models = sorted({m for m, _ in by})
    vs_ilp = [by[(m, "auto")] / by[(m, "ilp")] for m in models
              if (m, "auto") in by and (m, "ilp") in by]
    base = [by[(m, "auto")] / min(by[(m, s)] for s in BASELINES if (m, s) in by)
            for m in models if (m, "auto") in by and any((m, s) in by for s in BASELINES)]
    out = []
    if vs_ilp:
        out.append(f"- **{mesh}: `auto` / `ilp`**, predicted step: median "
                   f"{statistics.median(vs_ilp):.3f}, range {min(vs_ilp):.3f}-{max(vs_ilp):.3f} "
                   f"over {len(vs_ilp)} models (`ilp` under a 10 s limit: the cost model's "
                   f"optimum where it proves it).")
    if base:
        out.append(f"- **{mesh}: `auto` / the best of `dp`, `megatron`, `dp_tp`**, predicted step: "
                   f"median {statistics.median(base):.3f}, range {min(base):.3f}-{max(base):.3f}.")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other models' rows of the existing JSON (each row records "
                         "its commit, the report lists them)")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(OUT_JSON) as f:
            doc = json.load(f)
    else:
        import subprocess
        from importlib import metadata

        from tqdm import tqdm

        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        rows = []
        for name in tqdm(args.models, desc="models"):
            rows += [{**r, "commit": commit} for r in run_model(name)]
        if args.merge and os.path.exists(OUT_JSON):
            with open(OUT_JSON) as f:
                old = json.load(f)
            kept = [{"commit": old["commit"], **r} for r in old["rows"]
                    if r["model"] not in args.models]
            order = {m: k for k, m in enumerate(MODELS)}
            rows = sorted(kept + rows, key=lambda r: order.get(r["model"], len(order)))
        doc = {
            "date": datetime.date.today().isoformat(),
            "commit": commit,
            "jax": jax.__version__,
            "transformers": metadata.version("transformers"),
            "keras_hub": metadata.version("keras-hub"),
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
