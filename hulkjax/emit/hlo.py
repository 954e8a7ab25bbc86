"""Read the collectives a compiled SPMD program really does, from its HLO text.

Where this sits::

    ShardedStep.compiled.as_text()          HLO after SPMD partitioning (one program per device)
            |
      _parse_module                          computations -> instructions: name, shape, opcode,
            |                                operands, attributes; users per computation
      collectives_from_hlo                   one Collective per collective operation:
            |                                  replica groups -> mesh axes, bytes per device,
            |                                  scatter_emulated, in_loop / trip_count
      summarize                              {(kind, axes): {"count", "bytes"}}
            |
    tests and tables hold the cost model's predicted collectives against these

This is a small text parser, not a binding to XLA: it reads what ``compiled.as_text()`` prints and
nothing else. What it understands:

* The five collective kinds (``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
  ``collective-permute``), their asynchronous forms (``all-reduce-start`` / ``-update`` /
  ``-done`` ..., counted once, at the start) and collectives wrapped in a generic ``async-start``
  (counted once, inside the wrapped computation).
* Every replica-group format XLA prints: explicit lists ``replica_groups={{0,1},{2,3}}``, the empty
  list ``{}`` (all devices), the iota form ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and the mesh form
  that XLA 0.10 prints for Shardy programs, ``mesh['axis_0'=2,'axis_1'=4] {'axis_0'}`` with an
  optional ``device_ids=([2,4]T(1,0))`` and optional sub-axes ``{'axis_0':(1)2}``;
  ``source_target_pairs={{0,1},{1,2}}`` for collective-permute.
* Tuple-shaped (combined) collectives, layouts (``f32[8,128]{1,0}``), dynamic dimensions
  (``f32[<=8]``), ``/*index=5*/`` comments, metadata and backend configs.

Device ids in replica groups are partition positions in the mesh's flattened device order (that is
how ``jax.jit`` numbers partitions, whatever the physical device ids), so id ``i`` sits at mesh
coordinate ``np.unravel_index(i, mesh_shape)``. The parser treats every id that way, which is right
for SPMD programs (one replica, N partitions); it does not model multi-replica (``pmap``-style)
programs.

Limits: one HLO module per call; ``ragged-all-to-all``, ``collective-broadcast``, send/recv and
host transfers are not reported.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hulkjax.errors import InvalidHloError

__all__ = ["Collective", "InvalidHloError", "KINDS", "collectives_from_hlo", "summarize"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The collective kinds reported, in the order tables list them."""


# ------------------------------------------------------------------------------------------------
# The public record
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """One collective operation of a compiled SPMD program, as one device sees it.

    Attributes:
      kind: ``"all-reduce" | "all-gather" | "reduce-scatter" | "all-to-all" |
        "collective-permute"`` (an async ``-start``/``-done`` pair is one collective of its kind).
      bytes: per device, the size of the tensor moved: ``max(operand bytes, result bytes)`` summed
        over tuple elements. An all-gather counts its gathered result, a reduce-scatter its full
        operand, an all-reduce / all-to-all / collective-permute its operand.
      axes: the mesh axes whose coordinates vary inside a replica group, in mesh order; ``()`` when
        the groups are singletons. For a collective-permute: the axes along which a source and its
        target differ.
      shapes: per tuple element, the operand shape (a combined all-reduce has several).
      dtypes: per tuple element, the HLO element type (``"f32"``, ``"bf16"``, ...).
      group_size: devices per replica group. For a collective-permute: the size of the largest set
        of devices connected by its source-target pairs (4 for a ring over a 4-device axis).
      scatter_emulated: True on an all-reduce whose every use is a dynamic-slice taking
        ``1/group_size`` of it (possibly through get-tuple-element / bitcast / copy / reshape, and
        into fusions): XLA:CPU's spelling of a reduce-scatter, which GPUs and TPUs emit as one op.
      name: the HLO instruction name (without ``%``).
      in_loop: inside a while body or condition (or a computation they call): runs per iteration.
      trip_count: how many times it runs per step: the product of the known trip counts of the
        enclosing while loops (1 outside loops); None if an enclosing loop's count is unknown.
      asynchronous: an async ``-start`` / ``-done`` pair (or a generic ``async-start``), not one
        synchronous instruction. XLA:GPU makes every collective async, then turns back into a
        synchronous one each pair its scheduler left nothing between
        (``ConvertAsyncCollectivesToSync``).
      overlapped: in a scheduled module (``is_scheduled=true``: each computation's text order is
        its execution order), how many instructions that do work run between the start and its
        done: what the collective is in flight during. Work is any instruction but parameters,
        constants, tuples and their elements, bitcasts, scheduling markers and other async
        starts, updates and dones. 0 for a synchronous collective, and for a pair with only
        other collectives between.
    """

    kind: str
    bytes: int  # per device
    axes: tuple[str, ...]  # mesh axis names, in mesh order
    shapes: tuple[tuple[int, ...], ...]  # one operand shape per tuple element
    dtypes: tuple[str, ...]  # one HLO element type per tuple element
    group_size: int
    scatter_emulated: bool = False
    name: str = ""
    in_loop: bool = False
    trip_count: int | None = 1
    asynchronous: bool = False
    overlapped: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Collective kind must be one of {KINDS}, got {self.kind=}")
        if self.bytes < 0 or self.group_size < 1:
            raise ValueError(
                f"Collective needs bytes >= 0 and group_size >= 1: {self.bytes=}, "
                f"{self.group_size=}"
            )
        if len(self.shapes) != len(self.dtypes):
            raise ValueError(f"one dtype per shape: {self.shapes=}, {self.dtypes=}")
        if self.scatter_emulated and self.kind != "all-reduce":
            raise ValueError(f"only an all-reduce can be scatter_emulated, got {self.kind=}")


