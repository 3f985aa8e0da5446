"""One layer call run pass by pass over the engine's attention passes, with the experts run
elsewhere between them: the Python pass runner the layer split over the GPU and the host
(qwen3layer.placement.hybrid) and the expert-parallel layer (qwen3layer.placement.parallel)
share.

The engine checks the whole call once when its passes open (Layer.attention_passes), writes
the call's insides at the call's rows as each pass runs, and rolls the cache back to where the
call began when the call is aborted: a failure anywhere in a pass (the experts elsewhere
included, a collective's timeout, Ctrl-C) leaves nothing half-written. This loop is in Python,
not in the engine's own pass loop, because the experts elsewhere are Python's (the split's
pinned copies and the host layer, a torch.distributed exchange): called back from inside the
engine, they would run under the layer's lock, which the expert-parallel layer's own experts
take again, and a collective would wait with the engine's call half done."""
from __future__ import annotations

from typing import Any, Callable, Optional


def run_passes(passes: Any, y: Any, experts: Callable[[Optional[tuple], Any], Any], *, decode: bool,
               total: Optional[int] = None) -> Optional[tuple]:
    """Runs the open _C.AttentionPasses `passes` to the end, then closes it: each pass's
    halves (resid, normed, experts, weights) go to experts(halves, into), which returns the
    pass's output rows (into, when it wrote them there). y: the call's output, a torch tensor
    of x's shape, or None when the caller keeps each pass's output itself (the executor's
    tensors, which have no views). `into` is the pass's rows of y when they are a contiguous
    view of it (one sequence, or decode), else None; other rows are copied into y. total: the
    passes to take part in (the expert-parallel layer's ranks run as many as the longest
    call), each past this call's own as experts(None, None). Returns the insides from close()
    ((router logits, experts, weights, attention), the engine's tensors) or None; on any
    exception the passes are aborted, the cache rolled back, and the exception raised."""
    try:
        first = 0
        for _ in range(passes.passes):
            halves = next(passes)
            sl = slice(first, passes.next_token)
            first = passes.next_token
            into = None if y is None else y if decode else y[sl] if y.dim() == 2 else None
            out = experts(halves, into)
            if y is not None and out is not into:
                (y if decode else y[..., sl, :]).copy_(out)
        for _ in range(passes.passes, total or 0):
            experts(None, None)
        return passes.close()
    except BaseException:  # the cache back to where the call began, in the engine
        passes.abort()
        raise
