"""Every benchmark script imports against the current package layout (a moved module once left
``benchmarks/gnn_eval.py`` importing ``hulkjax.gnn.data``, which no longer exists, unnoticed
until the benchmark was rerun). Importing runs nothing: each script works under
``if __name__ == "__main__"``."""

import importlib.util
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_script_imports(path):
    assert '__name__ == "__main__"' in path.read_text(), f"{path.name} runs on import"
    name = f"_benchmark_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
