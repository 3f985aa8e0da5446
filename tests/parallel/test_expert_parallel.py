"""ExpertParallelLayer over 2 and 3 gloo processes (3 makes 16 experts % 3 != 0: uneven
shards) against the single-process DecoderLayer of the same seed: prefill of ragged lengths
chunked differently per rank, a rank with no tokens, a left-padded batch and decode steps, the
caches equal; a placement where one rank's experts get no token; the mismatched call, a failed
check and a failure inside one rank's experts raised on every rank. The checks run in the
ranks (tests/helpers/ep_worker.py); a rank that fails fails the spawn with its traceback."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))
import ep_worker  # noqa: E402

dist = pytest.importorskip("torch.distributed")


def spawn(world, tmp_path, placement_kind):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with gloo is needed (the CPU wheel has it)")
    problem = ep_worker.spawn_ranks(world, str(tmp_path / "rendezvous"), placement_kind)
    if problem:
        pytest.fail(problem)


@pytest.mark.parametrize("world,placement_kind", [(2, "contiguous"), (3, "contiguous"), (2, "one_rank_gets_nothing"),
                                                   (3, "strided")])
def test_expert_parallel_layer_equals_the_single_process_layer(world, placement_kind, tmp_path):
    spawn(world, tmp_path, placement_kind)


def test_each_rank_maps_only_its_experts_of_a_checkpoint(tmp_path):
    """2 ranks over a transformers checkpoint (per-expert tensors in small shards): each maps
    the attention and its experts' bytes only, and runs as the single-process layer"""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    a = ep_worker.CFG_ARGS
    cfg = Qwen3MoeConfig(vocab_size=16, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=256,
                         rms_norm_eps=1e-6, **a)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="200KB")
    spawn(2, tmp_path, "checkpoint:" + str(tmp_path / "ckpt"))


def test_each_rank_maps_only_its_experts_of_a_gptq_checkpoint(tmp_path):
    """the same over a 4-bit GPTQ checkpoint (qwen3layer's writer: RTN, group 16, small
    shards): each rank maps its experts' qweight, qzeros, scales and g_idx only, and runs as
    the single-process gptq_int4 layer"""
    import qwen3layer as q3
    from qwen3layer.checkpoint.writer import GPTQ_CONFIG, write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "ckpt", q3.LayerConfig(**ep_worker.CFG_ARGS), seed=3, dtype="float32",
                                   weight_format="gptq_int4", quantization_config=GPTQ_CONFIG | {"group_size": 16},
                                   shard_bytes=20_000)
    assert q3.DecoderLayer.from_checkpoint(path, 0).weight_format == "gptq_int4"
    spawn(2, tmp_path, "checkpoint:" + path)


def test_patch_model_over_two_ranks_generates_as_the_unpatched_model(tmp_path):
    """patch_model(ep_group=WORLD) on 2 gloo ranks, each its own prompts: greedy generate
    equal to the unpatched model's on each rank, one rank ending first (synced_gpus); the
    logits and router logits; a call one rank refuses, named on the other; a timeout that
    says why (tests/helpers/ep_dropin_worker.py)"""
    pytest.importorskip("transformers")
    spawn(2, tmp_path, "dropin")


def test_contiguous_placement_gives_the_first_ranks_the_extra_experts():
    from qwen3layer.parallel import contiguous_placement
    assert contiguous_placement(16, 3) == [list(range(0, 6)), list(range(6, 11)), list(range(11, 16))]
    assert contiguous_placement(2, 3) == [[0], [1], []]
    with pytest.raises(ValueError, match="world: expected at least 1 rank, got 0"):
        contiguous_placement(4, 0)


@pytest.mark.parametrize("placement,match", [
    ([[0, 1], [2]], r"experts \[3\] are on no rank"),
    ([[0, 1], [1, 2, 3]], "expert 1 placed on ranks 0 and 1"),
    ([[0, 1, 2, 3]], "for each of the 2 ranks, got 1 lists"),
    ([[0, 1], [2, 4]], r"placement\[1\]: expected expert ids in \[0, 4\), got 4"),
])
def test_a_bad_placement_is_refused_naming_it(placement, match):
    from qwen3layer.placement import check_placement as _check_placement
    with pytest.raises(ValueError, match=match):
        _check_placement(placement, 4, 2)


def test_without_a_process_group_the_layer_says_so():
    import qwen3layer as q3
    from qwen3layer.parallel import ExpertParallelLayer
    assert not dist.is_initialized()  # the ranks' groups live in their own processes
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ExpertParallelLayer.random(q3.LayerConfig.tiny(), seed=0)