# ------------------------------------------------------------------------------------------------
# Element types and shapes
# ------------------------------------------------------------------------------------------------

# Bits per element of every HLO primitive type that can appear in a collective.
_DTYPE_BITS: dict[str, int] = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8,
    "f8e5m2fnuz": 8, "f8e4m3fnuz": 8, "f8e3m4": 8,
    "token": 0,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        try:
            bits = _DTYPE_BITS[self.dtype]
        except KeyError:
            raise InvalidHloError(
                f"unknown HLO element type {self.dtype!r} (shape {self.dtype}{list(self.dims)}); "
                f"known: {sorted(_DTYPE_BITS)}. Add its width to hulkjax.emit.hlo._DTYPE_BITS."
            ) from None
        return (self.size * bits + 7) // 8


_Shape = _Array | tuple  # a tuple shape is a tuple of _Shape

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _leaves(shape: _Shape) -> list[_Array]:
    if isinstance(shape, _Array):
        return [shape]
    return [leaf for element in shape for leaf in _leaves(element)]


def _parse_array(text: str) -> _Array:
    m = _ARRAY_RE.match(text.strip())
    if m is None:
        raise InvalidHloError(f"cannot read an HLO array shape from {text!r}")
    dims = []
    for d in m.group(2).split(","):
        d = d.strip().removeprefix("<=")  # bounded dynamic dimension: count its bound
        if not d:
            continue
        if not d.isdigit():
            raise InvalidHloError(f"cannot read dimension {d!r} in shape {text!r}")
        dims.append(int(d))
    return _Array(m.group(1), tuple(dims))


def _parse_shape(text: str) -> _Shape:
    """``f32[8,128]{1,0}`` -> _Array; ``(f32[2], (s32[], u8[4]))`` -> nested tuple of _Array."""
    text = text.strip()
    if not text.startswith("("):
        return _parse_array(text)
    inner = text[1 : _matching(text, 0)]
    return tuple(_parse_shape(part) for part in _split_top(inner) if part.strip())


# ------------------------------------------------------------------------------------------------
# Bracket helpers (string literals in metadata may hold any character: skip them)
# ------------------------------------------------------------------------------------------------

_OPEN = {"(": ")", "{": "}", "[": "]"}
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


def _blank_strings(text: str) -> str:
    """``text`` with the inside of every string literal blanked, same length: brackets and commas
    in metadata (``op_name="jit(f)/dot_general"``) then do not count."""
    if '"' not in text:
        return text
    return _STRING_RE.sub(lambda m: '"' + " " * (len(m.group()) - 2) + '"', text)


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]``."""
    blank = _blank_strings(text)
    depth = 0
    for i in range(start, len(blank)):
        c = blank[i]
        if c in _OPEN:
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i
    raise InvalidHloError(f"unbalanced brackets in HLO: {text[start : start + 200]!r}")


def _depth_change(text: str) -> int:
    blank = _blank_strings(text)
    return sum(blank.count(c) for c in "({[") - sum(blank.count(c) for c in ")}]")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets or strings."""
    blank = _blank_strings(text)
    parts, depth, start = [], 0, 0
    for i, c in enumerate(blank):
        if c in _OPEN:
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


