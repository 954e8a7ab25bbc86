"""Rendering an explanation: plain text, markdown, or a ``rich`` table.

>>> import hulkjax as hj, jax.numpy as jnp
>>> plan = hj.plan(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)),
...                topology=hj.Topology.grid((8,), ("d",)), strategy="dp")
>>> print(explain(plan, fmt="text").splitlines()[0])
Plan 'dp' on grid-8 (mesh d=8)
"""

from __future__ import annotations

import re

from hulkjax.errors import HulkjaxError
from hulkjax.explain.model import Explanation, LayerRow, explanation
from hulkjax.formatting import format_bytes, format_rate, format_time

_LINK_WORDS = {"node": "links inside a node", "region": "links between nodes of a region",
               "wan": "WAN links between regions"}


# ---- rendering -----------------------------------------------------------------------------
_COLUMNS = ("layer", "parameters / data", "optimizer state", "activations (fwd results)",
            "collectives (link class)", "compute", "comm", "time (share)", "memory / device")


_ENTRY = re.compile(r"^(?:(\S+) )?(\S+) (replicated|\[.*\])$")


def _compact(entries: list[str], what: str, limit: int = 4) -> list[str]:
    """More than ``limit`` entries (a coarse layer): one line per layout, with counts."""
    if len(entries) <= limit:
        return entries
    by_spec: dict[str, int] = {}
    for entry in entries:
        m = _ENTRY.match(entry)
        spec = m.group(3) if m else entry
        by_spec[spec] = by_spec.get(spec, 0) + 1
    return [f"{len(entries)} {what}:"] + [f"  {n} x {spec}" for spec, n in by_spec.items()]


def _cells(r: LayerRow, step: float, stages: bool) -> list[list[str]]:
    share = f" ({r.time / step:.1%})" if step > 0 else ""
    cells = [[r.label], _compact(r.parameters, "leaves") or ["-"], r.optimizer or ["-"],
             _compact(r.activations, "results") or ["-"],
             [c.short() for c in r.collectives] or ["-"], [format_time(r.compute)],
             [format_time(r.comm)], [format_time(r.time) + share],
             [format_bytes(r.memory_total)]]
    if stages:
        cells.insert(1, [",".join(map(str, r.stages)) or "-"])
    return cells


def _header_lines(e: Explanation) -> list[str]:
    lines = [f"Plan {e.strategy!r} on {e.topology_name} (mesh {e.mesh})"]
    for x in e.axes:
        where = ("its own per-axis link" if x.per_axis
                 else _LINK_WORDS.get(x.link_class, x.link_class))
        lines.append(f"  axis {x.name} (size {x.size}): {x.link_class} links, "
                     f"{format_rate(x.bandwidth)}, latency {format_time(x.latency)} ({where})")
    c = e.cost
    if c is not None and c.stages:
        chunks = f", {c.virtual_stages} chunks per device group" if c.virtual_stages > 1 else ""
        lines.append(f"predicted step {format_time(c.step_time)}: {len(c.stages)} stages x "
                     f"{c.microbatches} microbatches ({c.schedule}{chunks}), bubble "
                     f"{format_time(c.bubble)}; efficiency {c.efficiency:.1%}")
        lines.append(f"memory per device: worst stage {format_bytes(c.peak_memory)} of "
                     f"{format_bytes(c.memory_capacity)} "
                     f"({'fits' if all(s.fits for s in c.stages) else 'DOES NOT FIT'})")
    elif c is not None:
        per = ", ".join(f"{x.name}/{x.link_class} {format_time(x.comm_time)}"
                        for x in e.axes if x.comm_time)
        lines.append(f"predicted step {format_time(c.step_time)} = compute "
                     f"{format_time(c.compute_time)} + communication {format_time(c.comm_time)}"
                     f"{' (' + per + ')' if per else ''}; efficiency {c.efficiency:.1%}")
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in c.memory_breakdown.items() if v)
        fits = "fits" if c.fits else "DOES NOT FIT"
        lines.append(f"memory per device {format_bytes(c.peak_memory)} of "
                     f"{format_bytes(c.memory_capacity)} ({fits}): {parts}")
    return lines


