"""The plans of masks beyond left padding (qwen3layer.torch.masks): causal attention over each
batch row's visible keys (holes, right padding: the C cache's hidden tokens, the call's
token_mask) and trees (each query sees the cached keys and some of the call's tokens up to
itself: the C layer's tree), each with explicit positions (position_ids)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .plans import CallPlan


def visible_keys(allowed: torch.Tensor, past: int) -> Optional[torch.Tensor]:
    """[batch, past + length] bool: the keys a mask leaves visible when it is causal attention
    over them (query t of a row sees exactly that row's visible keys up to its own, past + t,
    and none past the call's), else None. A token's own key says whether it is visible; the
    last query's view says it of the cached ones."""
    batch, length, width = allowed.shape
    n = past + length
    if width > n and bool(allowed[:, :, n:].any()):
        return None
    t = torch.arange(length, device=allowed.device)
    visible = torch.cat([allowed[:, length - 1, :past], allowed[:, t, past + t]], dim=1)
    causal = torch.ones(length, n, dtype=torch.bool, device=allowed.device).tril(past)
    return visible if torch.equal(allowed[:, :, :n], causal[None] & visible[:, None, :]) else None


def cached_visible(past: int, padding: int, hidden: Sequence[int]) -> torch.Tensor:
    """[past] bool: the keys a C cache's sequence shows (not its padding, not its hidden tokens)"""
    ours = torch.ones(past, dtype=torch.bool)
    ours[:padding] = False
    ours[list(hidden)] = False
    return ours


def tree_plan(allowed: torch.Tensor, pos: List[List[int]], past: int, cache_padding: Optional[Sequence[int]],
               cache_hidden: Optional[Sequence[Sequence[int]]], kind: str) -> Optional[CallPlan]:
    """The plan of a call whose queries each see the cached keys (the C cache's visible ones)
    and a set of the call's tokens up to themselves, themselves included (a tree of branches
    over a shared prefix, tree speculative decoding's verify): the C layer's tree argument,
    positions from position_ids. None when the mask is not of that form."""
    batch, length, width = allowed.shape
    n = past + length
    if width > n and bool(allowed[:, :, n:].any()):
        return None
    for b in range(batch):
        if past and not torch.equal(allowed[b, :, :past].cpu(), cached_visible(
                past, cache_padding[b] if cache_padding else 0, cache_hidden[b] if cache_hidden else ())[None].expand(
                    length, past)):
            return None
    tree = allowed[:, :, past:n].cpu()
    if not bool(tree.diagonal(dim1=1, dim2=2).all()) or bool(tree.triu(1).any()):
        return None
    padding = list(cache_padding) if cache_padding is not None else [0] * batch
    return CallPlan(padding, None, width, [], f"{kind} (tree)", None, positions_of(pos), tree.contiguous())


def positions_of(pos: List[List[int]]) -> torch.Tensor:
    """position_ids as the C layer takes them ([batch, length] int64 on the host); ValueError
    naming the first negative one"""
    positions = torch.tensor(pos, dtype=torch.int64)
    if bool((positions < 0).any()):
        b, t = (positions < 0).nonzero()[0].tolist()
        raise ValueError(f"position_ids: token {t} of batch row {b} is at position {pos[b][t]}: the C layer takes "
                         "positions from 0 on")
    return positions


def key_mask_plan(visible: torch.Tensor, pos: List[List[int]], past: int, cache_padding: Optional[Sequence[int]],
                   cache_hidden: Optional[Sequence[Sequence[int]]], kind: str, key_width: int) -> CallPlan:
    """The plan of a call whose mask hides keys that left padding does not (holes, right
    padding, a token hidden after a seen one): causal attention over each row's visible keys
    (visible [batch, past + length]: visible_keys'), which the C layer computes with the
    call's token mask and explicit positions (position_ids); the cache keeps the hidden
    tokens for the calls after. A continuing call's cached keys must be the C cache's visible
    ones: its padding and hidden tokens hidden, the rest seen (ValueError naming the first
    that differs)."""
    batch = len(pos)
    if cache_padding is not None:
        for b in range(batch):
            ours = cached_visible(past, cache_padding[b], cache_hidden[b] if cache_hidden else ())
            theirs = visible[b, :past].cpu()
            if not torch.equal(theirs, ours):
                j = int((theirs != ours).nonzero()[0])
                raise ValueError(f"attention_mask: batch row {b} {'shows' if theirs[j] else 'hides'} cached token {j}, "
                                 f"which the C cache {'hides' if ours[j] else 'shows'} (its padding "
                                 f"{cache_padding[b]}, hidden tokens {list(cache_hidden[b]) if cache_hidden else []}): "
                                 "a cached token's mask is the one of the call that wrote it")
    new = visible[:, past:].cpu().contiguous()
    positions = positions_of(pos)
    padding = list(cache_padding) if cache_padding is not None else [0] * batch
    return CallPlan(padding, None, key_width, [], f"{kind} (hidden keys)", None if bool(new.all()) else new,
                    positions)
