"""LayerTrace: what a layer call hands back when asked for its insides
(DecoderLayer.prefill/decode with return_router=True or return_attention=True)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional

if TYPE_CHECKING:
    from .analysis.routing import RoutingSummary


class LayerTrace(NamedTuple):
    """The output of one layer call and the insides it was asked for, each the same kind of
    tensor as x (torch in, torch out; numpy in, numpy out), on the layer's device; None for
    what was not asked. Rows follow x: x [tokens, hidden] gives router rows [tokens, ...],
    x [batch, tokens, hidden] gives [batch, tokens, ...], decode's x [batch, hidden] gives
    [batch, ...].

    output: the layer's output, as prefill/decode return it alone.
    router_logits: [..., num_experts] float32, the router's logits (before its softmax).
    experts: [..., top_k] int32, the experts chosen, by descending weight.
    expert_weights: [..., top_k] float32, their weights (renormalised when norm_topk_prob).
    attention: [batch, heads, new tokens, context] float32, the attention probabilities;
    column j is cache position j of the sequence (context: the longest sequence after the
    call), 0 where the query does not look (the future, left padding, past a shorter sequence).
    """

    output: Any
    router_logits: Optional[Any] = None
    experts: Optional[Any] = None
    expert_weights: Optional[Any] = None
    attention: Optional[Any] = None

    def routing(self) -> "RoutingSummary":
        """Tokens per expert for this call (qwen3layer.analysis.routing.RoutingSummary: the
        counts over every row and top-k slot, busiest and idlest experts, max / mean; a table
        in Jupyter, .plot() a bar chart). Counted in C; a CUDA trace's choices are copied to
        the host there. Needs a trace made with return_router=True."""
        if self.experts is None or self.router_logits is None:
            raise ValueError("routing: this trace holds no router choices; call prefill/decode with "
                             "return_router=True")
        from .analysis.routing import routing_summary

        return routing_summary(self.experts, int(self.router_logits.shape[-1]))