def _overlap_lines(e: Explanation, limit: int = 3) -> list[str]:
    """What overlapping collectives with compute would leave of the step (the predicted step
    above adds them): the overlapped time, what is hidden, and the collectives the step still
    waits for, the longest first."""
    o = e.overlap
    if o is None or not (o.collectives or o.host_copy_time):
        return []
    lines = [f"with overlap ({o.backend}: XLA's latency-hiding scheduler, collectives combined "
             f"as compiled): step {format_time(o.step_time)}; "
             + (f"{format_time(o.hidden_comm_time)} of " if o.hidden_comm_time > 0 else "none of ")
             + f"{format_time(o.comm_time)} communication hidden under compute "
             f"({len(o.hidden)} of {len(o.collectives)} collectives)"]
    if o.collectives and not any(c.asynchronous for c in o.collectives):
        lines[-1] += f"; {o.backend} runs collectives synchronously, so none can hide"
    if o.host_copy_time:
        lines.append(f"  copies to and from host memory (offloaded activations): "
                     f"{format_time(o.host_copy_time)} over the host link, "
                     f"{format_time(o.host_copy_time - o.exposed_host_copy_time)} of it hidden "
                     f"under compute (the predicted step above counts them whole)")
    if o.reused_comm_time > 1e-3 * o.additive_time:
        lines.append(f"  the predicted step above charges {format_time(o.reused_comm_time)} more "
                     f"for layout changes than the program makes: XLA's partitioner makes a "
                     f"change once per value and layout, and shares a path's first steps with a "
                     f"direct change to them, which the cost model prices apart")
    if o.reassociated_comm_time > 1e-3 * o.additive_time:
        lines.append(f"  the predicted step above charges {format_time(o.reassociated_comm_time)} "
                     f"for all-reduces {o.backend} does not make: where two partial sums are "
                     f"added, XLA all-reduces their sum once, which the cost model prices apart")
    waits = sorted(o.exposed, key=lambda c: -c.exposed_seconds * c.trips)[:limit]
    for c in waits:
        where = f" in loop {c.loop}'s body (x{c.trips})" if c.loop is not None else ""
        lines.append(f"  waits for {c.kind} over {'+'.join(c.axes)}{where}: "
                     f"{format_time(c.exposed_seconds * c.trips)} exposed of "
                     f"{format_time(c.seconds * c.trips)}, {format_bytes(c.bytes)}"
                     f"{f' ({c.count} combined)' if c.count > 1 else ''}")
    return lines


_FOOTER_COLLECTIVES = 24  # collectives the text lists at most


def _footer_lines(e: Explanation) -> list[str]:
    lines = []
    if e.collectives:
        lines.append("collectives over the whole step (link class in parentheses):")
        # The dearest first where there are many (a staged plan's, stage by stage).
        shown = e.collectives if len(e.collectives) <= _FOOTER_COLLECTIVES else sorted(
            e.collectives, key=lambda c: -c.time)[:_FOOTER_COLLECTIVES]
        for c in shown:
            lines.append(f"  {c.kind} over {'+'.join(c.axes)} ({'+'.join(dict.fromkeys(c.links))}"
                         f" links): {c.count} x, {format_bytes(c.bytes)}, {format_time(c.time)}")
        if len(e.collectives) > len(shown):
            lines.append(f"  ... and {len(e.collectives) - len(shown)} more, each at most "
                         f"{format_time(shown[-1].time)}")
    lines += _overlap_lines(e)
    if e.stages is not None:
        lines.append("stages (layers placed on device groups):")
        for k, (devices, layers) in enumerate(e.stages):
            lines.append(f"  stage {k} on {devices}: {', '.join(layers) or '-'}")
    lines += e.pipeline
    for n in e.notes[:10]:
        lines.append(f"note: {n}")
    if len(e.notes) > 10:
        lines.append(f"note: ... and {len(e.notes) - 10} more")
    lines.append("AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all; link classes: "
                 "node = inside a node, region = between nodes, wan = between regions. Times and "
                 "memory of a repeated layer (xN) are totals over its repeats.")
    return lines


def _table_rows(e: Explanation, max_rows: int | None):
    stages = e.stages is not None
    cols = list(_COLUMNS)
    if stages:
        cols.insert(1, "stage")
    step = e.cost.step_time if e.cost is not None else e.total_time
    rows = [_cells(r, step, stages) for r in e.rows]
    hidden = 0
    if max_rows is not None and len(rows) > max_rows:
        hidden = len(rows) - max_rows
        rows = rows[:max_rows]
    total = [["total"], [""], [""], [""], [""],
             [format_time(sum(r.compute for r in e.rows))],
             [format_time(sum(r.comm for r in e.rows))],
             [format_time(e.total_time) + (" (100%)" if step > 0 else "")],
             [format_bytes(e.total_memory)]]
    if stages:
        total.insert(1, [""])
    return cols, rows, total, hidden


def _text_table(cols, rows, total) -> list[str]:
    widths = [len(c) for c in cols]
    for row in rows + [total]:
        for k, cell in enumerate(row):
            widths[k] = max(widths[k], *(len(s) for s in cell))
    right = {len(cols) - 4, len(cols) - 3, len(cols) - 2, len(cols) - 1}

    def line(cells):
        out = []
        for i in range(max(len(c) for c in cells)):
            parts = []
            for k, c in enumerate(cells):
                s = c[i] if i < len(c) else ""
                parts.append(s.rjust(widths[k]) if k in right else s.ljust(widths[k]))
            out.append("  ".join(parts).rstrip())
        return out

    rule = "  ".join("-" * w for w in widths)
    out = line([[c] for c in cols]) + [rule]
    for row in rows:
        out += line(row)
    return out + [rule] + line(total)


