"""The plan of a drop-in layer call (qwen3layer.torch.masks): the C sequences its batch rows run
as, and the per-token inputs of a call with hidden keys or a tree."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch


@dataclasses.dataclass
class Segment:
    """rows [start, end) of one batch row run as one C sequence; its first `padding` rows
    are padding (left padding), and rows after its real ones may be padding too"""
    start: int
    end: int
    padding: int


@dataclasses.dataclass
class CallPlan:
    """packed: None when every batch row is one sequence of the C cache (the ordinary call:
    one C call over the batch, with `padding` leading padding rows each on a new cache);
    else the segments of each batch row, each run as a sequence of its own.
    key_width: the keys transformers' attention maps span (a static cache's length).
    offsets: each sequence's first real token's position (position_ids, else the cache
    position): per batch row for the ordinary call, per segment in order when packed."""
    padding: List[int]
    packed: Optional[List[List[Segment]]]
    key_width: int
    offsets: List[int]
    kind: str
    token_mask: Optional[torch.Tensor] = None  # [batch, length] bool on the host: False hides a token
    positions: Optional[torch.Tensor] = None   # [batch, length] int64 on the host: each token's position
    tree: Optional[torch.Tensor] = None        # [batch, length, length] bool on the host: the call's tree
