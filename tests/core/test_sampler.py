"""The batched sampler against transformers' logits processors on the same logits, and
the distribution of its random rows over many seeded draws."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vframe.core.sample.batch_state import RequestSamplingState, SamplingBatch
from vframe.core.sample.metadata import SamplingMetadata
from vframe.core.sample.sampler import (
    DefaultSampler,
    apply_min_p,
    apply_token_bitmask,
    apply_top_k_top_p,
    process_logits,
)
from vframe.core.sampling_params import SamplingParams

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


@pytest.mark.parametrize(
    ("temperature", "kept_ids"),
    [
        # probabilities at T=1: 0.40 0.25 0.15 0.09 0.06 0.05; min_p=0.2 keeps p >= 0.08
        (1.0, [0, 1, 2, 3]),
        # min_p applies after temperature: at T=0.5 (p ~ p1**2: 0.62 0.24 0.09 0.03 ...)
        # the threshold is 0.12
        (0.5, [0, 1]),
    ],
)
def test_min_p_filters_random_rows(temperature, kept_ids):
    row = [math.log(p) for p in [0.40, 0.25, 0.15, 0.09, 0.06, 0.05]]
    counts = draw_counts(row, temperature, min_p=torch.full((NUM_DRAWS,), 0.2))
    assert [i for i, c in enumerate(counts) if c > 0] == kept_ids, counts
    tempered = softmax(row, temperature)
    renormalized = [tempered[i] / sum(tempered[j] for j in kept_ids) if i in kept_ids else 0.0 for i in range(len(row))]
    assert within_5_sigma(counts, renormalized), counts


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


def test_greedy_rows_take_the_argmax_alone_and_beside_random_rows(logits):
    sampler = DefaultSampler()
    out = sampler(logits, metadata([0.0, 0.0, 0.0, 0.0]))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    mixed = sampler(logits, metadata([0.0, 1.0, 0.0, 1.0], seeds=[None, 1, None, 2])).sampled_token_ids
    assert mixed[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


# --------------------------------------------------------------------------- #
# The distribution of random rows, from many seeded draws
# --------------------------------------------------------------------------- #

ROW = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
NUM_DRAWS = 20_000


def draw_counts(row: list[float], temperature: float, **kw) -> list[int]:
    """How often each token of ``row`` is drawn in NUM_DRAWS rows of one step, row
    ``i`` seeded with ``i``: deterministic, and the draws are independent."""
    md = metadata([temperature] * NUM_DRAWS, seeds=list(range(NUM_DRAWS)), **kw)
    sampled = DefaultSampler()(torch.tensor([row]).expand(NUM_DRAWS, -1), md).sampled_token_ids
    return torch.bincount(sampled, minlength=len(row)).tolist()


def softmax(row: list[float], temperature: float) -> list[float]:
    """Written out in float64, independently of the sampler's torch code."""
    weights = [math.exp((x - max(row)) / temperature) for x in row]
    return [w / sum(weights) for w in weights]


def within_5_sigma(counts: list[int], probs: list[float]) -> bool:
    """Every frequency within 5 binomial standard deviations sqrt(p (1 - p) / n) of
    its probability (plus one draw for rounding): for NUM_DRAWS = 20000 and p = 0.5,
    +-0.018."""
    n = sum(counts)
    return all(abs(c / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1 / n for c, p in zip(counts, probs))


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_random_rows_follow_softmax_of_logits_over_temperature(temperature):
    counts = draw_counts(ROW, temperature)
    assert within_5_sigma(counts, softmax(ROW, temperature)), counts
    if temperature != 1.0:
        # The bound has the power to see a temperature that was not applied.
        assert not within_5_sigma(counts, softmax(ROW, 1.0))


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


# --------------------------------------------------------------------------- #
# Per-request rewrites, through the runner's batch state, against transformers
# --------------------------------------------------------------------------- #

CPU = torch.device("cpu")
EOS = 2


class WordTokenizer:
    """Bad words in these tests: each character is a token id (a -> 10, b -> 11 ...)."""

    def encode(self, text, add_special_tokens=False):
        return ([5] if text.startswith(" ") else []) + [10 + ord(c) - ord("a") for c in text.strip()]


def states_for(rows: list[tuple[SamplingParams, list[int], list[int]]]) -> list[RequestSamplingState]:
    """(params, prompt ids, output ids) per row, as the runner holds them."""
    states = []
    for params, prompt, output in rows:
        params.update_from_tokenizer({EOS}, WordTokenizer())
        states.append(RequestSamplingState(params, prompt + output, len(prompt), CPU))
    return states


def processed(logits: torch.Tensor, rows) -> torch.Tensor:
    states = states_for(rows)
    md = SamplingBatch(CPU).metadata(states, logits.shape[-1])
    return process_logits(logits.clone(), md)


def same_distribution(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.allclose(a.softmax(-1), b.softmax(-1), atol=1e-6)


PROMPT = [7, 8, 9, 9, 40]
OUTPUT = [40, 41, 41, 41, 3]


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_over_prompt_and_output_matches_transformers(logits, penalty):
    ours = processed(logits[:1], [(SamplingParams(repetition_penalty=penalty), PROMPT, OUTPUT)])
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUT]), logits[:1].clone())
    assert torch.allclose(ours, ref)


