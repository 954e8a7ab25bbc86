"""Test fixtures. The 8 fake CPU devices are set up by the repository's root ``conftest.py``
(before JAX initializes its backends), which the doctests of ``hulkjax/`` share.

Warnings from hulkjax itself are errors (see ``filterwarnings`` in pyproject.toml).
"""

import os

import jax
import pytest

_compiles: list[str] = []


def _on_event(name, *_args, **_kw):
    if name == "/jax/core/compile/backend_compile_duration":
        _compiles.append(name)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.fixture
def compile_count():
    """A callable returning how many XLA backend compilations happened since the test began."""
    start = len(_compiles)
    return lambda: len(_compiles) - start


@pytest.fixture
def default_backend_optimization(monkeypatch):
    """Processes this test launches compile as XLA does by default, without the faster compile
    flags the root ``conftest.py`` sets (-O0, cheap LLVM passes, no Eigen thread pool): they time
    their programs (``hulkjax calibrate``), and at -O0 a chain of matmuls long enough to time
    takes several times longer."""
    fast = ("--xla_backend_optimization_level", "--xla_llvm_disable_expensive_passes",
            "--xla_cpu_multi_thread_eigen")  # the root conftest.py's _FAST_COMPILE
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(fast)]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
