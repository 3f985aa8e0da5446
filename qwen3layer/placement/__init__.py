"""Placement: where the layer's experts run, beside its attention. This package's own names
say where the experts live under expert parallelism, each rank's expert ids
(contiguous_placement, check_placement), for parallel.py and the cost model's exchange
(qwen3layer.analysis.costs). It imports no torch, and of qwen3layer only config (the id list
check), so that `import qwen3layer` never loads torch through it; its modules, which import
torch, are loaded only when imported by name:
  parallel.py  the experts over torch.distributed ranks (ExpertParallelLayer; its public
               path is qwen3layer.parallel, which re-exports it)
  hybrid.py    one GPU and the host experts (DecoderLayer(..., expert_device="cpu"))
  passes.py    the pass runner both share, over the engine's attention passes"""
from __future__ import annotations

from typing import List, Sequence

from ..config import expert_ids

__all__ = ["contiguous_placement", "check_placement"]


def contiguous_placement(num_experts: int, world: int) -> List[List[int]]:
    """Experts in contiguous shards, the first num_experts % world ranks one more."""
    if world < 1:
        raise ValueError(f"world: expected at least 1 rank, got {world}")
    base, extra = divmod(num_experts, world)
    shards, start = [], 0
    for r in range(world):
        n = base + (r < extra)
        shards.append(list(range(start, start + n)))
        start += n
    return shards


def check_placement(placement: Sequence[Sequence[int]], num_experts: int, world: int) -> List[List[int]]:
    """placement as lists, refused naming the problem unless each of the num_experts experts
    is on exactly one of the world ranks"""
    if len(placement) != world:
        raise ValueError(f"placement: expected a list of expert ids for each of the {world} ranks, "
                         f"got {len(placement)} lists")
    seen: dict = {}
    for r, ids in enumerate(placement):
        for e in expert_ids(ids, num_experts, f"placement[{r}]"):
            if e in seen:
                raise ValueError(f"placement: expert {e} placed on ranks {seen[e]} and {r}; expected each on one")
            seen[e] = r
    missing = [e for e in range(num_experts) if e not in seen]
    if missing:
        raise ValueError(f"placement: experts {missing[:8]}{' ...' if len(missing) > 8 else ''} are on no rank")
    return [list(ids) for ids in placement]
