"""One rank of the expert-parallel drop-in test (tests/parallel/test_expert_parallel.py):
every rank builds the same small Qwen3MoeForCausalLM (the same seed), runs its own prompts
through it unpatched (the reference, no collective), then patches it with
patch_model(ep_group=WORLD) and runs them again, each layer's experts split over the ranks.
Rank 0 generates for a left-padded batch of 2 to the end; rank 1 for one prompt whose end of
sequence comes at its third new token, so it stops first and keeps stepping (synced_gpus, the
patched generate's default) while rank 0 generates. Then a forward with the router's logits,
beam search and a static cache's generation (each as the unpatched model's),
a forward under a mask with holes and a generation from a right-padded prompt (issue 42's
hidden keys, each rank's own), a call one rank's checks refuse (named on the other), and a
group whose other rank never calls (the timeout's message says why)."""
import datetime
import os
import time

import torch
import torch.distributed as dist

from ep_worker import CFG_ARGS, _expect

NEW_TOKENS = 6


def _model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=None, eos_token_id=None, **CFG_ARGS)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # attention of normal(0, 0.15) scale: a wrong mask or position shows
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0.0, 0.15)
    return model


def _prompts(rank):
    """rank 0: two prompts of 7 and 4 tokens, left-padded; rank 1: one of 5"""
    g = torch.Generator().manual_seed(40 + rank)
    if rank == 0:
        ids = torch.randint(1, 64, (2, 7), generator=g)
        mask = torch.ones(2, 7, dtype=torch.long)
        ids[1, :3], mask[1, :3] = 0, 0
        return ids, mask
    return torch.randint(1, 64, (1, 5), generator=g), torch.ones(1, 5, dtype=torch.long)


def _generate(model, ids, mask, eos, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          eos_token_id=eos, **kw)


def run(rank, world, init_file):
    from qwen3layer.torch import patch_model, unpatch_model

    model = _model()
    ids, mask = _prompts(rank)
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with torch.no_grad():
        whole = _generate(model, ids, mask, None)
        steps = calls[0]  # the model calls of a generation to the end
        eos = int(whole[0, ids.shape[1] + 2]) if rank == 1 else None  # rank 1 ends at its third new token
        want = _generate(model, ids, mask, eos) if eos is not None else whole
        ref = model(ids, attention_mask=mask, output_router_logits=True)
        holes = mask.clone()
        holes[:, -3] = 0  # a hole in each row: hidden keys in the C cache (issue 42), each rank its own
        holed = model(ids, attention_mask=holes).logits
        right_padded = torch.cat([mask, torch.zeros_like(mask[:, :1])], 1)[:, 1:]  # the last prompt token masked
        right = _generate(model, ids, right_padded, None)
        beams = _generate(model, ids, mask, None, num_beams=2)
        static = _generate(model, ids, mask, None, cache_implementation="static")
    if rank == 1:
        assert want.shape[1] < whole.shape[1], (want.shape, whole.shape)  # it does stop first

    patch_model(model, ep_group=dist.group.WORLD)
    layer = model.model.layers[0]
    assert layer.expert_parallel and layer.core.world == world
    with torch.no_grad():
        calls[0] = 0
        got = _generate(model, ids, mask, eos)
        assert torch.equal(got, want), (rank, got.tolist(), want.tolist())
        assert calls[0] == steps, (calls[0], steps)  # rank 1 stepped on after its end, as rank 0 generated
        out = model(ids, attention_mask=mask, output_router_logits=True)
        # beam search (the caches reordered each step) and a static cache, as the unpatched model
        assert torch.equal(_generate(model, ids, mask, None, num_beams=2), beams)
        assert torch.equal(_generate(model, ids, mask, None, cache_implementation="static"), static)
        got_holed = model(ids, attention_mask=holes).logits
        # a prompt whose mask ends in right padding, continued by generate: the hidden keys carried on
        assert torch.equal(_generate(model, ids, right_padded, None), right)
    seen = holes.bool()
    err = (got_holed - holed)[seen].abs().max().item()
    assert err <= 1e-4 * max(1.0, holed.abs().max().item()), f"logits under a mask with holes off by {err}"
    real = mask.bool()
    err = (out.logits - ref.logits)[real].abs().max().item()
    assert err <= 1e-4 * max(1.0, ref.logits.abs().max().item()), f"logits off by {err}"
    for mine, theirs in zip(out.router_logits, ref.router_logits):  # [batch * tokens, experts] a layer
        assert torch.allclose(mine[real.flatten()], theirs[real.flatten()], rtol=1e-4, atol=1e-4)

    # a call rank 0's own checks refuse (packed sequences): refused there, named on rank 1, none waits
    with torch.no_grad():
        if rank == 0:
            packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
            _expect(lambda: model(ids[:1], position_ids=packed, use_cache=False), NotImplementedError,
                    "packed sequences")
        else:
            _expect(lambda: model(ids, attention_mask=mask, use_cache=False), RuntimeError,
                    "rank 0's prefill call failed its checks", "packed sequences")
        again = model(ids, attention_mask=mask).logits  # the group in step again
    assert torch.allclose(again[real], out.logits[real], rtol=0, atol=0)
    unpatch_model(model)
    assert "generate" not in model.__dict__

    # a group in which rank 1 never calls: rank 0's call times out, and says why
    quick = dist.new_group(timeout=datetime.timedelta(seconds=3))
    from qwen3layer.parallel import ExpertParallelLayer
    import qwen3layer as q3
    ep = ExpertParallelLayer.random(q3.LayerConfig(**CFG_ARGS), 0, "float32", group=quick)
    flag = init_file + ".rank0-timed-out"
    if rank == 0:
        t0 = time.monotonic()
        _expect(lambda: ep.prefill(torch.zeros(2, CFG_ARGS["hidden_size"]), ep.new_cache(4)), RuntimeError,
                "found no partner", "synced_gpus=True")
        assert time.monotonic() - t0 < 30
        open(flag, "w").close()
    else:
        while not os.path.exists(flag):  # no collective meanwhile: rank 0 is in the quick group's
            time.sleep(0.05)
