"""The batched sampler against transformers' logits warpers on the same logits."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vframe.core.sample.metadata import SamplingMetadata
from vframe.core.sample.sampler import DefaultSampler, apply_min_p, apply_top_k_top_p

V = 1000


@pytest.fixture
def logits():
    return torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 3


def kept(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


@pytest.mark.parametrize("k", [1, 5, 50])
def test_top_k_matches_transformers(logits, k):
    ours = apply_top_k_top_p(logits, torch.full((4,), k), None)
    ref = TopKLogitsWarper(top_k=k)(None, logits.clone())
    assert torch.equal(kept(ours), kept(ref))
    assert torch.equal(ours[kept(ours)], logits[kept(ours)])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_matches_transformers(logits, p):
    ours = apply_top_k_top_p(logits, None, torch.full((4,), p))
    ref = TopPLogitsWarper(top_p=p)(None, logits.clone())
    assert torch.equal(kept(ours), kept(ref))


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_matches_transformers(logits, min_p):
    ours = apply_min_p(logits, torch.full((4,), min_p))
    ref = MinPLogitsWarper(min_p=min_p)(None, logits.clone())
    assert torch.equal(kept(ours), kept(ref))


def test_rows_keep_their_own_parameters(logits):
    top_k = torch.tensor([0, 3, 0, 10])
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9])
    ours = apply_top_k_top_p(logits, top_k, top_p)
    assert kept(ours[0]).all()
    assert kept(ours[1]).sum() == 3
    ref2 = TopPLogitsWarper(top_p=0.5)(None, logits[2:3].clone())
    assert torch.equal(kept(ours[2:3]), kept(ref2))
    ref3 = TopPLogitsWarper(top_p=0.9)(None, TopKLogitsWarper(10)(None, logits[3:4].clone()))
    assert torch.equal(kept(ours[3:4]), kept(ref3))


def metadata(temps, seeds=None, **kw):
    temps_t = torch.tensor(temps, dtype=torch.float32)
    greedy = temps_t == 0
    gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds or []) if s is not None}
    return SamplingMetadata(
        temperature=torch.where(greedy, torch.ones_like(temps_t), temps_t),
        greedy_mask=greedy,
        all_greedy=bool(greedy.all()),
        generators=gens,
        **kw,
    )


def test_greedy_rows_take_the_argmax_and_random_rows_follow_the_distribution(logits):
    sampler = DefaultSampler()
    out = sampler(logits, metadata([0.0, 0.0, 0.0, 0.0]))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    # a peaked row sampled 2000 times: frequencies follow softmax(logits / T)
    row = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    counts = torch.zeros(4)
    for _ in range(2000):
        counts[sampler(row, metadata([1.0])).sampled_token_ids[0]] += 1
    expected = TemperatureLogitsWarper(1.0)(None, row).softmax(-1)[0]
    assert torch.allclose(counts / 2000, expected, atol=0.04)


def test_seeded_row_is_independent_of_the_rest_of_the_batch(logits):
    sampler = DefaultSampler()
    alone = [sampler(logits[1:2], metadata([0.9], seeds=[s])).sampled_token_ids.item() for s in range(20)]
    batched = [
        sampler(logits, metadata([0.0, 0.9, 1.2, 0.7], seeds=[None, s, None, 3])).sampled_token_ids[1].item()
        for s in range(20)
    ]
    assert alone == batched
    assert len(set(alone)) > 1  # different seeds differ


def test_logprobs_report_chosen_token_then_top_k_with_ranks(logits):
    out = DefaultSampler()(logits, metadata([0.0] * 4, max_num_logprobs=3))
    ref = torch.log_softmax(logits, -1)
    top = ref.topk(3, dim=-1)
    assert out.logprob_token_ids.shape == (4, 4)
    assert torch.equal(out.logprob_token_ids[:, 0], logits.argmax(-1))
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    assert out.sampled_ranks.tolist() == [1, 1, 1, 1]


def test_banned_tokens_are_never_chosen(logits):
    top = logits.argmax(-1).tolist()
    md = metadata([0.0] * 4, banned_token_ids=[(0, [top[0]]), (2, [top[2]])])
    out = DefaultSampler()(logits, md).sampled_token_ids.tolist()
    assert out[0] != top[0] and out[2] != top[2]
    assert out[1] == top[1] and out[3] == top[3]