# ------------------------------------------------------------------------------------------------
# Module structure: computations of instructions
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Instr:
    name: str
    shape: _Shape
    opcode: str
    operands: tuple[str, ...]  # operand names ("" where none could be read)
    inline_shapes: tuple[_Shape | None, ...]  # operand shapes printed inline, if any
    attrs: str  # everything after the operand list, string literals blanked (same length)
    raw_attrs: str  # the same, as printed (backend configs may hide in strings)
    computation: str
    is_root: bool
    parameter_number: int | None = None  # parameter(N)


@dataclass(slots=True)
class _Computation:
    name: str
    is_entry: bool
    instrs: list[_Instr] = field(default_factory=list)
    by_name: dict[str, _Instr] = field(default_factory=dict)
    users: dict[str, list[tuple[_Instr, int]]] = field(default_factory=lambda: defaultdict(list))
    positions: dict[str, int] = field(default_factory=dict)  # filled on first use


_COMMENT_RE = re.compile(r"/\*.*?\*/", re.S)
_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*?)?\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", re.S)
_ARRAY_SHAPE_PREFIX_RE = re.compile(r"[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?")
_OPCODE_RE = re.compile(r"\s*([a-z][\w\-]*)\(")
_NAME_RE = re.compile(r"%?([A-Za-z_][\w.\-]*)\s*$")


def _parse_instruction(text: str, computation: str) -> _Instr | None:
    m = _INSTR_RE.match(text)
    if m is None:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3).strip()
    # The result shape: a (possibly nested) tuple or one array with an optional layout.
    if rest.startswith("("):
        end = _matching(rest, 0) + 1
    else:
        sm = _ARRAY_SHAPE_PREFIX_RE.match(rest)
        if sm is None:
            return None
        end = sm.end()
    shape_text, rest = rest[:end], rest[end:]
    om = _OPCODE_RE.match(rest)
    if om is None:
        return None
    opcode = om.group(1)
    open_at = om.end() - 1
    close_at = _matching(rest, open_at)
    operand_text, attrs = rest[open_at + 1 : close_at], rest[close_at + 1 :]
    operands, inline = [], []
    parameter_number = None
    if opcode == "parameter":
        parameter_number = int(operand_text) if operand_text.strip().isdigit() else None
    elif operand_text.strip() and opcode != "constant":
        for part in _split_top(operand_text):
            part = part.strip()
            nm = _NAME_RE.search(part)
            operands.append(nm.group(1) if nm else "")
            prefix = part[: nm.start()].strip() if nm else ""
            inline.append(_parse_shape(prefix) if prefix else None)
    return _Instr(
        name=name,
        shape=_parse_shape(shape_text),
        opcode=opcode,
        operands=tuple(operands),
        inline_shapes=tuple(inline),
        attrs=_blank_strings(attrs.lstrip(", ").strip()),
        raw_attrs=attrs.lstrip(", ").strip(),
        computation=computation,
        is_root=is_root,
        parameter_number=parameter_number,
    )


