"""Predicted MFU of published expert recipes, next to the MFU they publish.

For each configuration that public recipes let us rebuild (MaxText's tiering table; see
``/work/shared/reference/anchors.md``), the zoo's ``llama`` model is built at the recipe's shapes
as MaxText runs them: bf16, the decoder layers as one scan over parameters stacked on a layer
axis (``scan_layers=True``, MaxText's default), every layer rematerialized inside the scan body,
causal attention by a flash-attention kernel (``attention="flash"``: JAX's Pallas kernel, where
the recipes run MaxText's splash kernel); traced with abstract arguments, planned with
``strategy="expert"`` (the recipe's own layout: MaxText's TPU recipes are FSDP over the whole
slice, which is what ``expert`` writes on a TPU torus) on the TPU preset, and its predicted step
time turned into MFU with MaxText's model-FLOPs formula. Nothing is tuned to the published
numbers. Writes ``benchmarks/results/published.json`` and ``benchmarks/PUBLISHED.md``.

Each recipe's row is followed by where the prediction comes from: the operators with the largest
predicted compute time and the buffers live at the predicted peak of memory
(``CostModel.breakdown`` of the planned program, per chip), so a gap to the published figure can
be traced to the operators that make it. What is modelled as the zoo's code is written, not as
the recipes run it: the attention kernel is JAX's GPU flash-attention kernel, costed from its own
body and block schedule (:mod:`hulkjax.trace.kernels`: its FLOPs with the causal mask's skipped
blocks, its HBM reads of keys and values per query block), not the TPU splash kernel; the
grouped key/value heads are repeated before it (``jnp.repeat``), where splash reads them shared;
the recipes' custom remat policies are modelled by what they offload (the values they name
``offload`` to host memory, the zoo's ``offload`` option: copied out in the forward pass and
back in the backward pass over the chip's host link, asynchronously, and not held in HBM), the
rest of each layer rematerialized (where the recipes save some values on the chip, the zoo
recomputes them); the TPU presets are datasheet rooflines (no measured matmul or HBM efficiency,
unlike the NVIDIA kinds). ``--attention softmax`` plans the ``jnp`` softmax attention instead
(the T x T scores in HBM), the comparison that shows what the kernel changes.

NVIDIA's H100 BF16 tables (``NVIDIA/dgxc-benchmarking``, NeMo on DGX H100; FP8 rows are left
out, the cost model prices bf16) give Llama 3.1 8B on one node: TP1 PP1 CP2, so DP4, MBS 1, GBS
128, no activation recompute. Those rows plan the zoo model at the recipe's shapes with
``remat=False`` and ``microbatches=16`` (gradient accumulation: a scan over microbatches around
the layers' scan) on the ``dgx-h100`` preset under the recipe's mesh (``with_mesh((4, 2), ("dp",
"cp"))``), the batch split over both axes, and take NVIDIA's MFU
peak (989 TFLOP/s), laid out by ``strategy="zero"``: the recipe's distributed optimizer
(``distributed_fused_adam``: the Adam state sharded over the data-parallel GPUs, the parameters
whole). Context parallelism cannot be expressed (the
markdown's ``H100_MODELLED`` paragraph says why and what is run instead: 8-way data parallelism
with the recipe's tokens per GPU per step). The 70B row (64 GPUs, TP4 PP4 CP2 VP5), Nemotron4
15B and GPT-3 175B are not reconstructed: the 70B needs a staged plan with interleaved virtual
stages and tensor parallelism inside each stage, on top of the context parallelism that is
missing here; the other two are not zoo models. Each row's breakdown also lists the operators
inside the planned loops (their body's time x the loops' trips), where a scan holds the step.

Scanned, each iteration gathers its layer's FSDP-sharded weights inside the body (forward, and
again in the backward scan), so no gathered weight is held across layers; the unrolled program,
where XLA gathers each weight once for its forward and backward uses, holds every layer's.
Tracing and planning a scan costs the same at any depth (one body, costed x trip count), so the
whole model is always planned (the former ``--layers N`` extrapolation is gone).

    python benchmarks/published.py [--attention softmax --out ... --md ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import jax

import hulkjax as hj
from hulkjax import zoo
from hulkjax.strategies import plan_cost_model

HERE = os.path.dirname(os.path.abspath(__file__))

MAXTEXT_CONFIGS = "AI-Hypercomputer/maxtext benchmarks/maxtext_trillium_model_configs.py"
MAXTEXT_V5P = "AI-Hypercomputer/maxtext MaxText/configs/v5p/llama2_70b.sh"
DGXC = "NVIDIA/dgxc-benchmarking"
DGXC_24_11 = f"{DGXC} v24.11.1 (commit 35a9aecc8d5b)"
DGXC_25_04 = f"{DGXC} v25.04.01 (commit 85380ffe02ea)"
H100_BF16_PEAK = 989e12  # NVIDIA's MFU denominator in those READMEs ("H100 BF16 is 989 TFLOPS")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str  # as the published table names it
    size: str  # zoo llama preset
    topology: str  # hulkjax preset
    topology_kwargs: dict
    per_device_batch: int
    seq_len: int
    published_mfu: float
    source: str  # where the layout and batch come from
    remat: str  # the recipe's remat policy (we rematerialize whole layers, or none)
    platform: str = "TPU / MaxText"  # whose hardware and whose published number
    mesh: tuple | None = None  # ((shape), (axis names)): the recipe's mesh over the preset's devices
    strategy: str = "expert"  # the hulkjax layout that writes the recipe's
    rematerialize: bool = True  # every layer rematerialized (False: none, as NeMo's recipes)
    microbatches: int = 1  # gradient accumulation steps (NeMo's GA = GBS / (DP x MBS))
    offload: tuple[str, ...] = ()  # values the remat policy offloads to host (MaxText's names)
    peak_flops: float | None = None  # the publisher's MFU peak per chip (None: the preset's)


RECIPES = (
    Recipe("Llama 2 70B, v6e-256", "llama2-70b", "tpu-v6e", {"shape": (16, 16)}, 4, 4096, 0.438,
           f"{MAXTEXT_CONFIGS} llama2_70b_4096: per_device_batch_size=4, FSDP over the slice "
           "(ici_fsdp_transpose_parallelism=-1), flash attention", "full"),
    Recipe("Llama 2 70B, v5p-512 (256 chips)", "llama2-70b", "tpu-v5p", {"shape": (4, 8, 8)}, 4,
           4096, 0.654, f"{MAXTEXT_V5P}: 4M-token global batch on one v5p-512 (4 per chip), FSDP "
           "over the slice", "full (assumed as on v6e)"),
    Recipe("Llama 3.1 8B, v6e-256", "llama3-8b", "tpu-v6e", {"shape": (16, 16)}, 4, 8192, 0.455,
           f"{MAXTEXT_CONFIGS} llama3_1_8b_8192: per_device_batch_size=4, ici_fsdp_parallelism=-1, "
           "flash attention", "custom: layer inputs and q/k/v/out projections offloaded to host",
           offload=("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")),
    Recipe("Llama 3.1 70B, v6e-256", "llama3-70b", "tpu-v6e", {"shape": (16, 16)}, 5, 8192,
           0.5033, f"{MAXTEXT_CONFIGS} llama3_1_70b_8192 (MFU from MaxText's "
           "docs/reference/models/tiering.md): per_device_batch_size=5, ici_fsdp_parallelism=-1, "
           "flash attention", "custom: layer inputs and q/k/v projections offloaded to host",
           offload=("decoder_layer_input", "query_proj", "key_proj", "value_proj")),
    # NVIDIA's H100 BF16 pre-training tables (NeMo on DGX H100). Llama 3.1 8B on one node: TP1
    # PP1 CP2 (so DP4), MBS 1, GBS 128, GA 32. Modelled as data parallel over all 8 GPUs (the
    # recipe's (dp=4, cp=2) mesh, the batch split over both axes) with GA 16: see the docstring.
    Recipe("Llama 3.1 8B, 8x H100 (NeMo 24.09)", "llama3-8b", "dgx-h100", {}, 16, 8192, 0.5937,
           f"{DGXC_24_11} llama3.1/README_8b.md (BF16 table: 12.91 s/step, 81222 tok/s, MFU "
           "59.37%) and llama3.1/llama3.1_8b.yaml: GBS 128, MBS 1, seq 8192, TP1 PP1 CP2, "
           "distributed_fused_adam, use_flash_attention, bf16",
           "none (activations_checkpoint_granularity: null)", platform="H100 / NVIDIA",
           mesh=((4, 2), ("dp", "cp")), strategy="zero", rematerialize=False, microbatches=16,
           peak_flops=H100_BF16_PEAK),
    Recipe("Llama 3.1 8B, 8x H100 (NeMo 25.02.01)", "llama3-8b", "dgx-h100", {}, 16, 8192,
           0.6247, f"{DGXC_25_04} llama3.1/README.md (table: 8b BF16 8 GPUs TP1 PP1 CP2 DP4 MBS1 "
           "GBS128 GA32; BF16 results: 12.27 s/step, 85459 tok/s, MFU 62.47%); its other "
           "settings are NeMo 25.02's llama3_8b pretrain_recipe(performance_mode=True), not in "
           "that repository", "none (assumed as in v24.11.1)", platform="H100 / NVIDIA",
           mesh=((4, 2), ("dp", "cp")), strategy="zero", rematerialize=False, microbatches=16,
           peak_flops=H100_BF16_PEAK),
)


def model_flops(cfg, batch: int) -> float:
    """Training FLOPs per step as MaxText counts them for MFU (``calculate_tflops_training_per_
    device``, 2024): 3 x (2 x weights' multiply-adds per token) plus 3 x the attention matmuls
    over the full (non-causal) sequence; rematerialization not counted."""
    tokens = batch * cfg.seq_len
    hd = cfg.d_model // cfg.n_heads
    ffn = 2 * tokens * cfg.d_ff * cfg.d_model * 3  # gate, up, down
    qkv = 2 * tokens * cfg.d_model * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    proj = 2 * tokens * cfg.n_heads * hd * cfg.d_model
    embed = 2 * tokens * cfg.d_model * cfg.vocab_size  # the LM head
    attention = 4 * batch * cfg.seq_len**2 * cfg.n_heads * hd
    return 3 * ((ffn + qkv + proj) * cfg.n_layers + embed) + 3 * attention * cfg.n_layers


def topology(recipe: Recipe):
    """The recipe's devices (a hulkjax preset) under the recipe's mesh, where it names one."""
    topo = hj.Topology.preset(recipe.topology, **recipe.topology_kwargs)
    return topo if recipe.mesh is None else topo.with_mesh(*recipe.mesh)


def _plan(recipe: Recipe, topo, attention: str = "flash"):
    m = zoo.get("llama", size=recipe.size, seq_len=recipe.seq_len,
                batch=recipe.per_device_batch * topo.num_devices, dtype="bfloat16",
                remat=recipe.rematerialize, microbatches=recipe.microbatches,
                scan_layers=True, attention=attention, offload=recipe.offload)
    state, batch = m.abstract()
    t0 = time.perf_counter()
    g = hj.trace(m.step, state, batch)
    t1 = time.perf_counter()
    plan = hj.plan(m.step, state, batch, topology=topo, strategy=recipe.strategy, graph=g)
    return m, plan, t1 - t0, time.perf_counter() - t1


def where_it_goes(graph, topo, plan, top: int = 6) -> dict:
    """The planned program's largest costs, from the cost model's per-operator breakdown: compute
    seconds per operator (the biggest single nodes, with their result's shape, dtype and layout)
    and the buffers live at the peak of memory, summed by (kind, producer, shape)."""
    cm = plan_cost_model(graph, topo, plan)
    b = cm.breakdown(plan.assignment)
    nodes = sorted(range(len(graph.nodes)), key=lambda i: -b.compute[i])[:top]
    compute = [_op_row(graph, b, i, graph.nodes[i].primitive.name, b.compute[i])
               for i in nodes]
    held: dict[tuple, float] = {}
    for u in b.memory:
        n = None if u.node is None else graph.nodes[u.node]
        shape = None if n is None or not n.outputs else tuple(graph.values[n.outputs[0]].shape)
        key = (u.kind, None if n is None else n.primitive.name, shape)
        held[key] = held.get(key, 0.0) + u.bytes
    memory = [{"kind": k[0], "producer": k[1], "shape": None if k[2] is None else list(k[2]),
               "gb": v / 1e9} for k, v in sorted(held.items(), key=lambda kv: -kv[1])[:top]]
    inside = sorted(_inside_loops(cm, plan.assignment), key=lambda c: -c["seconds"])[:top]
    return {"compute": compute, "memory": memory, "inside_loops": inside}


def _op_row(graph, b, i: int, name: str, seconds: float) -> dict:
    """One operator's row of the breakdown tables: ``name``, ``seconds``, and its result's
    shape, dtype and layout under breakdown ``b``."""
    n = graph.nodes[i]
    o = graph.values[n.outputs[0]] if n.outputs else None
    return {"primitive": name, "seconds": seconds,
            "shape": None if o is None else list(o.shape),
            "dtype": None if o is None else o.dtype,
            "layout": None if o is None else str(b.specs.get(n.outputs[0]))}


def _inside_loops(cm, assignment, where: str = "", trips: int = 1) -> list[dict]:
    """Every operator inside the planned loops, its body's compute seconds x the trips of every
    loop around it (the scanned layers inside a scan over microbatches: x 16 x 32), with the
    loops it sits in (``scan[16] > scan[32]``)."""
    out = []
    g = cm.graph
    for grp in cm.groups:
        node = None if grp.leader is None else g.nodes[grp.leader]
        if node is None or not node.subgraphs:
            continue
        r = grp.candidates[assignment[grp.id]]
        for body in getattr(r, "bodies", ()):
            path = f"{where}{node.primitive.name}[{r.trips}] > "
            bcm, ba = body.cost_model, list(body.assignment)
            b = bcm.breakdown(ba)
            out += [_op_row(body.graph, b, i, path + n.primitive.name,
                            b.compute[i] * r.trips * trips)
                    for i, n in enumerate(body.graph.nodes) if not n.subgraphs and b.compute[i]]
            out += _inside_loops(bcm, ba, path, r.trips * trips)
    return out


def measure(recipe: Recipe, attention: str = "flash") -> dict:
    topo = topology(recipe)
    m, plan, trace_s, plan_s = _plan(recipe, topo, attention)
    c = plan.cost
    breakdown = where_it_goes(plan.graph, topo, plan)
    ov = plan_cost_model(plan.graph, topo, plan).overlapped(plan.assignment)
    step, compute, comm = c.step_time, c.compute_time, c.comm_time
    cfg = m.config
    batch = recipe.per_device_batch * topo.num_devices
    flops = model_flops(cfg, batch)
    peak = topo.num_devices * (recipe.peak_flops or topo.slowest_device().peak_flops)
    mfu = flops / (step * peak)
    graph_flops = c.ideal_time * peak  # the traced program's FLOPs (remat included)
    return {
        "recipe": recipe.name, "platform": recipe.platform, "model": recipe.size,
        "topology": topo.name, "mesh": dict(zip(topo.axis_names, topo.shape)),
        "strategy": recipe.strategy, "microbatches": recipe.microbatches,
        "peak_flops_per_chip": peak / topo.num_devices,
        "chips": topo.num_devices, "global_batch": batch, "seq_len": recipe.seq_len,
        "layers": cfg.n_layers, "scan_layers": cfg.scan_layers, "remat": recipe.remat,
        "rematerialized": recipe.rematerialize,
        "attention": attention,
        "source": recipe.source,
        "published_mfu": recipe.published_mfu, "predicted_mfu": mfu,
        "ratio": mfu / recipe.published_mfu,
        "overlapped_step_s": ov.step_time,
        "predicted_mfu_overlapped": flops / (ov.step_time * peak),
        "ratio_overlapped": flops / (ov.step_time * peak) / recipe.published_mfu,
        "offload": list(recipe.offload),
        "overlap": {"backend": ov.backend, "compute_s": ov.compute_time,
                    "comm_s": ov.comm_time, "hidden_comm_s": ov.hidden_comm_time,
                    "host_copy_s": ov.host_copy_time,
                    "exposed_host_copy_s": ov.exposed_host_copy_time,
                    "exposed_comm_s": ov.exposed_comm_time,
                    "reused_comm_s": ov.reused_comm_time,
                    "collectives": [{"kind": k.kind, "axes": list(k.axes), "bytes": k.bytes,
                                     "count": k.count, "trips": k.trips, "seconds": k.seconds,
                                     "hidden_seconds": k.hidden_seconds}
                                    for k in ov.collectives]},
        "step_s": step, "compute_s": compute, "comm_s": comm,
        "mfu_compute_only": flops / (compute * peak),
        "mfu_if_comm_hidden": flops / (max(compute, comm) * peak),
        "graph_flops_over_model_flops": graph_flops / flops,
        "peak_memory_gb": c.peak_memory / 1e9, "memory_gb": c.memory_capacity / 1e9,
        "fits": c.fits, "comm_by_axis_s": dict(c.comm_time_by_axis),
        "notes": plan.notes, "trace_s": trace_s, "plan_s": plan_s,
        "breakdown": breakdown,
    }


def _host_copies(r: dict) -> str:
    """The table's host-copies cell: seconds per step, and how many of them run under compute."""
    total = r["overlap"].get("host_copy_s", 0.0)
    if not total:
        return "-"
    return f"{total:.2f} ({total - r['overlap']['exposed_host_copy_s']:.2f} hidden)"


H100_MODELLED = (
    "What the H100 rows model differently from NVIDIA's recipe (TP1 PP1 CP2 DP4, MBS 1, GA 32, "
    "distributed optimizer, no activation recompute, bf16, Transformer Engine's fused "
    "attention): (1) *context parallelism is not expressed*: hulkjax's loop planner splits a "
    "scanned body's data along the batch only (its boundary hypotheses), and the causal flash "
    "kernel cannot be split along the query sequence (its mask reads the query-block index), so "
    "the sequence cannot stay split over `cp` through attention (Megatron runs ring attention, "
    "exchanging key/value blocks between the two CP ranks). With the recipe's 32 microbatches "
    "of one sequence per dp rank, `cp` then has nothing to split and both of its GPUs repeat the "
    "microbatch (the plan's compute is 1.3x). The rows therefore run the same tokens per GPU "
    "per step as 8-way data parallelism: 16 microbatches of 8 sequences, one whole 8192-token "
    "sequence per GPU in each (the recipe: 32 microbatches, half a sequence per GPU). The "
    "FLOPs per GPU are the recipe's (ring attention balances the causal work over the CP "
    "ranks); the key/value exchange is not costed, and each GPU holds twice the recipe's "
    "activations. (2) *The distributed optimizer*: `strategy=\"zero\"` shards the Adam moments "
    "over the 8 GPUs where the bf16 parameters stay whole (the cost model decides optimizer "
    "state apart from its parameter), so each GPU runs the update on 1/8 of the state and the "
    "new parameters are all-gathered, as the recipe's `distributed_fused_adam` does (which also "
    "shards fp32 master weights the zoo's AdamW does not keep). The loop body, planned by "
    "search, reduce-scatters each microbatch's weight gradients (the recipe reduce-scatters the "
    "accumulated ones once per step). With `dp` instead (the moments replicated, the whole "
    "update on every GPU): 15.02 s and 136 GB per GPU, against 14.98 s and 108 GB. (3) The zoo's AdamW keeps "
    "bf16 moments and no fp32 master weights, and accumulates the gradients in bf16 (Megatron: "
    "fp32 main grads, accumulation fused into the weight-gradient GEMMs). (4) Attention is JAX's "
    "Pallas flash kernel, key/value heads repeated before it, where the recipe runs cuDNN's "
    "fused attention (Transformer Engine). (5) The H100 is the preset's, with the matmul, "
    "HBM and per-kernel efficiencies measured on one H100 with XLA:GPU "
    "(`benchmarks/GPU.md`), not Transformer Engine's kernels; NVLink as 450 GB/s per GPU.")
"""What the H100 / NVIDIA rows model, and what they leave out (written under the table)."""


def markdown(rows: list[dict], command: str) -> str:
    out = ["# Published recipes: predicted against published MFU", "",
           f"Generated by `{command}` (see the script's docstring for the method). Two "
           "publishers: *TPU / MaxText* rows are MaxText's TPU recipes; *H100 / NVIDIA* rows are "
           "NVIDIA's BF16 pre-training tables for NeMo on DGX H100 (`NVIDIA/dgxc-benchmarking`; "
           "the sources below give commit and file). MFU = model FLOPs (MaxText's formula, which "
           "is also NVIDIA's: weights and non-causal attention, x3 for training, "
           "rematerialization not counted; 4.74e14 per 8192-token Llama 3.1 8B sequence, as "
           "NVIDIA's README computes) / (predicted step time x chips x bf16 peak: the preset's "
           "for TPUs, NVIDIA's 989 TFLOP/s for H100). TPU rows: the layout "
           "is `strategy=\"expert\"`, which on a TPU torus is FSDP over every axis, as the "
           "recipes are; the layers are one scan (MaxText's `scan_layers=True`), each "
           "rematerialized inside the scan body, so each layer's weights are gathered inside "
           "the body, forward and backward, and none is held across layers; the Llama 3.1 "
           "recipes' values offloaded to host memory as their remat policies offload them (the "
           "sources below name them), the rest of each layer recomputed. H100 rows: the "
           "recipe's mesh of 4 (dp) x 2 (cp) GPUs with the batch split over both axes "
           "(`strategy=\"zero\"`: parameters replicated, optimizer state sharded), no "
           "rematerialization, gradient accumulation over 16 microbatches of one sequence per GPU "
           "(a scan around the layers' scan); the recipe's context parallelism is not expressed "
           "(what differs is listed under the table). Attention: "
           + ("a flash-attention kernel (JAX's Pallas kernel, costed as one operator from its "
              "body and block schedule), as the recipes run a flash kernel."
              if rows and rows[0].get("attention") == "flash" else
              "`jnp` softmax, the T x T scores in HBM (the recipes run a flash kernel)."), "",
           "Two predictions: *no overlap*, the cost model's additive step time (compute + "
           "communication, what the planners minimize), and *overlapped*, the same program "
           "scheduled as XLA's latency-hiding scheduler overlaps collectives with independent "
           "compute (`hulkjax.cost.overlap`: each loop body scheduled on its own, one collective "
           "in flight per kind on TPU; the compiled program's collectives, a gather that "
           "several operators read made once, where the additive cost charges it per reader: "
           "*comm, compiled* is that program's communication, of which *comm hidden* runs under "
           "compute). The overlapped step is compute + (comm, compiled - comm hidden) + the "
           "host copies the compute stream waits for. *Host copies*: the copies of the values a "
           "recipe's remat policy offloads, to host memory in the forward pass and back in the "
           "backward pass, over the chip's host link (the additive step counts them in its "
           "compute; overlapped, they run asynchronously beside compute, *hidden* the part "
           "under it). *MFU, comm hidden* is the bound where all of the additive communication "
           "would be hidden.", "",
           "| recipe | platform / publisher | chips | global batch x seq | layers (scanned) | published MFU | predicted "
           "MFU, no overlap | ratio | predicted MFU, overlapped | ratio | step (s) | step, "
           "overlapped (s) | compute (s) | comm (s) | comm, compiled (s) | comm hidden (s) | "
           "host copies (s) | MFU, compute only | MFU, comm hidden | traced / model FLOPs | "
           "peak memory (GB) |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"
           "---:|---:|---:|"]
    for r in rows:
        layers = f"{r['layers']}" + (" (scan)" if r.get("scan_layers") else "")
        out.append(
            f"| {r['recipe']} | {r.get('platform', 'TPU / MaxText')} | {r['chips']} | {r['global_batch']} x {r['seq_len']} | {layers} | "
            f"{r['published_mfu']:.1%} | {r['predicted_mfu']:.1%} | {r['ratio']:.2f} | "
            f"{r['predicted_mfu_overlapped']:.1%} | {r['ratio_overlapped']:.2f} | "
            f"{r['step_s']:.2f} | {r['overlapped_step_s']:.2f} | {r['compute_s']:.2f} | "
            f"{r['comm_s']:.2f} | {r['overlap']['comm_s']:.2f} | "
            f"{r['overlap']['hidden_comm_s']:.2f} | {_host_copies(r)} | "
            f"{r['mfu_compute_only']:.1%} | {r['mfu_if_comm_hidden']:.1%} | "
            f"{r['graph_flops_over_model_flops']:.2f} | "
            f"{r['peak_memory_gb']:.0f} of {r['memory_gb']:.0f}"
            f"{'' if r['fits'] else ' (does not fit)'} |")
    out += ["", "Sources of the recipes (layout, batch, remat) and of the published numbers:", ""]
    out += [f"- {r['recipe']} ({r.get('platform', 'TPU / MaxText')}): {r['source']}; remat "
            f"{r['remat']}" + (f" (offloaded here: {', '.join(r['offload'])})"
                               if r.get("offload") else "") + "." for r in rows]
    if any(r.get("platform") == "H100 / NVIDIA" for r in rows):
        out += ["", H100_MODELLED]
    out += ["", "## Where the predicted time and memory go", "",
            "Per recipe, from the cost model's per-operator breakdown of the planned program "
            "(`CostModel.breakdown`; a loop's time and memory are its node's: the scan's body "
            "costed x its trip count, and the body's peak as a transient at the scan): the "
            "operators with the "
            "largest predicted compute time, and the buffers live at the predicted peak of memory "
            "summed by kind, producer and shape (per chip).", ""]
    for r in rows:
        bd = r.get("breakdown")
        if not bd:
            continue
        out += [f"### {r['recipe']}", "", "| operator | result (global shape, dtype, layout) | "
                "predicted s |", "|---|---|---:|"]
        out += [f"| {c['primitive']} | {tuple(c['shape'] or ())} {c['dtype']} {c['layout']} | "
                f"{c['seconds']:.3f} |" for c in bd["compute"]]
        if bd.get("inside_loops"):
            out += ["", "Inside the loops (per operator of a loop body, its time x the loops' "
                    "trips; shapes per iteration):", "",
                    "| operator (in loops) | result (shape, dtype, layout) | predicted s |",
                    "|---|---|---:|"]
            out += [f"| {c['primitive']} | {tuple(c['shape'] or ())} {c['dtype']} "
                    f"{c['layout']} | {c['seconds']:.3f} |" for c in bd["inside_loops"]]
        out += ["", "| held at the peak | producer | global shape | GB per chip |",
                "|---|---|---|---:|"]
        out += [f"| {m['kind']} | {m['producer'] or 'input'} | "
                f"{'' if m['shape'] is None else tuple(m['shape'])} | {m['gb']:.2f} |"
                for m in bd["memory"]]
        out.append("")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", choices=("flash", "softmax"), default="flash",
                    help="the zoo llama's attention: JAX's Pallas flash-attention kernel, as the "
                         "recipes run theirs (default), or jnp softmax with the scores in memory")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "published.json"))
    ap.add_argument("--md", default=os.path.join(HERE, "PUBLISHED.md"))
    args = ap.parse_args()
    rows = []
    for recipe in RECIPES:
        r = measure(recipe, args.attention)
        print(f"{r['recipe']}: predicted MFU {r['predicted_mfu']:.1%} (overlapped "
              f"{r['predicted_mfu_overlapped']:.1%}) vs published "
              f"{r['published_mfu']:.1%} (ratio {r['ratio']:.2f}); trace {r['trace_s']:.1f} s, "
              f"plan {r['plan_s']:.1f} s", flush=True)
        rows.append(r)
    command = "python benchmarks/published.py" + (
        "" if args.attention == "flash" else f" --attention {args.attention}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": command, "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "jax": jax.__version__, "rows": rows}, f, indent=1)
    with open(args.md, "w") as f:
        f.write(markdown(rows, command))


if __name__ == "__main__":
    main()