def test_presence_and_frequency_penalties_follow_vllm():
    # vLLM / OpenAI: logit -= frequency * count + presence * (count > 0), over the output only.
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = processed(logits, [(params, [0, 0, 5], [1, 3, 3, 3])])
    # token 0 and 5 only in the prompt: untouched; 1 once: -0.25-0.5; 3 three times: -0.75-0.5
    assert ours.tolist() == [[1.0, 2.0 - 0.75, 3.0, 4.0 - 1.25, 5.0, 6.0]]


def test_penalty_counts_follow_sampled_tokens_and_rows_keep_their_own(logits):
    batch = SamplingBatch(CPU)
    states = states_for(
        [
            (SamplingParams(temperature=0.0), PROMPT, []),
            (SamplingParams(frequency_penalty=1.0), PROMPT, [40]),
            (SamplingParams(repetition_penalty=1.5, presence_penalty=-0.5), [1, 2], [3]),
        ]
    )
    batch.metadata(states, V)  # gives the penalty rows
    batch.record_sampled(states, [11, 40, 11])  # counts now: row1 {40: 2}, row2 {3: 1, 11: 1}
    md = batch.metadata(states, V)
    ours = process_logits(logits[:3].clone(), md)
    assert torch.equal(ours[0], logits[0])
    expected1 = logits[1].clone()
    expected1[40] -= 2.0
    assert torch.allclose(ours[1], expected1)
    ref2 = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[1, 2, 3, 11]]), logits[2:3].clone())[0]
    ref2[[3, 11]] += 0.5
    assert torch.allclose(ours[2], ref2)


def test_logit_bias_matches_transformers_sequence_bias(logits):
    bias = {5: 10.0, 17: -3.5, 999: 1.25}
    ours = processed(logits[:1], [(SamplingParams(logit_bias=bias), PROMPT, OUTPUT)])
    ref = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(torch.tensor([PROMPT]), logits[:1].clone())
    assert torch.allclose(ours, ref)


def test_allowed_token_ids_match_transformers_prefix_constraint(logits):
    allowed = [3, 50, 51, 700]
    ours = processed(logits[:1], [(SamplingParams(allowed_token_ids=allowed), PROMPT, OUTPUT)])
    ref = PrefixConstrainedLogitsProcessor(lambda _b, _ids: allowed, 1)(torch.tensor([PROMPT]), logits[:1].clone())
    assert same_distribution(ours, ref)


def test_bad_words_match_transformers(logits):
    # "ab" is [10, 11] and " ab" [5, 10, 11]; "c" is [12] and " c" [5, 12]. The output
    # ends in 10 (a): "ab" bans 11; " ab" would need [5, 10] at the end; "c" bans 12 always.
    output = [40, 5, 10]
    ours = processed(logits[:1], [(SamplingParams(bad_words=["ab", "c"]), [], output)])
    ref = NoBadWordsLogitsProcessor([[10, 11], [5, 10, 11], [12], [5, 12]])(torch.tensor([output]), logits[:1].clone())
    assert same_distribution(ours, ref)
    assert math.isinf(ours[0, 11]) and math.isinf(ours[0, 12]) and math.isfinite(ours[0, 5])


def test_min_tokens_matches_transformers(logits):
    params = SamplingParams(min_tokens=3, stop_token_ids=[7])
    ours = processed(logits[:1], [(params, PROMPT, [40, 41])])
    ref = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, [EOS, 7])(torch.tensor([PROMPT + [40, 41]]), logits[:1].clone())
    assert same_distribution(ours, ref)
    after = processed(logits[:1], [(SamplingParams(min_tokens=3, stop_token_ids=[7]), PROMPT, [40, 41, 42])])
    assert torch.equal(after, logits[:1])


def test_token_bitmask_keeps_exactly_the_set_bits():
    logits = torch.zeros(2, 70)
    bitmask = torch.full((2, 3), -1, dtype=torch.int32)
    bitmask[1] = torch.tensor([0b101, 0, -(1 << 31) | 1], dtype=torch.int32)  # tokens 0, 2, 64, 95 (past V)
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2, 64]


def test_plain_batch_builds_no_extras():
    md = SamplingBatch(CPU).metadata(
        states_for([(SamplingParams(temperature=0.0), PROMPT, []), (SamplingParams(top_k=5, seed=1), PROMPT, [])]), V
    )
    assert not md.needs_processing and md.penalties is None and md.token_bitmask is None


def test_mixed_batch_rows_equal_each_row_alone(logits):
    """Greedy, seeded top-k/top-p, penalties and bias in one step: each row samples
    what it samples alone."""

    def rows():
        return [
            (SamplingParams(temperature=0.0, repetition_penalty=1.2), PROMPT, OUTPUT),
            (SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=11), PROMPT, []),
            (SamplingParams(temperature=1.1, seed=12, frequency_penalty=0.7, logit_bias={3: 2.0}), PROMPT, OUTPUT),
            (SamplingParams(temperature=0.8, seed=13, min_p=0.2, allowed_token_ids=[4, 9, 600]), PROMPT, []),
        ]

    sampler = DefaultSampler()
    batch_states = states_for(rows())
    together = sampler(logits, SamplingBatch(CPU).metadata(batch_states, V)).sampled_token_ids.tolist()
    alone = []
    for i, row in enumerate(rows()):
        md = SamplingBatch(CPU).metadata(states_for([row]), V)
        alone.append(sampler(logits[i : i + 1], md).sampled_token_ids.item())
    assert together == alone
