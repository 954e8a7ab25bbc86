"""The operator graph: one node per (inlined) jaxpr equation, one value per tensor.

Where this sits::

    train_step --trace--> OpGraph --rules/cost/strategies--> Plan --emit--> ShardedStep

The tracer inlines nested ``jit``, ``custom_jvp_call``, ``custom_vjp_call`` and ``remat2``; ``scan``,
``while`` and ``cond`` stay single nodes whose bodies are kept as sub-graphs and whose costs count the
body times the trip count. Node ids follow the order of a depth-first walk of the jaxpr with inlining;
:func:`hulkjax.trace.interpret` walks in exactly the same order, which is how a plan made on the graph
is applied to the real program.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Roles of graph inputs, found from the data flow (never from names):
PARAMETER = "parameter"  # state that the forward computation uses as an operand of a real op
OPTIMIZER = "optimizer"  # other state carried to the outputs (optimizer moments, counters, stats)
DATA = "data"  # arguments not carried to the outputs: the batch
CONSTANT = "constant"  # closed-over constants of the jaxpr


@dataclass(frozen=True, slots=True)
class Value:
    """A tensor of the graph.

    Attributes:
      id: index into ``OpGraph.values``.  # int
      shape: the logical (unsharded) shape.  # tuple of int
      dtype: numpy dtype name, e.g. ``"float32"``; ``"token"`` for non-array values.  # str
      producer: id of the node that computes it; ``None`` for graph inputs and constants.
      index: which result of the producer it is (0 for inputs).
      name: the pytree path for inputs (``"state/params/Dense_0/kernel"``); ``None`` otherwise.
      host: whether it lives in host memory, not the device's (its aval's memory space is
        ``Host``: what ``device_put`` to ``MemorySpace.Host`` makes, as ``jax.checkpoint``'s
        offloading policies emit for the activations they offload).  # bool
    """

    id: int
    shape: tuple[int, ...]
    dtype: str
    producer: int | None
    index: int = 0
    name: str | None = None
    host: bool = False

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape) if self.shape else 1

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) tensor."""
        return self.size * dtype_size(self.dtype)


@dataclass(slots=True, eq=False)
class Node:
    """One operator: a jaxpr equation after inlining.

    Attributes:
      id: index into ``OpGraph.nodes``; the position in the inlined depth-first walk.  # int
      primitive: the JAX primitive (a ``jax.extend.core.Primitive``); rule tables key on it.
      params: the equation's parameters (dimension numbers, axes, sub-jaxprs, ...).  # dict
      inputs: value id per operand; ``None`` where the operand is a literal.  # tuple of int | None
      outputs: value id per result.  # tuple of int
      flops: floating-point operations of one execution, times ``trip_count`` for loops.  # float
      bytes: bytes read and written (operands + results, unfused), times ``trip_count``.  # float
      layer: the module scope it belongs to (``"MLP/Dense_0"``); from the name stack, or from the
        parameter it touches when the model has no scopes (flax.nnx).  # str
      backward: whether the equation belongs to a backward pass (its name stack carries JAX's
        ``transpose(...)`` transform); forward values used by backward nodes are the saved
        activations.  # bool
      subgraphs: bodies of ``scan``/``while``/``cond`` as graphs of their own.  # tuple of OpGraph
      trip_count: how many times the body runs (``scan``: its length; ``while``: 1 when unknown).
      traceback: source tracebacks of the equation and of the calls it was inlined from,
        innermost first (see :attr:`source`).
      kernel: for a Pallas kernel (``pallas_call``), what it computes, moves and can be split
        along (:class:`hulkjax.trace.kernels.Kernel`); ``None`` for other operators.
    """

    id: int
    primitive: Any
    params: dict
    inputs: tuple[int | None, ...]
    outputs: tuple[int, ...]
    flops: float = 0.0
    bytes: float = 0.0
    layer: str = ""
    backward: bool = False
    subgraphs: tuple[OpGraph, ...] = ()
    trip_count: int = 1
    traceback: Any = field(default=None, repr=False)
    kernel: Any = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """The primitive's name, e.g. ``"dot_general"``."""
        return self.primitive.name

    @property
    def source(self) -> str:
        """``file:line`` of the user code that produced the equation (best effort)."""
        return _user_source(self.traceback)


