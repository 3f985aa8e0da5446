"""What a transformers attention mask asks of the drop-in layer, decided before the C layer runs.

The C layer computes one kind of attention: each sequence of its cache attends causally to
its own tokens, after a run of leading padding that no later token attends to (a padding
token looks at itself only), with positions counted from the first real token. A model
call can ask for more: packed sequences (several sequences in one row, position_ids
restarting at 0 for each), a custom 4D mask, a sliding window, a static cache wider than
the tokens held. plan_call reads the mask the model gives its layers (None, 2D key padding
as flash attention gets it, or 4D [batch, 1, queries, keys] bool or additive), the
position_ids and transformers' padding-free kwargs (cu_seq_lens_q/k), and returns a
CallPlan that the C layer runs exactly, or raises ValueError saying which mask it got.

Rows: a query row is real when the mask lets it attend to its own key; a real row must
attend exactly to a contiguous run of keys ending at itself, all of them real tokens (or the
cache's real tokens). Rows that are not real (padding: their own key masked) are computed as
the C layer computes padding, and no real row may look at them. So in one row of the batch:
    causal, left padding: the real rows start at the first real token    -> one C sequence
    right padding, holes: causal over the row's visible keys, a key hidden
      after a visible one (or a cache holding hidden keys)                -> one C sequence,
      its hidden tokens the call's token_mask, its positions position_ids (_key_mask_plan)
    packed: real rows whose run starts at themselves open a new sequence -> one C sequence each
    a tree: each query sees the cached keys and some of the call's up to
      itself (branches over a shared prefix)                           -> one C sequence,
      the call's tree, its positions position_ids (_tree_plan)
    anything else (a sliding window): refused, named.
position_ids must run on by one from each sequence's first real token (the C cache then
places that token at its position: KVCache.set_first_position); a restart that the mask
does not separate, or a jump, is refused. planned() makes the plan once for the layers of a
model call (every one gets the same mask) and keeps it for them.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import key_masks as _keys
from .plans import CallPlan, Segment


def _describe_row(row: Sequence[bool]) -> str:
    keys = [j for j, a in enumerate(row) if a]
    if not keys:
        return "no key"
    runs, start = [], keys[0]
    for a, b in zip(keys, keys[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            if b is not None:
                start = b
    return "keys " + ", ".join(runs[:6]) + (" ..." if len(runs) > 6 else "")


def _refuse(what: str, b: int, t: int, past: int, row: Sequence[bool], expected: str) -> None:
    raise ValueError(
        f"attention_mask: {what}: query {t} of batch row {b} (cache position {past + t}) attends to "
        f"{_describe_row(row)}, {expected}; the qwen3layer C layer computes causal attention over "
        "each sequence's visible keys (left and right padding, holes), packed sequences (a block-diagonal "
        "causal mask) and trees over the cached keys, and refuses other masks rather than run a different one")


def allowed_keys(mask: Optional[torch.Tensor], batch: int, length: int, past: int) -> Optional[torch.Tensor]:
    """[batch, length, keys] bool: which keys each query may attend to (None: causal)"""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attention_mask: expected a tensor or None, got {type(mask).__name__}")
    if mask.dim() == 2:  # flash attention's key padding [batch, keys]: 1 for a real token
        if mask.shape[0] not in (1, batch) or mask.shape[1] < past + length:
            raise ValueError(f"attention_mask: expected a 2D mask [{batch}, >= {past + length}], "
                             f"got {list(mask.shape)}")
        keys = mask.bool().expand(batch, -1)
        causal = torch.ones(length, keys.shape[1], dtype=torch.bool, device=mask.device).tril(past)
        return keys[:, None, :] & causal[None]
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[2] != length \
            or mask.shape[3] < past + length:
        raise ValueError(f"attention_mask: expected a 4D mask [{batch}, 1, {length}, >= {past + length}] "
                         f"(or a 2D one), got {list(mask.shape)}")
    m = mask
    if m.shape[1] != 1:
        if not bool((m == m[:, :1]).all()):
            raise ValueError(f"attention_mask: a mask per head ({m.shape[1]} heads) that differs between "
                             "heads: the C layer applies one mask to every head")
        m = m[:, :1]
    m = m[:, 0].expand(batch, -1, -1)
    if m.dtype == torch.bool:
        return m
    if not m.dtype.is_floating_point:
        return m != 0
    masked = m <= torch.finfo(m.dtype).min / 2
    if not bool(((m == 0) | masked).all()):
        bad = m[~((m == 0) | masked)].flatten()[0].item()
        raise ValueError(f"attention_mask: an additive mask with a value other than 0 and -inf ({bad:g}): "
                         "a bias on the scores, which the C layer does not add")
    return ~masked


def _row_summary(allowed: torch.Tensor, past: int) -> Tuple[List[bool], List[int], List[bool]]:
    """per query of one batch row ([length, keys] allowed): whether it sees its own key,
    the first key it sees, and whether it sees exactly the keys from that one to itself"""
    length, width = allowed.shape
    t = torch.arange(length, device=allowed.device)
    real = allowed[t, past + t]
    as_int = allowed.to(torch.int8)
    first = as_int.argmax(dim=1)
    last = width - 1 - as_int.flip(1).argmax(dim=1)
    ok = (last == past + t) & (allowed.sum(dim=1) == last - first + 1)
    return real.tolist(), first.tolist(), ok.tolist()


def _plan_row(allowed: torch.Tensor, b: int, past: int, pad_cont: Optional[int]) -> Tuple[List[Segment], List[bool]]:
    """the segments of batch row b from its allowed keys [length, keys], and which of its
    rows are real"""
    length = allowed.shape[0]
    real, firsts, ok = _row_summary(allowed, past)
    row = lambda t: allowed[t].tolist()  # noqa: E731  (for the messages only)
    real_before = [0]
    for r in real:
        real_before.append(real_before[-1] + r)
    segments: List[Segment] = []
    for t in range(length):
        if not real[t]:
            if pad_cont is not None:
                _refuse("a padding query after the cache's tokens", b, t, past, row(t),
                        "but a call continuing the cache must see each new token's own key")
            continue
        first = firsts[t]
        if not ok[t]:
            hidden = [j for j in range(first, past + t + 1) if not allowed[t, j]]
            if pad_cont is not None and hidden and hidden[-1] < past:
                _refuse("cached tokens masked (right padding of an earlier call, or a hole)", b, t, past, row(t),
                        f"but the C cache's sequence attends to each of its tokens after its {pad_cont} left padding "
                        f"ones ({len(hidden)} masked from key {hidden[0]})")
            _refuse("not a contiguous run of keys ending at the query", b, t, past, row(t),
                    f"expected keys {first}-{past + t}")
        if pad_cont is not None:  # continuing the cache: from its first real token on
            if first != pad_cont:
                _refuse("not the cache's causal attention", b, t, past, row(t),
                        f"expected keys {pad_cont}-{past + t} (the sequence after its {pad_cont} padding tokens)")
            continue
        if real_before[t + 1] - real_before[first] != t - first + 1:
            _refuse("a real token attending to a padding token", b, t, past, row(t),
                    "but padding tokens (queries that do not see their own key) are computed as padding")
        if first == t:  # opens a sequence: the rows before it belong to the previous one
            if segments:
                segments[-1].end = t
                segments.append(Segment(t, length, 0))
            else:
                segments.append(Segment(0, length, t))  # leading padding rows
        elif not segments or first != segments[-1].start + segments[-1].padding:
            expected = (f"keys {segments[-1].start + segments[-1].padding}-{past + t} (its sequence's)"
                        if segments else f"keys {t}-{t}")
            _refuse("not causal within a sequence (a sliding window or a custom mask?)", b, t, past, row(t),
                    expected)
    if pad_cont is not None:
        return [Segment(0, length, 0)], real
    return segments or [Segment(0, length, length)], real  # every row padding


def _continues(allowed: torch.Tensor, past: int, cache_padding: Sequence[int]) -> bool:
    """whether allowed [batch, length, keys] is the mask of a call continuing a cache whose
    sequences begin with cache_padding padding tokens: query t of row b sees exactly the keys
    from cache_padding[b] to past + t. _plan_row accepts a continuing row just when it sees
    these (each query real, its run from the sequence's first real token to itself), so this
    one comparison over the batch gives its plan without its per-row reading of the mask (a
    decode step's plan, made once a model call); anything else goes to _plan_row, which
    names what it saw. A padding run longer than the tokens held would make a row of no key,
    which is not a real query: left to _plan_row too."""
    if max(cache_padding) > past:
        return False
    batch, length, width = allowed.shape
    device = allowed.device
    keys = torch.arange(width, device=device)  # (each torch op costs more than the arithmetic: as few as may be)
    last = past if length == 1 else past + torch.arange(length, device=device)[:, None]
    expected = keys <= last
    if any(cache_padding):
        expected = expected & (keys >= torch.tensor(cache_padding, device=device)[:, None, None])
    return torch.equal(allowed, expected.expand(batch, length, width))


def _rows(position_ids: torch.Tensor, batch: int) -> List[List[int]]:
    """position_ids [batch or 1, length] as a list of `batch` rows (a row of one repeated, each
    its own list): position_ids.expand(batch, -1).tolist() with one torch call instead of two"""
    rows = position_ids.tolist()
    return rows if len(rows) == batch else [list(rows[0]) for _ in range(batch)]


def plan_call(mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], batch: int, length: int,
              past: int, cache_padding: Optional[Sequence[int]], attn_implementation: Optional[str] = None,
              cu_seq_lens: Optional[torch.Tensor] = None, cache_position: Optional[torch.Tensor] = None,
              cache_hidden: Optional[Sequence[Sequence[int]]] = None) -> CallPlan:
    """The plan of one layer call of `length` new tokens per batch row after `past` cached
    ones; cache_padding and cache_hidden: the C cache's padding and hidden tokens per sequence
    when the call continues one; cache_position (4.57's): where transformers writes the new
    keys, which must be the C cache's next rows."""
    if cache_position is not None and cache_position.flatten().tolist() != list(range(past, past + length)):
        got = cache_position.flatten().tolist()
        raise ValueError(f"cache_position: expected {past} to {past + length - 1} (the C cache appends after the {past} "
                         f"tokens it holds), got {got[:8]}{' ...' if len(got) > 8 else ''}")
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != length
                                     or position_ids.shape[0] not in (1, batch)):
        raise ValueError(f"position_ids: expected [{batch}, {length}] (or [1, {length}]), got "
                         f"{list(position_ids.shape)}")
    pos = _rows(position_ids, batch) if position_ids is not None else None
    allowed = allowed_keys(mask, batch, length, past)
    hidden_cached = bool(cache_hidden) and any(cache_hidden)
    if allowed is not None:
        key_width = allowed.shape[-1]
        kind = "4D mask" if mask.dim() == 4 else "2D mask"
        if cache_padding is not None and not hidden_cached and _continues(allowed, past, cache_padding):
            plans, reals = [[Segment(0, length, 0)] for _ in range(batch)], None  # _plan_row's, every row real
        else:
            visible = _keys.visible_keys(allowed, past) if cu_seq_lens is None else None
            pos = _rows(position_ids, batch) if position_ids is not None else \
                [list(range(past, past + length))] * batch
            if visible is not None and (hidden_cached or not bool((visible.to(torch.int8).diff(dim=1) >= 0).all())):
                # a key hidden after a seen one (holes, right padding), or a cache holding such keys: more than
                # left padding, which the ordinary plan below computes with the cache's padding
                return _keys.key_mask_plan(visible, pos, past, cache_padding, cache_hidden, kind, key_width)
            try:
                if hidden_cached:
                    raise ValueError("attention_mask: not causal over the visible keys of a cache holding hidden "
                                     "tokens")
                rows = [_plan_row(allowed[b], b, past, None if cache_padding is None else cache_padding[b])
                        for b in range(batch)]
            except ValueError:  # what the ordinary plans refuse may be a tree
                tree = _keys.tree_plan(allowed, pos, past, cache_padding, cache_hidden, kind) if cu_seq_lens is None \
                    else None
                if tree is None:
                    raise
                return tree
            plans, reals = [r[0] for r in rows], [r[1] for r in rows]
    else:
        key_width, reals = past + length, None
        if cache_padding is not None and (any(cache_padding) or hidden_cached):
            raise ValueError(f"attention_mask: None (every key attended) in a call continuing a cache whose sequences "
                             f"begin with padding {list(cache_padding)} or hold hidden tokens "
                             f"{[list(h) for h in cache_hidden or []]}: transformers would attend to them, "
                             "the C layer does not; pass the attention mask of the generation")
        plans = [[Segment(0, length, 0)] for _ in range(batch)]
        kind = "no mask (causal)"
        packed_by = None
        if cu_seq_lens is not None:
            packed_by = "cu_seq_lens"
        elif pos is not None and attn_implementation and "flash" in attn_implementation:
            packed_by = "position_ids"  # flash attention reads packing off restarting positions
        if packed_by is not None:
            if past:
                raise ValueError(f"{packed_by}: packed sequences in a call that continues a cache of {past} tokens")
            plans = [_segments_of(cu_seq_lens, pos, b, length, batch) for b in range(batch)]
            kind = f"packed ({packed_by})"
    if cu_seq_lens is not None and allowed is not None:
        given = _segments_of(cu_seq_lens, None, 0, length, batch)
        if batch != 1 or [(s.start, s.end) for s in given] != [(s.start, s.end) for s in plans[0]]:
            raise ValueError(f"cu_seq_lens_q: sequences {[(s.start, s.end) for s in given]} differ from the "
                             f"mask's {[(s.start, s.end) for s in plans[0]]}")
    packed = any(len(p) > 1 for p in plans)
    if packed and past:
        raise ValueError("attention_mask: packed sequences in a call that continues a cache")
    if packed:
        kind = kind if kind.startswith("packed") else "packed (block-diagonal mask)"
    if pos is None:  # transformers' positions without position_ids: the cache positions
        pos = [list(range(past, past + length))] * batch
    offsets = _offsets(pos, plans, past, cache_padding, reals)
    padding = [p[0].padding if cache_padding is None else cache_padding[b] for b, p in enumerate(plans)]
    return CallPlan(padding, plans if packed else None, key_width, offsets, kind)


def _segments_of(cu_seq_lens: Optional[torch.Tensor], pos: Optional[List[List[int]]], b: int,
                 length: int, batch: int) -> List[Segment]:
    """packed sequences from cu_seq_lens ([0, l1, l1 + l2, ...] over the flattened batch) or
    from position_ids restarting at 0"""
    if cu_seq_lens is not None:
        cuts = [int(c) for c in cu_seq_lens.flatten().tolist()]
        if batch != 1 or cuts[0] != 0 or cuts[-1] != length or any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"cu_seq_lens_q: expected increasing offsets from 0 to {length} over a batch of 1, "
                             f"got {cuts} for a batch of {batch}")
        return [Segment(a, e, 0) for a, e in zip(cuts, cuts[1:])]
    row = pos[b]  # flash attention's rule: a sequence starts where its position is 0
    starts = [t for t in range(length) if t == 0 or row[t] == 0]
    return [Segment(a, e, 0) for a, e in zip(starts, starts[1:] + [length])]


def _offsets(pos: List[List[int]], plans: List[List[Segment]], past: int, cache_padding: Optional[Sequence[int]],
             reals: Optional[List[List[bool]]]) -> List[int]:
    """the position of each sequence's first real token, from which position_ids must run on
    by one (per batch row for the ordinary call, per segment when packed); ValueError naming
    the first row where they do not, or a negative one"""
    out = []
    for b, segments in enumerate(plans):
        for seg in segments:
            first_real = seg.start + seg.padding
            offset = None
            for t in range(first_real, seg.end):
                if reals is not None and not reals[b][t]:
                    continue  # a padding row: its position is not used
                ours = (past + t - (cache_padding[b] if cache_padding is not None else first_real)
                        if len(segments) == 1 else t - first_real)
                if offset is None:
                    offset = pos[b][t] - ours
                elif pos[b][t] - ours != offset:
                    raise ValueError(
                        f"position_ids: token {t} of batch row {b} is at position {pos[b][t]}, expected "
                        f"{ours + offset} (the sequence's positions run on from {first_real}); "
                        + ("restarting positions are packed sequences, which transformers separates only "
                           "without a cache (use_cache=False) or under flash attention: with this mask they would "
                           "attend to each other" if pos[b][t] < ours + offset else
                           "the C layer counts positions from the sequence's first real token"))
            if offset is not None and offset < 0:
                raise ValueError(f"position_ids: batch row {b} puts its first real token (token {first_real}) at "
                                 f"position {offset}: the C layer takes positions from 0 on")
            out.append(offset or 0)
    return out


class _PlanMemo:
    """the last call's plan, with what it was made of: (mask, position_ids, cu_seq_lens_q,
    cache_position) as weak references, their stamps (_stamp) and the call's key"""
    __slots__ = ("refs", "stamps", "key", "plan")

    def __init__(self) -> None:
        self.refs: tuple = (_no_tensor,) * 4
        self.stamps: Any = None
        self.key: Any = None
        self.plan: Any = None


def _no_tensor() -> None:
    """the memo's reference for an argument that was None (called like a weak reference)"""
    return None


def _stamp(t: Any, call: Any) -> Any:
    """what tells an in-place change of a memo's tensor: its version counter; an inference
    tensor has none (torch.inference_mode), so its plan holds within one model call only
    (`call`, which tells it; None: unknown, the plan is made anew)"""
    if t is None:
        return None
    if t.is_inference():
        return call if call is not None else object()
    return t._version


_PLAN_MEMO = _PlanMemo()  # the next layers of a model call get the same mask


def planned(mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], batch: int, length: int, past: int,
            cache_padding: Optional[Sequence[int]], attn_implementation: Optional[str],
            cu_seq_lens: Optional[torch.Tensor], cache_position: Optional[torch.Tensor], call: Any = None,
            cache_hidden: Optional[Sequence[Sequence[int]]] = None) -> CallPlan:
    """plan_call's plan, made once for the layers of a model call (each gets the same mask):
    the last one made is kept, with weak references to the tensors it was made of (a finished
    generation's mask is not kept alive) and their stamps (an in-place change makes it anew);
    call: an object that is the same for the layers of one model call (or None)"""
    key = (batch, length, past, cache_padding, cache_hidden, attn_implementation)
    stamps = (_stamp(mask, call), _stamp(position_ids, call), _stamp(cu_seq_lens, call), _stamp(cache_position, call))
    memo = _PLAN_MEMO
    refs = memo.refs
    if memo.key == key and memo.stamps == stamps and refs[0]() is mask and refs[1]() is position_ids and \
            refs[2]() is cu_seq_lens and refs[3]() is cache_position:
        return memo.plan
    plan = plan_call(mask, position_ids, batch, length, past, cache_padding, attn_implementation, cu_seq_lens,
                     cache_position, cache_hidden)
    memo.refs = tuple(_no_tensor if t is None else weakref.ref(t) for t in (mask, position_ids, cu_seq_lens,
                                                                          cache_position))
    memo.key, memo.stamps, memo.plan = key, stamps, plan
    return plan
