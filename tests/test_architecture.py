"""The package's structure stays true: the import-linter contracts hold (layers, the zoo as a side
package, no cycles between siblings), no module imports another's in a cycle (function-level imports
included), and no module imports another package's private names."""

import ast
import pathlib
import tomllib

import grimp
import networkx as nx
import pytest

import hulkjax

ROOT = pathlib.Path(hulkjax.__file__).parent
PYPROJECT = ROOT.parent / "pyproject.toml"


def _package(module: str) -> str:
    """``hulkjax.strategies.ilp`` -> ``hulkjax.strategies``; ``hulkjax.api`` -> ``hulkjax.api``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _layers() -> list:
    """The layers contract of pyproject.toml as grimp layers (``a | b``: independent siblings)."""
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in config if c["type"] == "layers")
    return [grimp.Layer(*(t.strip() for t in layer.split("|"))) for layer in contract["layers"]]


def test_layers_contract_holds():
    graph = grimp.build_graph("hulkjax")
    illegal = graph.find_illegal_dependencies_for_layers(layers=_layers(), containers={"hulkjax"})
    assert not illegal, [(d.importer, d.imported, [r.route for r in d.routes]) for d in illegal]


@pytest.mark.parametrize("importer,imported", [
    ("hulkjax.trace.graph", "hulkjax.cost.model"),  # a low layer reaching up
    ("hulkjax.rules.sharding", "hulkjax.emit.spmd"),  # independent siblings
    ("hulkjax.strategies.auto", "hulkjax.explain.model"),
])
def test_the_layers_contract_catches_an_upward_import(importer, imported):
    graph = grimp.build_graph("hulkjax")
    graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="probe")
    assert graph.find_illegal_dependencies_for_layers(layers=_layers(), containers={"hulkjax"})


def test_no_import_cycles_between_modules():
    graph = grimp.build_graph("hulkjax")  # function-level imports included
    g = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            # A package's __init__ re-exporting its children is not a dependency of the children.
            if not imported.startswith(module + "."):
                g.add_edge(module, imported)
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def _private_imports():
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(("hulkjax", *path.relative_to(ROOT).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("hulkjax"):
                continue
            source = node.module
            if _package(source) == _package(module):
                continue
            private_module = any(p.startswith("_") for p in source.split("."))
            for alias in node.names:
                if private_module or (alias.name.startswith("_") and not alias.name.startswith("__")):
                    yield f"{module}: from {source} import {alias.name}"


def test_no_module_imports_another_packages_private_names():
    found = list(_private_imports())
    assert not found, "\n".join(found)
