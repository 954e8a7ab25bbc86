"""Pytest setup shared by the tests and the doctests of ``hulkjax/``: 8 fake CPU devices,
configured before JAX initializes its backends (``tests/conftest.py`` adds the fixtures)."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# A test worker holds many long-lived objects (JAX's caches, traced graphs and cost models, the
# zoo's models), and each of the cyclic collector's full passes walks them all (over half a second
# each late in a run). A young generation of 50,000 objects instead of 700 runs a fifth as many
# full passes: on tests/emit/test_mpmd.py, tests/strategies/test_equivalence.py and
# tests/golden/test_golden.py, 9.8 s in the collector instead of 20.0 s, 207-212 s instead of
# 222-234 s (runs one after another), for a peak of 1.8 GB instead of 1.4 GB. A whole run of the
# suite was not measurably faster against one on another day (31.0 min against 28.8; its tests
# that start processes, which this does not reach, took 1.1-1.7x as long). (hulkjax pauses the
# collector while it traces and plans: hulkjax.heap.)
gc.set_threshold(50_000, 20, 20)

# The tests run tiny programs, so XLA's CPU compile time dominates them: skip LLVM's expensive
# optimizations, emit fusions with XLA's older LLVM emitters instead of the MLIR fusion emitters
# (half the compile time of GPT-2 and LLaMA steps, sharded or not), and skip Eigen's thread pool
# (two pytest workers already share the two cores). On transformers' GPT-2 (megatron), diffusers'
# UNet (dp), transformers' LLaMA (fsdp) and T5 (dp_tp) on 2 x 4, the compiled programs have the
# same collectives, with the same shapes, as under XLA's defaults (the flags act after SPMD
# partitioning); the CPU backend fuses a few dots and transposes differently and sums in another
# order (adamw's first step amplifies that: see the tolerance in
# tests/realmodels/test_unseen_families.py). The launcher's worker processes inherit the flags;
# tests that time what they run use the ``default_backend_optimization`` fixture, which restores
# the flags kept in HULKJAX_TESTS_XLA_FLAGS.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_multi_thread_eigen=false")
os.environ.setdefault("HULKJAX_TESTS_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
_flags = os.environ["HULKJAX_TESTS_XLA_FLAGS"].split()
_set = {f.split("=")[0] for f in _flags}
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _FAST_COMPILE if f.split("=")[0] not in _set])

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