def _markdown_table(cols, rows, total) -> list[str]:
    def esc(s):
        return s.replace("|", "\\|")

    def line(cells):
        return "| " + " | ".join("<br>".join(esc(s) for s in c) for c in cells) + " |"

    right = len(cols) - 4
    out = [line([[c] for c in cols]),
           "|" + "|".join("---:" if k >= right else "---" for k in range(len(cols))) + "|"]
    out += [line(r) for r in rows]
    out.append(line([[f"**{c[0]}**" if c and c[0] else ""] for c in total]))
    return out


def render_text(e: Explanation, *, max_rows: int | None = None) -> str:
    """Plain text (fixed-width table), for logs and ``print``."""
    lines = _header_lines(e)
    if e.rows:
        cols, rows, total, hidden = _table_rows(e, max_rows)
        lines.append("")
        lines += _text_table(cols, rows, total)
        if hidden:
            lines.append(f"... {hidden} more layers (max_rows={max_rows})")
        lines.append("")
    if e.per_layer_note:
        lines.append(f"note: {e.per_layer_note}")
    return "\n".join(lines + _footer_lines(e))


def render_markdown(e: Explanation, *, max_rows: int | None = None) -> str:
    """GitHub-flavoured markdown (a pipe table; multi-line cells use ``<br>``)."""
    head = _header_lines(e)
    lines = [f"### {head[0]}", ""] + [f"- {h.strip()}" for h in head[1:]] + [""]
    if e.rows:
        cols, rows, total, hidden = _table_rows(e, max_rows)
        lines += _markdown_table(cols, rows, total)
        if hidden:
            lines.append(f"\n_... {hidden} more layers (max_rows={max_rows})_")
        lines.append("")
    if e.per_layer_note:
        lines += [f"_{e.per_layer_note}_", ""]
    for f in _footer_lines(e):
        lines.append(f"- {f.strip()}" if f.startswith("  ") else f)
    return "\n".join(lines)


def render_rich(e: Explanation, *, max_rows: int | None = None):
    """A ``rich`` renderable (``rich.console.Console().print(...)`` it): header, table, footer."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = _header_lines(e)
    parts = [Text(head[0], style="bold")] + [Text(h) for h in head[1:]]
    if e.rows:
        cols, rows, total, hidden = _table_rows(e, max_rows)
        table = Table(show_lines=True, header_style="bold")
        n = len(cols)
        for k, c in enumerate(cols):
            table.add_column(c, justify="right" if k >= n - 4 else "left", overflow="fold",
                             no_wrap=k >= n - 4)
        colour = {"wan": "red", "region": "yellow", "node": "green"}
        for row in rows:
            cells = []
            for k, cell in enumerate(row):
                text = "\n".join(cell)
                if cols[k].startswith("collectives"):
                    t = Text()
                    for i, s in enumerate(cell):
                        style = next((v for key, v in colour.items() if f"({key}" in s), "")
                        t.append(("\n" if i else "") + s, style=style)
                    cells.append(t)
                else:
                    cells.append(text)
            table.add_row(*cells)
        table.add_row(*["\n".join(c) for c in total], style="bold")
        parts.append(table)
        if hidden:
            parts.append(Text(f"... {hidden} more layers (max_rows={max_rows})"))
    if e.per_layer_note:
        parts.append(Text(e.per_layer_note, style="yellow"))
    parts += [Text(f) for f in _footer_lines(e)]
    return Group(*parts)



def explain(plan, fmt: str = "text", *, depth: int | None = None, collapse: bool = True,
            max_rows: int | None = None):
    """Explain a plan per layer: layouts, collectives per link class, time and memory.

    Args:
      plan: a :class:`hulkjax.Plan` (from ``hj.plan``, ``hj.compare`` or ``step.plan``).
      fmt: ``"text"`` (a plain string), ``"markdown"`` (a string with a pipe table) or ``"rich"``
        (a ``rich`` renderable for ``Console().print``).
      depth: cut layer labels to this many scope components (coarser rows); ``None``: full.
      collapse: merge repeated identical layers (``h_{0..11}``) into one row.
      max_rows: show at most this many layer rows.

    >>> import hulkjax as hj, jax.numpy as jnp
    >>> plan = hj.plan(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)),
    ...                topology=hj.Topology.grid((8,), ("d",)), strategy="fsdp")
    >>> explain(plan, fmt="markdown").splitlines()[0]
    "### Plan 'fsdp' on grid-8 (mesh d=8)"
    """
    renderers = {"text": render_text, "markdown": render_markdown, "md": render_markdown,
                 "rich": render_rich}
    if fmt not in renderers:
        raise HulkjaxError(f"explain(fmt={fmt!r}): use one of 'text', 'markdown', 'rich'.")
    return renderers[fmt](explanation(plan, depth=depth, collapse=collapse), max_rows=max_rows)


# ---- Plan.summary --------------------------------------------------------------------------


def summary_section(plan, max_rows: int) -> list[str]:
    """The per-layer table :meth:`hulkjax.Plan.summary` prints first (plans with a graph)."""
    if plan.graph is None or plan.topology is None:
        return []
    e = explanation(plan)
    cols, rows, total, hidden = _table_rows(e, max_rows)
    lines = _text_table(cols, rows, total)
    if hidden:
        lines.append(f"... {hidden} more layers")
    return lines + [""]
