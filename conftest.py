"""Pytest setup shared by the tests and the doctests of ``hulkjax/``: 8 fake CPU devices,
configured before JAX initializes its backends (``tests/conftest.py`` adds the fixtures)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