_STATEMENT_START_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\(|[a-z][a-z0-9]*\[)")


def _parse_module(text: str) -> dict[str, _Computation]:
    """Computations by name, in text order.

    An instruction starts with ``[ROOT] name = <shape> opcode(``; any other line inside a
    computation continues the instruction before it (hand-written HLO spreads attributes over
    lines). Instructions outside any computation (a bare snippet) go into a computation named
    ``""``, which is the entry when there is no ENTRY.
    """
    text = _COMMENT_RE.sub("", text)
    computations: dict[str, _Computation] = {}
    current: _Computation | None = None
    pending: list[str] = []

    def flush() -> None:
        if not pending:
            return
        statement = " ".join(pending)
        pending.clear()
        comp = current
        if comp is None:
            comp = computations.setdefault("", _Computation(name="", is_entry=False))
        instr = _parse_instruction(statement, comp.name)
        if instr is None:
            return
        comp.instrs.append(instr)
        comp.by_name[instr.name] = instr
        for index, operand in enumerate(instr.operands):
            comp.users[operand].append((instr, index))

    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("HloModule"):
            continue
        balanced = not pending or _depth_change(" ".join(pending)) <= 0
        if _STATEMENT_START_RE.match(line) and balanced:
            flush()
            pending.append(line)
        elif stripped.startswith("}") and balanced:
            flush()
            current = None
        elif current is None and balanced and (hm := _HEADER_RE.match(line)):
            flush()
            current = _Computation(name=hm.group(2), is_entry=bool(hm.group(1)))
            computations[current.name] = current
        elif pending:
            pending.append(line)
    flush()
    if "" in computations and not any(c.is_entry for c in computations.values()):
        computations[""].is_entry = True
    return computations


# ------------------------------------------------------------------------------------------------
# Call graph: loops and trip counts
# ------------------------------------------------------------------------------------------------

_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations|"
    r"called_computations|select|scatter|comparator)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT_RE = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')


def _callees(instr: _Instr) -> list[tuple[str, str]]:
    """(attribute, computation name) for each computation the instruction calls."""
    out = []
    for m in _CALLEE_RE.finditer(instr.attrs):
        value = m.group(2)
        names = value.strip("{}").split(",") if value.startswith("{") else [value]
        out.extend((m.group(1), n.strip().lstrip("%")) for n in names if n.strip())
    return out


def _loop_context(
    computations: dict[str, _Computation],
) -> dict[str, tuple[bool, int | None]]:
    """For each computation: (inside a while loop, times it runs per step)."""
    called = {callee for c in computations.values() for i in c.instrs for _, callee in _callees(i)}
    roots = [c.name for c in computations.values() if c.is_entry]
    roots += [name for name in computations if name not in called and name not in roots]
    context: dict[str, tuple[bool, int | None]] = {}
    stack = [(name, False, 1) for name in reversed(roots)]
    while stack:
        name, in_loop, trips = stack.pop()
        if name in context or name not in computations:
            continue
        context[name] = (in_loop, trips)
        for instr in computations[name].instrs:
            for attr, callee in _callees(instr):
                if instr.opcode == "while" and attr in ("body", "condition"):
                    m = _TRIP_COUNT_RE.search(instr.raw_attrs)
                    n = int(m.group(1)) if m else None
                    child = trips * n if (trips is not None and n is not None) else None
                    stack.append((callee, True, child))
                else:
                    stack.append((callee, in_loop, trips))
    return context


# ------------------------------------------------------------------------------------------------
# Replica groups
# ------------------------------------------------------------------------------------------------

_IOTA_GROUPS_RE = re.compile(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?")
_MESH_AXIS_RE = re.compile(r"'?([^'=,\s]+)'?\s*=\s*(\d+)")
_AXIS_REF_RE = re.compile(r"^'?([^':\s]+)'?(?::\((\d+)\)(\d+))?$")
_DEVICE_IDS_RE = re.compile(r"^\s*(?:\[([\d,\s]*)\])?\s*(?:T\(([\d,\s]*)\))?\s*([\d,\s]*)$")


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in (text or "").replace(" ", "").split(",") if t]


def _iota(reshape_dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    return ids.transpose(perm) if perm else ids


def _attr_value(attrs: str, key: str) -> str | None:
    """The raw text of ``key=...`` in an attribute list (bracket-aware), or None."""
    m = re.search(rf"(?:^|[,\s]){re.escape(key)}=", attrs)
    if m is None:
        return None
    start = m.end()
    if key == "replica_groups" and attrs.startswith(("mesh[", "maximal_mesh["), start):
        # mesh['a'=2,'b'=4](, device_ids=(...))? {axes}: three bracketed pieces.
        end = _matching(attrs, attrs.index("[", start)) + 1
        dm = re.match(r"\s*,\s*device_ids=", attrs[end:])
        if dm:
            end = _matching(attrs, end + dm.end()) + 1
        brace = attrs.find("{", end)
        if brace < 0 or attrs[end:brace].strip():
            raise InvalidHloError(f"cannot read mesh replica groups in {attrs[start:][:200]!r}")
        return attrs[start : _matching(attrs, brace) + 1]
    if start < len(attrs) and attrs[start] in _OPEN:
        end = _matching(attrs, start) + 1
        # iota form: [2,4]<=[8] or [4,2]<=[2,4]T(1,0)
        if attrs[start] == "[":
            im = _IOTA_GROUPS_RE.match(attrs, start)
            if im:
                end = im.end()
        return attrs[start:end]
    m2 = re.match(r"[^,\s]*", attrs[start:])
    return m2.group(0) if m2 else ""


def _mesh_form_groups(text: str) -> np.ndarray:
    """Groups (one per row) of the mesh form, following XLA's MeshAxesReplicaGroupList: lay the
    devices out on the (XLA-internal) mesh, split sub-axes, move the grouped axes last, and read
    off rows."""
    if text.startswith("maximal_mesh"):
        m = re.match(r"maximal_mesh\[\s*device_id\s*=\s*(\d+)\s*\]", text)
        if m is None:
            raise InvalidHloError(f"cannot read replica groups {text!r}")
        return np.array([[int(m.group(1))]])
    axes_end = _matching(text, text.index("["))
    axes = [(n, int(s)) for n, s in _MESH_AXIS_RE.findall(text[text.index("[") + 1 : axes_end])]
    if not axes:
        raise InvalidHloError(f"mesh replica groups without axes: {text!r}")
    names = [n for n, _ in axes]
    sizes = [s for _, s in axes]
    n_devices = math.prod(sizes)
    dm = re.match(r"\s*,\s*device_ids=\(", text[axes_end + 1 :])
    if dm:
        ids_open = axes_end + 1 + dm.end() - 1
        ids_text = text[ids_open + 1 : _matching(text, ids_open)]
        im = _DEVICE_IDS_RE.match(ids_text)
        if im is None:
            raise InvalidHloError(f"cannot read device_ids=({ids_text}) in {text!r}")
        explicit = _ints(im.group(3))
        devices = (
            np.array(explicit)
            if explicit
            else _iota(_ints(im.group(1)) or [n_devices], _ints(im.group(2)) or None)
        )
        devices = devices.reshape(-1)
        if devices.size != n_devices:
            raise InvalidHloError(
                f"device_ids=({ids_text}) lists {devices.size} devices, the mesh "
                f"{dict(axes)} has {n_devices}: {text!r}"
            )
    else:
        devices = np.arange(n_devices)
    refs_text = text[text.rindex("{") + 1 : text.rindex("}")]
    refs = []  # (mesh dim, pre_size or None, size)
    for item in _split_top(refs_text):
        item = item.strip()
        if not item:
            continue
        rm = _AXIS_REF_RE.match(item)
        if rm is None or rm.group(1) not in names:
            raise InvalidHloError(f"unknown axis {item!r} in replica groups {text!r}")
        dim = names.index(rm.group(1))
        if rm.group(2) is None:
            refs.append((dim, None, sizes[dim]))
        else:
            refs.append((dim, int(rm.group(2)), int(rm.group(3))))
    if not refs:
        return devices.reshape(-1, 1)
    # Split each grouped mesh dimension into the pieces its (sub-)axes name.
    new_dims: list[int] = []
    position: dict[int, int] = {}  # index into refs -> dimension of the split layout
    for dim, full in enumerate(sizes):
        mine = sorted(
            (r for r in range(len(refs)) if refs[r][0] == dim), key=lambda r: refs[r][1] or 0
        )
        if not mine:
            new_dims.append(full)
            continue
        if refs[mine[0]][1] is None:
            if len(mine) > 1:
                raise InvalidHloError(f"axis {names[dim]!r} is grouped twice in {text!r}")
            position[mine[0]] = len(new_dims)
            new_dims.append(full)
            continue
        prefix = 1
        for r in mine:
            _, pre, size = refs[r]
            if pre is None or pre % prefix or full % (pre * size):
                raise InvalidHloError(f"inconsistent sub-axes of {names[dim]!r} in {text!r}")
            if pre != prefix:
                new_dims.append(pre // prefix)
                prefix = pre
            position[r] = len(new_dims)
            new_dims.append(size)
            prefix *= size
        if prefix != full:
            new_dims.append(full // prefix)
    grouped = [position[r] for r in range(len(refs))]
    rest = [d for d in range(len(new_dims)) if d not in grouped]
    group_size = math.prod(new_dims[d] for d in grouped)
    return devices.reshape(new_dims).transpose(rest + grouped).reshape(-1, group_size)


def _replica_groups(value: str | None, n_devices: int) -> list[list[int]]:
    """Replica groups of any printed format, as lists of device ids."""
    if value is None:
        return [list(range(n_devices))]
    value = value.strip()
    if value.startswith(("mesh[", "maximal_mesh[")):
        return _mesh_form_groups(value).tolist()
    if value.startswith("["):
        m = _IOTA_GROUPS_RE.fullmatch(value)
        if m is None:
            raise InvalidHloError(f"cannot read iota replica groups {value!r}")
        groups = _iota(_ints(m.group(2)), _ints(m.group(3)) or None)
        return groups.reshape(_ints(m.group(1))).tolist()
    if value.startswith("{"):
        inner = value[1 : _matching(value, 0)].strip()
        if not inner:  # {} : every device in one group
            return [list(range(n_devices))]
        groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
        if not groups:
            raise InvalidHloError(f"cannot read replica groups {value!r}")
        return groups
    raise InvalidHloError(f"cannot read replica groups {value!r}")


def _check_ids(ids: Iterable[int], n_devices: int, what: str, mesh_shape: tuple[int, ...]) -> None:
    bad = sorted({i for i in ids if not 0 <= i < n_devices})
    if bad:
        raise InvalidHloError(
            f"{what} names devices {bad}, outside a mesh of shape {mesh_shape} ({n_devices} "
            f"devices). Read the HLO against the mesh it was compiled for."
        )


def _varying_axes(
    id_sets: Iterable[Sequence[int]], mesh_shape: tuple[int, ...], axis_names: Sequence[str]
) -> tuple[str, ...]:
    varying = np.zeros(len(mesh_shape), dtype=bool)
    for ids in id_sets:
        if len(ids) < 2:
            continue
        coords = np.stack(np.unravel_index(np.asarray(ids), mesh_shape), axis=1)
        varying |= (coords != coords[0]).any(axis=0)
    return tuple(name for name, v in zip(axis_names, varying) if v)


def _largest_component(pairs: Sequence[tuple[int, int]]) -> int:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[find(a)] = find(b)
    sizes: dict[int, int] = defaultdict(int)
    for x in list(parent):
        sizes[find(x)] += 1
    return max(sizes.values(), default=1)


# ------------------------------------------------------------------------------------------------
# Sizes and the reduce-scatter spelling of XLA:CPU
# ------------------------------------------------------------------------------------------------

_PASS_THROUGH = ("bitcast", "copy", "reshape")


def _operand_shape(comp: _Computation, instr: _Instr, index: int) -> _Shape | None:
    inline = instr.inline_shapes[index] if index < len(instr.inline_shapes) else None
    if inline is not None:
        return inline
    producer = comp.by_name.get(instr.operands[index])
    return producer.shape if producer is not None else None


def _async_done(comp: _Computation, start: _Instr) -> _Instr | None:
    """The ``-done`` that ends an async ``-start`` (through any ``-update``)."""
    current = start
    for _ in range(64):
        nxt = [
            u
            for u, _ in comp.users.get(current.name, [])
            if u.opcode.endswith(("-done", "-update"))
        ]
        if not nxt:
            return None
        current = nxt[0]
        if current.opcode.endswith("-done"):
            return current
    return None


_NO_WORK = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                      "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id"})
"""Opcodes that launch nothing: not counted as work a collective overlaps."""


def _work_between(comp: _Computation, start: _Instr, done: _Instr | None) -> int:
    """Instructions that do work between ``start`` and ``done`` in ``comp``'s text order."""
    if done is None:
        return 0
    at = comp.positions
    if not at:
        at.update((i.name, k) for k, i in enumerate(comp.instrs))
    lo, hi = at.get(start.name), at.get(done.name)
    if lo is None or hi is None:
        return 0
    return sum(1 for i in comp.instrs[lo + 1 : hi]
               if i.opcode not in _NO_WORK
               and not i.opcode.endswith(("-start", "-update", "-done")))


def _only_sliced(
    computations: dict[str, _Computation],
    comp: _Computation,
    name: str,
    shape: _Shape,
    group_size: int,
    depth: int = 0,
) -> bool:
    """Whether every use of value ``name`` is a dynamic-slice keeping 1/group_size of it."""
    producer = comp.by_name.get(name)
    uses = comp.users.get(name, [])
    if depth > 32 or not uses or (producer is not None and producer.is_root):
        return False
    for user, index in uses:
        if user.opcode == "get-tuple-element":
            m = re.search(r"\bindex=(\d+)", user.attrs)
            if not isinstance(shape, tuple) or m is None or int(m.group(1)) >= len(shape):
                return False
            element = shape[int(m.group(1))]
            if not _only_sliced(computations, comp, user.name, element, group_size, depth + 1):
                return False
        elif user.opcode in _PASS_THROUGH:
            if not isinstance(shape, _Array) or not isinstance(user.shape, _Array):
                return False
            if not _only_sliced(computations, comp, user.name, user.shape, group_size, depth + 1):
                return False
        elif user.opcode == "dynamic-slice":
            if index != 0 or not isinstance(shape, _Array) or not isinstance(user.shape, _Array):
                return False
            if user.shape.size * group_size != shape.size:
                return False
        elif user.opcode == "fusion":
            callee = next((c for a, c in _callees(user) if a == "calls"), None)
            fused = computations.get(callee) if callee else None
            if fused is None:
                return False
            params = [i for i in fused.instrs if i.parameter_number == index]
            if len(params) != 1:
                return False
            if not _only_sliced(computations, fused, params[0].name, shape, group_size, depth + 1):
                return False
        else:
            return False
    return True


def _infer_operands(kind: str, result: list[_Array], attrs: str, group_size: int) -> list[_Array]:
    """Operand shapes from the result, for HLO that does not define the operands (a snippet)."""
    if kind not in ("all-gather", "reduce-scatter"):
        return result
    m = re.search(r"\bdimensions=\{(\d+)", attrs)
    dim = int(m.group(1)) if m else 0
    out = []
    for leaf in result:
        dims = list(leaf.dims)
        if dim < len(dims):
            dims[dim] = dims[dim] // group_size if kind == "all-gather" else dims[dim] * group_size
        out.append(_Array(leaf.dtype, tuple(dims)))
    return out


def _kind(opcode: str) -> tuple[str | None, bool]:
    """(collective kind, is an async start) of an opcode; (None, False) if not a collective."""
    if opcode in KINDS:
        return opcode, False
    base = opcode.removesuffix("-start")
    if base != opcode and base in KINDS:
        return base, True
    return None, False


def _collective(
    instr: _Instr,
    comp: _Computation,
    computations: dict[str, _Computation],
    mesh_shape: tuple[int, ...],
    axis_names: Sequence[str],
    loop: tuple[bool, int | None],
    starter: tuple[_Computation, _Instr] | None = None,
) -> Collective:
    """``starter``: the generic ``async-start`` (and its computation) that wraps ``comp``, if
    one does."""
    kind, is_start = _kind(instr.opcode)
    if kind is None:
        raise TypeError(f"not a collective: {instr.opcode} %{instr.name}")
    n_devices = math.prod(mesh_shape)
    where = f"{instr.opcode} %{instr.name}"

    # What the collective produces: a -start's result is its -done's shape.
    value = instr
    if is_start:
        value = _async_done(comp, instr)
        if value is not None:
            result = value.shape
        elif kind == "all-reduce" or not isinstance(instr.shape, tuple) or len(instr.shape) < 2:
            result = instr.shape
        else:  # (operands, result, context...)
            result = instr.shape[1]
    else:
        result = instr.shape
    # What runs while it is in flight: its own pair's span, or its async wrapper's.
    if is_start:
        overlapped = _work_between(comp, instr, value)
    elif starter is not None:
        caller, start = starter
        overlapped = _work_between(caller, start, _async_done(caller, start))
    else:
        overlapped = 0
    result_leaves = _leaves(result)

    # Who talks to whom.
    if kind == "collective-permute":
        raw = _attr_value(instr.attrs, "source_target_pairs")
        inner = raw.strip()[1:-1] if raw and raw.strip().startswith("{") else ""
        pairs = [tuple(_ints(p)) for p in re.findall(r"\{([^{}]*)\}", inner)]
        if any(len(p) != 2 for p in pairs):
            raise InvalidHloError(f"cannot read source_target_pairs={raw} of {where}")
        _check_ids((i for p in pairs for i in p), n_devices, where, mesh_shape)
        axes = _varying_axes(pairs, mesh_shape, axis_names)
        group_size = _largest_component(pairs) if pairs else 1
    else:
        groups = _replica_groups(_attr_value(instr.attrs, "replica_groups"), n_devices)
        _check_ids((i for g in groups for i in g), n_devices, where, mesh_shape)
        axes = _varying_axes(groups, mesh_shape, axis_names)
        group_size = max((len(g) for g in groups), default=1)

    # What goes in. The in-place collective-permute form also takes index operands: skip them.
    indices = range(len(instr.operands))
    if kind == "collective-permute" and "slice_sizes=" in instr.attrs:
        indices = range(min(1, len(instr.operands)))
    operand_shapes = [_operand_shape(comp, instr, i) for i in indices]
    if operand_shapes and all(s is not None for s in operand_shapes):
        operand_leaves = [leaf for s in operand_shapes for leaf in _leaves(s)]
    else:
        operand_leaves = _infer_operands(kind, result_leaves, instr.attrs, group_size)

    if len(operand_leaves) == len(result_leaves):
        nbytes = sum(max(a.nbytes, b.nbytes) for a, b in zip(operand_leaves, result_leaves))
    else:
        nbytes = max(sum(a.nbytes for a in operand_leaves), sum(b.nbytes for b in result_leaves))

    emulated = (
        kind == "all-reduce"
        and group_size > 1
        and value is not None
        and _only_sliced(computations, comp, value.name, value.shape, group_size)
    )
    return Collective(
        kind=kind,
        bytes=nbytes,
        axes=axes,
        shapes=tuple(a.dims for a in operand_leaves),
        dtypes=tuple(a.dtype for a in operand_leaves),
        group_size=group_size,
        scatter_emulated=emulated,
        name=instr.name,
        in_loop=loop[0],
        trip_count=loop[1],
        asynchronous=is_start or starter is not None,
        overlapped=overlapped,
    )


# ------------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------------


def collectives_from_hlo(
    hlo_text: str, mesh_shape: Sequence[int], axis_names: Sequence[str]
) -> list[Collective]:
    """The collectives of a compiled SPMD program, in the order its text lists them.

    Args:
      hlo_text: ``jax.jit(f).lower(...).compile().as_text()``: HLO after SPMD partitioning. Any HLO
        text works (hand-written snippets too); instructions outside a computation are read as one.
      mesh_shape: the shape of the mesh the program was compiled for, e.g. ``(2, 4)``.
      axis_names: its axis names, e.g. ``("data", "model")``.

    Returns:
      One :class:`Collective` per collective operation (an async start/done pair once), including
      those in while bodies (``in_loop=True``) and other called computations.

    Raises:
      InvalidHloError: the mesh does not fit the program (a device id outside it), or a replica
        group, shape or element type cannot be read.

    >>> hlo = '''
    ... ENTRY %main (p: f32[16,32]) -> f32[16,32] {
    ...   %p = f32[16,32]{1,0} parameter(0)
    ...   ROOT %ar = f32[16,32]{1,0} all-reduce(%p), channel_id=1,
    ...     replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
    ... }'''
    >>> [c] = collectives_from_hlo(hlo, (2, 4), ("data", "model"))
    >>> c.kind, c.axes, c.bytes, c.group_size
    ('all-reduce', ('data',), 2048, 2)
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    axis_names = tuple(axis_names)
    if len(mesh_shape) != len(axis_names) or any(s < 1 for s in mesh_shape):
        raise InvalidHloError(
            f"mesh_shape and axis_names must match and sizes be >= 1: {mesh_shape=}, "
            f"{axis_names=}. Pass mesh.devices.shape and mesh.axis_names."
        )
    computations = _parse_module(hlo_text)
    context = _loop_context(computations)
    # A collective -start that names a wrapped computation is counted at the start, not inside.
    counted_at_start = {
        callee
        for comp in computations.values()
        for instr in comp.instrs
        if _kind(instr.opcode)[1]
        for attr, callee in _callees(instr)
        if attr == "calls"
    }
    # A computation a generic async-start wraps runs asynchronously in its caller.
    wrapped = {
        callee: (comp, instr)
        for comp in computations.values()
        for instr in comp.instrs
        if instr.opcode == "async-start"
        for attr, callee in _callees(instr)
        if attr == "calls"
    }
    out = []
    for comp in computations.values():
        if comp.name in counted_at_start:
            continue
        for instr in comp.instrs:
            if _kind(instr.opcode)[0] is not None:
                loop = context.get(comp.name, (False, 1))
                out.append(_collective(instr, comp, computations, mesh_shape, axis_names, loop,
                                       wrapped.get(comp.name)))
    return out


def summarize(
    collectives: Iterable[Collective], *, fold_emulated: bool = False
) -> dict[tuple[str, tuple[str, ...]], dict[str, int]]:
    """Count and total bytes per (kind, axes), for tests and tables.

    Args:
      collectives: what :func:`collectives_from_hlo` returned.
      fold_emulated: report a ``scatter_emulated`` all-reduce as the reduce-scatter it stands for
        (same bytes: both count the full operand), so CPU programs compare with GPU/TPU ones.

    >>> c = Collective(kind="all-gather", bytes=2048, axes=("data",), shapes=((8, 32),),
    ...                dtypes=("f32",), group_size=2)
    >>> summarize([c, c])
    {('all-gather', ('data',)): {'count': 2, 'bytes': 4096}}
    """
    table: dict[tuple[str, tuple[str, ...]], dict[str, int]] = {}
    for c in collectives:
        kind = "reduce-scatter" if (fold_emulated and c.scatter_emulated) else c.kind
        entry = table.setdefault((kind, c.axes), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c.bytes
    return table
