"""Measured stages joined with the cost model: what layer.profile returns and what the CLI
prints (a text table; in Jupyter an HTML table of the same cells). Formatting and ratios
only; the timing is done in C (a monotonic clock at each stage boundary of the forward)."""
from __future__ import annotations

import dataclasses
import html
from typing import Dict, List

from .costs import CostModel


@dataclasses.dataclass
class StageTime:
    name: str
    kernel: str
    shapes: str
    seconds: float
    share: float
    weight_bytes: int
    bytes: int
    flops: float

    @property
    def gbs(self) -> float:
        """bytes moved per second, in GB/s"""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclasses.dataclass
class Profile:
    mode: str
    cost: CostModel
    stages: List[StageTime]
    call_seconds: float      # the same work, unprofiled
    workspace_bytes: int
    cache_bytes: int
    hidden_keys: int = 0     # of each sequence's context, hidden from the timed calls (read and scored all the same)

    @property
    def stage_seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def dominant(self) -> StageTime:
        return max(self.stages, key=lambda s: s.seconds)

    def title(self) -> str:
        hidden = f" ({self.hidden_keys} hidden)" if self.hidden_keys else ""
        return (f"{self.mode}: {self.cost.tokens} token(s) x batch {self.cost.batch}, context {self.cost.context}"
                f"{hidden}, {self.cost.passes} pass(es) of {self.cost.chunk_size}; stages {self.stage_seconds * 1e3:.2f} ms, "
                f"unprofiled {self.call_seconds * 1e3:.2f} ms")

    def table(self) -> str:
        return stage_table(self.stages, self.title())

    def __repr__(self) -> str:
        """a terminal's `p` and `print(p)`: the text table the CLI prints (not the fields)"""
        return self.table()

    def _repr_html_(self) -> str:
        """Jupyter: the stage table as HTML, the dominant stage in bold."""
        return stage_table_html(self.stages, self.title())


def join(cost: CostModel, seconds: Dict[str, float]) -> List[StageTime]:
    total = sum(seconds.values()) or 1.0
    out = []
    for s in cost.stages:
        shapes = " ".join("x".join(map(str, shape)) for shape in s.inputs) + " -> " + \
                 " ".join("x".join(map(str, shape)) for shape in s.outputs)
        t = seconds.get(s.name, 0.0)
        out.append(StageTime(s.name, s.kernel, shapes, t, t / total, s.weight_bytes, s.bytes, s.flops))
    return out


HEAD = ("stage", "kernel", "shapes (first pass)", "weights MB", "moved MB", "GFLOP", "ms", "share", "GB/s", "GFLOP/s")


def _cells(s: StageTime) -> tuple:
    """A stage's row after its name, as the tables print it."""
    return (s.kernel, s.shapes, f"{s.weight_bytes / 1e6:.1f}", f"{s.bytes / 1e6:.1f}", f"{s.flops / 1e9:.2f}",
            f"{s.seconds * 1e3:.2f}", f"{s.share:.0%}", f"{s.gbs:.1f}", f"{s.gflops:.1f}")


def _dominant(stages: List[StageTime]) -> str:
    return max(stages, key=lambda s: s.seconds).name if stages else ""


def stage_table(stages: List[StageTime], title: str) -> str:
    head = HEAD
    dominant = _dominant(stages)
    rows = [((">" if s.name == dominant else " ") + s.name,) + _cells(s) for s in stages]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = [title, " | ".join(h.ljust(w) for h, w in zip(head, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines) + "\n(> marks the dominant stage)"


def stage_table_html(stages: List[StageTime], title: str) -> str:
    """The cells of stage_table as an HTML table (numbers right-aligned, the dominant stage's
    row bold), every text escaped."""
    dominant = _dominant(stages)
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in HEAD)
    rows = []
    for s in stages:
        style = ' style="font-weight:bold"' if s.name == dominant else ""
        cells = _cells(s)
        tds = [f"<td>{e(s.name)}</td>", f"<td>{e(cells[0])}</td>", f"<td>{e(cells[1])}</td>"]
        tds += [f'<td style="text-align:right">{e(c)}</td>' for c in cells[2:]]
        rows.append(f"<tr{style}>{''.join(tds)}</tr>")
    return (f'<table class="qwen3layer-profile"><caption>{e(title)} (bold: the dominant stage)</caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
