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
    """Processes this test launches compile as XLA does by default: ``XLA_FLAGS`` as it was before
    the root ``conftest.py`` added its faster compile flags (-O0, cheap LLVM passes, the older
    fusion emitters, no Eigen thread pool). They time their programs (``hulkjax calibrate``), and
    at -O0 a chain of matmuls long enough to time takes several times longer."""
    monkeypatch.setenv("XLA_FLAGS", os.environ["HULKJAX_TESTS_XLA_FLAGS"])
