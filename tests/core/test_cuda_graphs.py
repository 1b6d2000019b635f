"""CUDA graphs of decode steps (vframe/core/worker/cuda_graphs.py).

On the CPU nothing is captured, but ``DecodeGraphs.run`` without ``capture()`` runs the
same padded step over the same static buffers and metadata eagerly: the Triton kernels
under Triton's interpreter check the padding, the scratch block and the buffers'
reuse against plain eager steps. The ``gpu`` test captures and replays for real.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from vframe.core.config import EngineConfig
from vframe.core.interfaces import CommonAttentionMetadata
from vframe.core.worker.cuda_graphs import DEFAULT_CAPTURE_SIZES, DecodeGraphs, capture_sizes

BLOCK_SIZE = 16
NUM_BLOCKS = 12  # the scheduler's; the cache holds one more, the scratch block
SCRATCH = NUM_BLOCKS
# Three requests' blocks, in no order; blocks 1, 3, 5, 6, 8, 10 stay NaN.
BLOCKS = [[7], [2, 9], [4, 0, 11]]
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 27)), [(7 * i) % 120 + 1 for i in range(33)]]


def test_default_capture_sizes_stop_at_max_num_seqs_and_hold_it() -> None:
    assert capture_sizes(256) == [s for s in DEFAULT_CAPTURE_SIZES if s <= 256]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    assert capture_sizes(1) == [1]
    assert capture_sizes(4096) == list(DEFAULT_CAPTURE_SIZES)  # larger steps run eagerly


def test_configured_capture_sizes() -> None:
    assert capture_sizes(256, [64, 8, 8, 512, 1]) == [1, 8, 64]
    assert capture_sizes(256, max_size=48) == [1, 2, 4, 8, 16, 24, 32, 48]
    assert capture_sizes(256, []) == []

    def options(compilation_config: object) -> dict:
        return EngineConfig.from_sources(compilation_config=compilation_config).device.cuda_graph_options()

    assert options(None) == {}
    assert options({"cudagraph_capture_sizes": [1, 2]}) == {"cudagraph_capture_sizes": [1, 2]}
    assert options({"cudagraph_mode": "NONE"}) == {"cudagraph_capture_sizes": []}
    assert options({"max_cudagraph_capture_size": 0}) == {"cudagraph_capture_sizes": [], "max_cudagraph_capture_size": 0}
    assert options({"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 64}) == {
        "max_cudagraph_capture_size": 64
    }


def _common(
    context_lens: list[int], query_lens: list[int], blocks: list[list[int]], device: torch.device
) -> CommonAttentionMetadata:
    query_start_loc, seq_lens, slots = [0], [], []
    for ctx, q, ids in zip(context_lens, query_lens, blocks):
        slots += [ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx, ctx + q)]
        query_start_loc.append(query_start_loc[-1] + q)
        seq_lens.append(ctx + q)
    width = max(map(len, blocks))
    table = [ids + [0] * (width - len(ids)) for ids in blocks]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return CommonAttentionMetadata(
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        context_lens=tensor(context_lens, torch.int32),
        block_table=tensor(table, torch.int32),
        slot_mapping=tensor(slots, torch.int64),
        num_reqs=len(blocks),
        num_actual_tokens=query_start_loc[-1],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def check_decode_graphs(model_dir: str, device: torch.device, capture: bool, max_model_len: int) -> None:
    """Prefill three prompts eagerly, then decode steps of 3, 2 and 1 requests through
    ``DecodeGraphs`` (sizes 1 and 4: padding of 1 and 2 rows, then none) and, on a copy of
    the cache, eagerly: the same hidden states and tokens, the same cache outside the
    scratch block."""
    from vframe.backends.triton.backend import TritonAttentionBackend, TritonAttentionMetadataBuilder
    from vframe.models.llama import LlamaForCausalLM
    from vframe.models.loader import resolve_model
    from vframe.models.loader.load import load_model

    model = load_model(resolve_model(model_dir), LlamaForCausalLM, TritonAttentionBackend, torch.float32, device)
    specs = model.get_kv_cache_specs(BLOCK_SIZE, torch.float32)
    # NaN everywhere: a kernel that reads a slot nobody wrote (padding included) shows it.
    caches = [
        torch.full(TritonAttentionBackend.get_kv_cache_shape_for_spec(s, NUM_BLOCKS + 1), float("nan"), device=device)
        for s in specs
    ]
    builder = TritonAttentionMetadataBuilder(None, device)
    graphs = DecodeGraphs(
        model, builder, caches, sizes=[1, 4], max_model_len=max_model_len, block_size=BLOCK_SIZE,
        scratch_block=SCRATCH, device=device,
    )  # fmt: skip
    graphs.build_metadata()
    if capture:
        graphs.capture()
        assert sorted(graphs.graphs) == [1, 4]

    def eager(ids: list[int], positions: list[int], common: CommonAttentionMetadata, kv: list) -> torch.Tensor:
        return model(
            torch.tensor(ids, device=device), torch.tensor(positions, device=device), kv, builder.build(common)
        )

    with torch.inference_mode():
        hidden = eager(
            sum(PROMPTS, []), [p for prompt in PROMPTS for p in range(len(prompt))],
            _common([0, 0, 0], list(map(len, PROMPTS)), BLOCKS, device), caches,
        )  # fmt: skip
        last = torch.tensor([len(PROMPTS[0]) - 1, len(PROMPTS[0]) + len(PROMPTS[1]) - 1, sum(map(len, PROMPTS)) - 1])
        tokens = model.compute_logits(hidden[last.to(device)]).argmax(-1).tolist()
        lengths = list(map(len, PROMPTS))
        for live in ([0, 1, 2], [0, 2], [1]):
            ids, positions = [tokens[r] for r in live], [lengths[r] for r in live]
            common = _common(positions, [1] * len(live), [BLOCKS[r] for r in live], device)
            reference_caches = [c.clone() for c in caches]
            expected = eager(ids, positions, common, reference_caches)
            out = graphs.run(torch.tensor(ids, device=device), torch.tensor(positions, device=device), common)
            assert out is not None and out.shape[0] == graphs.size_for(len(live))
            # With splits (the graph's keys cut in shares, the eager step's not) layer 0's
            # output, so layer 1's keys and values, round differently.
            tolerance = 1e-5 if capture and max_model_len > 512 else 0.0
            torch.testing.assert_close(out[: len(live)], expected, rtol=tolerance, atol=tolerance)
            step_tokens = model.compute_logits(out[: len(live)]).argmax(-1).tolist()
            assert step_tokens == model.compute_logits(expected).argmax(-1).tolist()
            for ours, theirs in zip(caches, reference_caches):
                # [2, blocks, block_size, KVH, D]: everything but the scratch block as eagerly written
                torch.testing.assert_close(
                    ours[:, :SCRATCH], theirs[:, :SCRATCH], rtol=tolerance, atol=tolerance, equal_nan=True
                )
                if len(live) < 4:  # padding rows wrote there, finite
                    assert torch.isfinite(ours[:, SCRATCH, 0]).all()
            for r, t in zip(live, step_tokens):
                tokens[r], lengths[r] = t, lengths[r] + 1
    assert graphs.size_for(5) is None  # more requests than the largest graph: the runner runs them eagerly


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_padded_decode_steps_over_static_buffers_equal_eager_steps_interpreted(
    interpreted: ModuleType, tiny_llama_dir: str
) -> None:
    check_decode_graphs(tiny_llama_dir, torch.device("cpu"), capture=False, max_model_len=4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("max_model_len", [256, 4096])  # 4096: the graph of 4 rows splits its keys
def test_captured_decode_steps_equal_eager_steps_on_gpu(tiny_llama_dir: str, max_model_len: int) -> None:
    check_decode_graphs(tiny_llama_dir, torch.device("cuda"), capture=True, max_model_len=max_model_len)
