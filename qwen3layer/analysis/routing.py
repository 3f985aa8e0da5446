"""RoutingSummary: how one layer call spread its tokens over the experts (LayerTrace.routing(),
or routing_summary(experts, num_experts) for any int32 tensor of chosen experts). The counts
are made in C (_C.expert_counts: a CUDA trace's experts are copied to the host there, after
the device has finished the call); here only totals, ratios and the drawing. In Jupyter it
shows as a table (_repr_html_); plot() draws the counts as a matplotlib bar chart."""
from __future__ import annotations

import dataclasses
import html
from typing import Any, List, Tuple

from .. import _C


@dataclasses.dataclass(frozen=True)
class RoutingSummary:
    """counts[e]: the (token, slot) choices that went to expert e in the call, over every row
    of the trace (batch x tokens, or batch for decode) and all top_k slots of each."""
    counts: Tuple[int, ...]
    top_k: int

    @property
    def num_experts(self) -> int:
        return len(self.counts)

    @property
    def choices(self) -> int:
        """tokens x top_k: every (token, slot) pair routed"""
        return sum(self.counts)

    @property
    def tokens(self) -> int:
        """rows routed (each chose top_k experts)"""
        return self.choices // self.top_k

    @property
    def mean(self) -> float:
        """choices per expert under perfect balance"""
        return self.choices / self.num_experts

    @property
    def imbalance(self) -> float:
        """the busiest expert's count over the mean (1.0: perfectly balanced; 0 with no tokens)"""
        return max(self.counts) / self.mean if self.choices else 0.0

    @property
    def busiest(self) -> Tuple[int, ...]:
        """the experts holding the largest count (several on a tie), ascending"""
        top = max(self.counts)
        return tuple(e for e, c in enumerate(self.counts) if c == top)

    @property
    def idlest(self) -> Tuple[int, ...]:
        """the experts holding the smallest count (several on a tie), ascending"""
        low = min(self.counts)
        return tuple(e for e, c in enumerate(self.counts) if c == low)

    @property
    def unused(self) -> Tuple[int, ...]:
        """the experts no token chose"""
        return tuple(e for e, c in enumerate(self.counts) if c == 0)

    def share(self, expert: int) -> float:
        """expert's fraction of all choices"""
        return self.counts[expert] / self.choices if self.choices else 0.0

    def ranking(self) -> List[int]:
        """every expert, busiest first (equal counts by ascending index)"""
        return sorted(range(self.num_experts), key=lambda e: (-self.counts[e], e))

    def headline(self) -> str:
        top, low = self.busiest, self.idlest
        return (f"{self.tokens} token(s) x top-{self.top_k} = {self.choices} choices over {self.num_experts} experts; "
                f"busiest {_experts(top)} ({self.counts[top[0]]}), idlest {_experts(low)} ({self.counts[low[0]]}), "
                f"{len(self.unused)} unused; imbalance (max / mean) {self.imbalance:.2f}")

    def __str__(self) -> str:
        return f"RoutingSummary: {self.headline()}"

    def _repr_html_(self) -> str:
        """Jupyter: the headline, then a row per expert (busiest first): expert, tokens,
        share, and a bar of the share against the busiest expert's; a long table scrolls."""
        e = html.escape
        top = max(self.counts) or 1
        rows = "".join(
            f'<tr><td style="text-align:right">{i}</td><td style="text-align:right">{self.counts[i]}</td>'
            f'<td style="text-align:right">{self.share(i):.1%}</td><td style="width:12em">'
            f'<div style="background:#4c72b0;height:0.8em;width:{100 * self.counts[i] / top:.1f}%"></div></td></tr>'
            for i in self.ranking())
        return (f'<div class="qwen3layer-routing"><p>{e(self.headline())}</p>'
                f'<div style="max-height:24em;overflow-y:auto"><table><thead><tr><th>expert</th><th>tokens</th>'
                f"<th>share</th><th></th></tr></thead><tbody>{rows}</tbody></table></div></div>")

    def plot(self, ax: Any = None) -> Any:
        """A bar per expert (its count), the mean as a dashed line; on `ax` (default: a new
        figure of matplotlib.pyplot). Returns the Axes."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("RoutingSummary.plot needs matplotlib (pip install matplotlib)") from None
        if ax is None:
            _, ax = plt.subplots(figsize=(max(6.0, min(16.0, 0.12 * self.num_experts + 4)), 3.5))
        ax.bar(range(self.num_experts), self.counts, width=0.8, color="#4c72b0")
        ax.axhline(self.mean, color="tab:red", linestyle="--", linewidth=1,
                   label=f"mean {self.mean:.1f} (imbalance {self.imbalance:.2f})")
        ax.set_xlabel("expert")
        ax.set_ylabel("tokens routed")
        ax.set_xlim(-0.6, self.num_experts - 0.4)
        ax.set_title(f"{self.tokens} token(s) x top-{self.top_k} over {self.num_experts} experts", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
        return ax


def _experts(es: Tuple[int, ...]) -> str:
    shown = ", ".join(map(str, es[:5]))
    return shown + (f" and {len(es) - 5} more" if len(es) > 5 else "")


def routing_summary(experts: Any, num_experts: int) -> RoutingSummary:
    """The summary of an int32 tensor of chosen experts [..., top_k] (a LayerTrace's experts;
    host or CUDA, torch, numpy or the extension's Tensor) over num_experts experts."""
    shape = tuple(getattr(experts, "shape", ()))
    counts = _C.expert_counts(experts, num_experts)  # checks dtype, device and every index
    if not shape or shape[-1] < 1:
        raise ValueError(f"experts: expected a shape [..., top_k] with top_k >= 1, got {list(shape)}")
    return RoutingSummary(tuple(counts), int(shape[-1]))
