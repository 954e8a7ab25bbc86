"""Loading a step to plan or run: a zoo model by name, or your own ``module:function``.

The one step loader the command line, ``launch`` and the learned planner's tools share. A spec is
a zoo name (``hulkjax.zoo.names()``) or ``module:function`` / ``path/file.py:function``: a function
taking no arguments that returns ``(step, state, batch)``, where ``step(state, batch) -> (state,
metrics)`` is the training step and ``state`` / ``batch`` are pytrees of arrays or
``jax.ShapeDtypeStruct`` (nothing is allocated for those).

>>> s = load_step("mlp", size="tiny")
>>> s.name, s.init is not None
('mlp', True)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hulkjax import zoo
from hulkjax.errors import UnknownModelError

HOW = ("--model takes a zoo name or 'module:function' / 'path/file.py:function', where the "
       "function takes no arguments and returns (step, state, batch)")


@dataclass
class LoadedStep:
    """A training step and its arguments.

    Attributes:
      name: the zoo model's name, or the user function's.  # str
      step: ``step(state, batch) -> (state, metrics)``.
      args: ``(state, batch)``: arrays or ``jax.ShapeDtypeStruct`` (zoo models: abstract).
      init: zoo models: ``seed -> (state, batch)`` with concrete arrays; ``None`` for user steps.
      params: parameter count (zoo models), or ``None``.  # int | None
    """

    name: str
    step: Callable
    args: tuple
    init: Callable[[int], tuple] | None = None
    params: int | None = None

    def describe(self, graph) -> str:
        """``"gpt2 (124.4M params, 6764 ops)"``."""
        size = ""
        if self.params:
            size = (f"{self.params / 1e6:.1f}M params, " if self.params >= 1e5
                    else f"{self.params:,} params, ")
        return f"{self.name} ({size}{len(graph.nodes)} ops)"


def load_step(spec: str, *, size: str | None = None, overrides: dict | None = None) -> LoadedStep:
    """The step a ``--model`` spec names (see the module docstring).

    Args:
      spec: a zoo name or ``module:function`` / ``path/file.py:function``.
      size: the zoo size preset (``None``: the model's default); ignored for user steps.
      overrides: zoo config overrides such as ``{"batch": 8}``; ignored for user steps.

    Raises:
      UnknownModelError: an unknown zoo name, a module or file that cannot be loaded, a missing
        function, or a function that does not return ``(step, state, batch)``.
    """
    if ":" in spec:
        name, (step, state, batch) = _user_step(spec)
        return LoadedStep(name, step, (state, batch))
    kw = dict(overrides or {})
    if size is not None:
        kw["size"] = size
    m = zoo.get(spec, **kw)
    return LoadedStep(m.name, m.step, m.abstract(), m.init, m.param_count())


def absolute_spec(spec: str) -> str:
    """The spec with a ``path/file.py`` made absolute (so other processes resolve it too)."""
    if ":" in spec:
        where, _, fname = spec.rpartition(":")
        if where.endswith(".py"):
            return f"{os.path.abspath(where)}:{fname}"
    return spec


def _user_step(spec: str):
    where, _, fname = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            mod_spec = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(where))[0], where)
            if mod_spec is None or not os.path.exists(where):
                raise FileNotFoundError(where)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except (ImportError, FileNotFoundError) as e:
        raise UnknownModelError(f"--model {spec!r}: cannot load {where!r} "
                                f"({type(e).__name__}: {e}). {HOW}.") from e
    fn = getattr(module, fname, None)
    if not callable(fn):
        raise UnknownModelError(f"--model {spec!r}: {where!r} has no function {fname!r}. {HOW}.")
    out = fn()
    if not (isinstance(out, tuple) and len(out) == 3 and callable(out[0])):
        raise UnknownModelError(f"--model {spec!r}: {fname}() returned {type(out).__name__}, "
                                f"not (step, state, batch). {HOW}.")
    return fname, out
