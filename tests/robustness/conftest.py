"""Fixtures shared by the robustness tests."""

import pytest

from hulkjax import zoo


@pytest.fixture(scope="module")
def mlp():
    """The tiny MLP (sgd) and its initial (state, batch)."""
    m = zoo.get("mlp", size="tiny", optimizer="sgd")
    state, batch = m.init(0)
    return m, state, batch