class OpGraph:
    """A traced training step as a graph of operators and tensors.

    Attributes:
      nodes: operators in execution order.  # list of Node
      values: tensors; ``values[i].id == i``.  # list of Value
      inputs: value id of each flattened argument leaf, in ``jax.tree.leaves(args)`` order.
      outputs: value id of each flattened result leaf; ``None`` for a literal result.
      input_paths / output_paths: pytree path of each leaf (``"state/params/Dense_0/kernel"``).
      input_roles: PARAMETER | OPTIMIZER | DATA | CONSTANT per input leaf (from the data flow).
      in_tree / out_tree: the pytree structures of the arguments and of the result.
      jaxpr: the ``ClosedJaxpr`` the graph was built from (the emitter re-runs it).
      constants: value ids of the jaxpr's closed-over constants.
      carried: ``{input index: output index}`` for state leaves: the result that carries each
        one's new value (used for donation and to give a state result its input's layout).
      owners: ``{optimizer input index: parameter input index}``: the parameter whose update each
        optimizer-state leaf flows into (optimizer state follows its parameter).
      fn: the function that was traced (``None`` for loop bodies).
      loop_body: whether the graph is a loop body seen from its loop (its carried results are the
        next iteration's inputs, not the step's end).  # bool
      memo: space for what layers above derive from the graph and keep with it (the cost model
        per topology, loop-body views); not part of the graph's identity or fingerprint.  # dict

    Use :meth:`to_networkx` for a ``networkx.MultiDiGraph`` view. Graphs of ``scan`` bodies have
    ``in_tree``/``out_tree`` of ``None`` and paths ``"carry/0"``-style.
    """

    def __init__(self, *, nodes, values, inputs, outputs, input_paths, output_paths, in_tree,
                 out_tree, jaxpr, constants=(), input_roles=()):
        self.nodes: list[Node] = nodes
        self.values: list[Value] = values
        self.inputs: tuple[int, ...] = tuple(inputs)
        self.outputs: tuple[int | None, ...] = tuple(outputs)
        self.input_paths: tuple[str, ...] = tuple(input_paths)
        self.output_paths: tuple[str, ...] = tuple(output_paths)
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.jaxpr = jaxpr
        self.constants: tuple[int, ...] = tuple(constants)
        self.input_roles: tuple[str, ...] = tuple(input_roles)
        self.carried: dict[int, int] = {}
        self.owners: dict[int, int] = {}
        self.loop_body = False
        # The function :func:`hulkjax.trace.trace` traced (None for loop bodies and hand-built
        # graphs): the emitter re-runs this graph's jaxpr, so it checks that it is emitting the
        # same function and re-traces otherwise.
        self.fn: Any = None
        self.memo: dict = {}
        self._consumers: list[list[tuple[int, int]]] | None = None
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        return (f"OpGraph({len(self.nodes)} nodes, {len(self.values)} values, "
                f"{len(self.inputs)} inputs, {len(self.outputs)} outputs, "
                f"{self.total_flops:.3g} FLOPs)")

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    @property
    def total_flops(self) -> float:
        """FLOPs of one step (loops counted by trip count)."""
        return float(sum(n.flops for n in self.nodes))

    def state_pairs(self) -> list[tuple[int, int]]:
        """``(optimizer input, parameter input)`` of every optimizer-state leaf shaped as the
        parameter it updates (Adam's moments; not a factored second moment): the state a plan
        lays out as its parameter, or with the distributed optimizer apart from it."""
        return [(o, p) for o, p in sorted(self.owners.items())
                if self.values[self.inputs[o]].shape == self.values[self.inputs[p]].shape]

    def consumers(self, value_id: int) -> list[tuple[int, int]]:
        """``(node id, operand index)`` of every use of a value."""
        if self._consumers is None:
            cons: list[list[tuple[int, int]]] = [[] for _ in self.values]
            for node in self.nodes:
                for k, v in enumerate(node.inputs):
                    if v is not None:
                        cons[v].append((node.id, k))
            self._consumers = cons
        return self._consumers[value_id]

    def producer(self, value_id: int) -> Node | None:
        """The node computing a value, or ``None`` for inputs and constants."""
        p = self.values[value_id].producer
        return None if p is None else self.nodes[p]

    def input_value(self, path: str) -> Value:
        """The input leaf with this pytree path."""
        try:
            return self.values[self.inputs[self.input_paths.index(path)]]
        except ValueError:
            raise KeyError(f"no input {path!r}; inputs are {list(self.input_paths)[:8]}...") from None

    def fingerprint(self) -> str:
        """Stable hash of the structure: primitives, shapes, dtypes, edges and input paths."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for p, v in zip(self.input_paths, self.inputs):
                h.update(f"{p}:{self.values[v].shape}:{self.values[v].dtype};".encode())
            for n in self.nodes:
                h.update(f"{n.name}{n.inputs}{n.outputs}{n.trip_count};".encode())
                for o in n.outputs:
                    h.update(f"{self.values[o].shape}{self.values[o].dtype}".encode())
            h.update(str(self.outputs).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def to_networkx(self):
        """A ``networkx.MultiDiGraph``: operator nodes, one edge per tensor use.

        Node attributes: ``primitive``, ``flops``, ``bytes``, ``layer``. Graph inputs appear as nodes
        ``"in:<path>"``. Edge attributes: ``value`` (id), ``bytes``, ``shape``, ``operand``.
        """
        import networkx as nx

        g = nx.MultiDiGraph()
        for p in self.input_paths:
            g.add_node(f"in:{p}", primitive="input", flops=0.0, bytes=0.0, layer="")
        for n in self.nodes:
            g.add_node(n.id, primitive=n.name, flops=n.flops, bytes=n.bytes, layer=n.layer)
        in_name = {v: f"in:{p}" for p, v in zip(self.input_paths, self.inputs)}
        for n in self.nodes:
            for k, vid in enumerate(n.inputs):
                if vid is None:
                    continue
                val = self.values[vid]
                src = val.producer if val.producer is not None else in_name.get(vid)
                if src is None:
                    continue  # a closed-over constant
                g.add_edge(src, n.id, value=vid, bytes=val.nbytes, shape=val.shape, operand=k)
        return g


_DTYPE_SIZES: dict[str, int] = {}


def dtype_name(dtype) -> str:
    """The name a graph or plan uses for a dtype: the numpy name of the dtype JAX computes with
    (``float64`` is ``"float32"`` unless x64 is on), or ``str(dtype)`` for JAX's extended dtypes
    (PRNG keys: ``"key<fry>"``), which numpy cannot name (``np.dtype`` raises on them)."""
    import jax

    try:
        key = (dtype, bool(jax.config.jax_enable_x64))
        hit = _DTYPE_NAMES.get(key)
    except TypeError:  # an unhashable dtype-like
        key, hit = None, None
    if hit is not None:
        return hit
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        name = str(dtype)
        _DTYPE_SIZES.setdefault(name, int(getattr(dtype, "itemsize", 0) or 0))
    else:
        name = np.dtype(jax.dtypes.canonicalize_dtype(dtype)).name
    if key is not None:
        _DTYPE_NAMES[key] = name
    return name


_DTYPE_NAMES: dict = {}  # (dtype, x64) -> name: the tracer names every value's dtype


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name (0 for tokens and other non-arrays)."""
    size = _DTYPE_SIZES.get(dtype)
    if size is None:
        try:
            size = np.dtype(dtype).itemsize
        except TypeError:
            import jax.numpy as jnp

            try:
                size = jnp.dtype(dtype).itemsize
            except TypeError:
                size = 0
        _DTYPE_SIZES[dtype] = size
    return size


_LIBRARY_DIRS = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/hulkjax/", "/jraph/", "<frozen")


def _user_source(tracebacks) -> str:
    """The innermost frame outside JAX, Flax, Optax and hulkjax, as ``file:line``."""
    if tracebacks is None:
        return "<unknown>"
    if not isinstance(tracebacks, tuple):
        tracebacks = (tracebacks,)
    first = None
    for tb in tracebacks:
        frames = getattr(tb, "frames", None) or []
        for fr in frames:
            if not any(d in fr.file_name for d in _LIBRARY_DIRS):
                return f"{fr.file_name.rsplit('/', 1)[-1]}:{fr.line_num}"
        if first is None and frames:
            first = f"{frames[0].file_name.rsplit('/', 1)[-1]}:{frames[0].line_num}"
    return first or "<unknown>"
