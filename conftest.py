"""Pytest setup shared by the tests and the doctests of ``hulkjax/``: 8 fake CPU devices,
configured before JAX initializes its backends (``tests/conftest.py`` adds the fixtures)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
