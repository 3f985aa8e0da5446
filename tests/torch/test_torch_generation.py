"""qwen3layer.torch under transformers' generation strategies that operate on the model's
cache (beam search, prompt-lookup and assisted decoding, a deepcopy-branched prefix cache,
sampling): the C caches mirror each operation, so a patched model generates what the
transformers model generates. Weights large enough that the strategies' choices matter."""
import copy

import pytest
import torch
from transformers import DynamicCache

import qwen3layer.torch as q3t
from hf_reference import left_padded, tiny_model


def both(model_seed, run):
    """run(model) on the transformers model, then on the same model patched"""
    model = tiny_model(model_seed)
    ref = run(model)
    q3t.patch_model(model)
    return ref, run(model)


@pytest.fixture
def permutations(monkeypatch):
    """counts the reorders that moved beams (an index that is not 0, 1, 2, ...)"""
    seen = []
    original = DynamicCache.reorder_cache

    def recording(self, beam_idx):
        seen.append(not torch.equal(beam_idx.cpu(), torch.arange(len(beam_idx))))
        return original(self, beam_idx)

    monkeypatch.setattr(DynamicCache, "reorder_cache", recording)
    return seen


@pytest.fixture
def crops(monkeypatch):
    """counts the crops that removed tokens (rejected guesses)"""
    seen = []
    original = DynamicCache.crop

    def recording(self, *args, **kwargs):
        before = self.get_seq_length()
        original(self, *args, **kwargs)
        seen.append(self.get_seq_length() < before)

    monkeypatch.setattr(DynamicCache, "crop", recording)
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_search_matches_transformers(seed, permutations):
    ids, mask = left_padded([5, 8], 8, seed=seed)

    def run(model):
        return model.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=5, num_return_sequences=2,
                              do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)

    ref, out = both(seed, run)
    assert any(permutations)  # beams overtook each other: the C caches had to follow
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)


def test_prompt_lookup_decoding_matches_transformers(crops):
    ids = torch.randint(1, 101, (1, 12), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([ids, ids[:, 2:9]], dim=1)  # repeats, so that guesses are made (and some rejected)

    def run(model):
        # an eos_token_id: 4.57's prompt lookup needs one
        return model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=0,
                              prompt_lookup_num_tokens=3)

    ref, out = both(3, run)
    assert any(crops)
    assert torch.equal(out, ref)


def test_assisted_decoding_with_a_draft_model_matches_transformers(crops):
    ids = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(4))
    draft = tiny_model(5)  # another model: its guesses are often rejected, and the cache cropped

    def run(model):
        return model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, assistant_model=draft)

    ref, out = both(4, run)
    assert any(crops)
    assert torch.equal(out, ref)


@pytest.mark.filterwarnings("ignore:.past_key_values. is deprecated:FutureWarning")  # 5.x's new name: `cache`
def test_two_continuations_from_a_deepcopied_prefix_cache():
    prefix = torch.randint(1, 101, (1, 8), generator=torch.Generator().manual_seed(6))
    tails = [torch.randint(1, 101, (1, 3), generator=torch.Generator().manual_seed(7 + i)) for i in range(2)]

    def run(model):
        cache = DynamicCache()
        with torch.no_grad():
            model(prefix, past_key_values=cache, use_cache=True)
        outs = []
        for tail in tails:  # each continuation from its own copy of the prefix's cache
            branch = copy.deepcopy(cache)
            outs.append(model.generate(torch.cat([prefix, tail], dim=1), past_key_values=branch, max_new_tokens=10,
                                       do_sample=False, pad_token_id=0))
        return outs

    ref, out = both(6, run)
    assert not torch.equal(ref[0][:, 11:], ref[1][:, 11:])
    for r, o in zip(ref, out):
        assert torch.equal(o, r)


def test_sampling_with_a_seed_matches_transformers():
    ids, mask = left_padded([4, 7], 7, seed=8)

    def run(model):
        torch.manual_seed(0)
        return model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20,
                              num_return_sequences=2, pad_token_id=0)

    ref, out = both(8, run)
    assert torch.equal(out, ref)


def test_offloading_a_mirrored_cache_layer_is_refused():
    model = q3t.patch_model(tiny_model(9))
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.randint(1, 101, (1, 4)), past_key_values=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="offload of a cache layer cannot be mirrored"):
        cache.layers[0].offload()


def holed_prompts(seed):
    """three prompts of 8 tokens: right padding, a hole, a run of holes after the first token"""
    ids = torch.randint(1, 101, (3, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, 5:], mask[1, 2], mask[2, 1:4] = 0, 0, 0
    return ids, mask


@pytest.mark.parametrize("strategy", ["greedy", "beam", "static"])
def test_prompts_with_holes_and_right_padding_generate_transformers_tokens(strategy, permutations):
    """the masks the drop-in once refused (issue 42): their hidden tokens are the C caches'
    hidden keys, carried through beam search's reorders and a static cache's calls"""
    ids, mask = holed_prompts(seed=4)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    if strategy == "beam":
        kw.update(num_beams=3, num_return_sequences=2)
    elif strategy == "static":
        kw.update(cache_implementation="static")

    ref, out = both(4, lambda model: model.generate(ids, attention_mask=mask, **kw))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if strategy == "beam":
        assert any(permutations)
