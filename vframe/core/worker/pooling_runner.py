"""The pooling runner: prompts in, one vector per prompt out (``runner="pooling"``).

A pooling request is one prefill and nothing else: no sampling, no decode, no KV
cache to keep. So it does not go through the scheduler: ``encode`` packs the
prompts into batches (at most ``max_num_batched_tokens`` tokens and
``max_num_seqs`` prompts each), runs one forward pass per batch on the model
runner's model and pools each prompt's rows (``vframe/layers/pooler.py``)::

    prompts --batch--> [T] ids, positions 0..n-1 per prompt --model--> [T, E]
            --pool--> [B, E] --normalize / per request--> PoolingRequestOutput

A decoder (``uses_kv_cache``, the default) attends causally through the
configured attention backend; its keys and values go to scratch blocks
``0, 1, ...`` of the KV cache, which no other request uses: an engine with the
pooling runner refuses to generate, so the cache holds nothing else (nor any
prefix-cache entry). An encoder-only model (BERT, ``uses_kv_cache = False``)
gets the batch's ``CommonAttentionMetadata`` and no caches, and attends
bidirectionally over each prompt by itself (``vframe/models/bert.py``).

Engines built with ``runner="pooling"`` run this instead of ``generate``; the
pooling runner lives beside the model runner and uses its model, KV caches and
attention-metadata builder (``TorchModelRunner``'s attributes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from vframe.core.interfaces import CommonAttentionMetadata
from vframe.core.pooling_outputs import PoolingOutput, PoolingRequestOutput
from vframe.core.pooling_params import PoolingParams
from vframe.errors import ConfigError, InvalidRequestError
from vframe.layers.pooler import PoolerConfig, pool, resolve_pooler_config

if TYPE_CHECKING:
    from vframe.core.engine import LLMEngine, PromptType

# vLLM's `task` values that mean the pooling runner; "classify", "score", "reward"
# need heads vframe's models do not have.
_POOLING_TASKS = {"embed", "embedding", "encode"}


def resolve_runner(runner: str, task: str | None, model: Any, architecture: str) -> str:
    """``"generate"`` or ``"pooling"`` from the ``runner`` and ``task`` settings
    and the loaded model, or anything that says its ``uses_kv_cache`` (the engine
    passes its ``RunnerInfo``) (``auto``: pooling for an encoder-only model)."""
    if task not in (None, "auto"):
        if task not in _POOLING_TASKS | {"generate"}:
            raise ConfigError(
                f"task={task!r} is not supported: vframe serves task='generate' and task='embed' "
                "(runner='generate' / runner='pooling'); classification, scoring and reward heads are not built"
            )
        from_task = "generate" if task == "generate" else "pooling"
        if runner not in ("auto", from_task):
            raise ConfigError(f"task={task!r} means runner={from_task!r}, but runner={runner!r}; pass one of them")
        runner = from_task
    encoder_only = not getattr(model, "uses_kv_cache", True)
    if runner == "auto":
        return "pooling" if encoder_only else "generate"
    if runner == "generate" and encoder_only:
        raise ConfigError(
            f"{architecture} is an encoder-only (pooling) model and cannot generate; "
            "use runner='pooling' (LLM.embed / LLM.encode / LLM.score, /v1/embeddings)"
        )
    return runner


class PoolingRunner:
    def __init__(self, engine: LLMEngine) -> None:
        runner = engine.model_runner
        if runner is None:
            raise ConfigError(
                f"runner='pooling' runs the model in the engine's process; with "
                f"tensor_parallel_size={engine.config.parallel.tensor_parallel_size} it runs in workers. "
                "Use tensor_parallel_size=1 for pooling"
            )
        missing = [a for a in ("model", "kv_caches", "attn_metadata_builder", "block_size") if not hasattr(runner, a)]
        if missing:
            raise ConfigError(
                f"runner='pooling' needs the default model runner; {type(runner).__name__} has no {missing}"
            )
        self.engine = engine
        self.runner = runner
        self.model = runner.model
        self.uses_kv_cache = getattr(self.model, "uses_kv_cache", True)
        self.pooler_config: PoolerConfig = resolve_pooler_config(
            runner.resolved.model_dir, self.model, engine.config.model.pooler_config
        )
        hf_config = runner.hf_config
        self.is_matryoshka = bool(
            getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions", None)
        )
        self.num_blocks = engine.kv_cache_manager.num_blocks
        self._request_counter = 0

    # ------------------------------------------------------------------ #

    def encode(
        self, prompts: list[PromptType], params: list[PoolingParams]
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Pool every prompt; outputs come back in prompt order. Bad input raises
        ``InvalidRequestError`` before anything runs."""
        token_ids = [self._prompt_tokens(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for sp in params:
            self._check_params(sp)
        tasks = {sp.task or "embed" for sp in params}
        pooled: list[torch.Tensor | None] = [None] * len(prompts)
        for task in tasks:
            rows = [i for i, sp in enumerate(params) if (sp.task or "embed") == task]
            pooling_type = "ALL" if task == "token_embed" else self.pooler_config.pooling_type
            for batch in self._batches([token_ids[i] for i in rows]):
                vectors = self._run_batch([token_ids[rows[j]] for j in batch], pooling_type)
                for j, vector in zip(batch, vectors):
                    pooled[rows[j]] = vector
        outputs = []
        for ids, sp, vector in zip(token_ids, params, pooled):
            assert vector is not None
            if sp.dimensions is not None:
                vector = vector[..., : sp.dimensions]
            normalize = self.pooler_config.normalize if sp.normalize is None else sp.normalize
            if normalize:
                vector = F.normalize(vector, dim=-1)
            outputs.append(PoolingRequestOutput(self._next_id(), PoolingOutput(vector.cpu()), ids))
        return outputs

    def _next_id(self) -> str:
        self._request_counter += 1
        return f"pool-{self._request_counter - 1}"

    def _prompt_tokens(self, prompt: PromptType, params: PoolingParams) -> list[int]:
        engine = self.engine
        _, ids = engine.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = engine.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        if not ids:
            raise InvalidRequestError("the decoder prompt cannot be empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is out of vocabulary: prompt token ids out of range [0, {engine.vocab_size}): "
                f"{bad[:5]}"
            )
        if len(ids) > engine.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({len(ids)} tokens) is longer than max_model_len={engine.max_model_len}; "
                "shorten it or pass truncate_prompt_tokens"
            )
        if self.uses_kv_cache and math.ceil(len(ids) / self.runner.block_size) > self.num_blocks:
            raise InvalidRequestError(
                f"the prompt ({len(ids)} tokens) does not fit the KV cache "
                f"({self.num_blocks * self.runner.block_size} tokens); raise kv_cache_memory_bytes"
            )
        return ids

    def _check_params(self, params: PoolingParams) -> None:
        if params.dimensions is not None and not self.is_matryoshka:
            raise InvalidRequestError(
                f"dimensions={params.dimensions}: model {self.engine.engine_view.model!r} does not support "
                "Matryoshka representation, changing output dimensions will lead to poor results; leave "
                "dimensions unset"
            )

    def _batches(self, token_ids: list[list[int]]) -> Iterator[list[int]]:
        """Indices of ``token_ids`` in batches within the token budget, the prompt
        count and (for decoders) the KV cache's blocks; a prompt over the token
        budget runs alone."""
        sched = self.engine.config.scheduler
        budget, max_seqs, bs = sched.max_num_batched_tokens, sched.max_num_seqs, self.runner.block_size
        batch: list[int] = []
        tokens = blocks = 0
        for i, ids in enumerate(token_ids):
            need = math.ceil(len(ids) / bs) if self.uses_kv_cache else 0
            if batch and (tokens + len(ids) > budget or len(batch) == max_seqs or blocks + need > self.num_blocks):
                yield batch
                batch, tokens, blocks = [], 0, 0
            batch.append(i)
            tokens += len(ids)
            blocks += need
        if batch:
            yield batch

    @torch.inference_mode()
    def _run_batch(self, token_ids: list[list[int]], pooling_type: str) -> list[torch.Tensor]:
        common = self._metadata(token_ids)
        device = self.runner.device
        input_ids = torch.tensor([t for ids in token_ids for t in ids], device=device)  # [T]
        positions = torch.cat([torch.arange(len(ids)) for ids in token_ids]).to(device)  # [T]
        if self.uses_kv_cache:
            attn_metadata = self.runner.attn_metadata_builder.build(common)
            hidden = self.model(input_ids, positions, self.runner.kv_caches, attn_metadata)  # [T, E]
        else:
            hidden = self.model(input_ids, positions, [], common)  # [T, E]
        return pool(hidden, common.query_start_loc_cpu, pooling_type, normalize=False)

    def _metadata(self, token_ids: list[list[int]]) -> CommonAttentionMetadata:
        """A prefill of every prompt from position 0, prompt ``b`` in scratch blocks
        right after prompt ``b - 1``'s."""
        bs, device = self.runner.block_size, self.runner.device
        seq_lens = np.array([len(ids) for ids in token_ids], np.int64)  # [B]
        query_start_loc = np.zeros(len(seq_lens) + 1, np.int64)
        np.cumsum(seq_lens, out=query_start_loc[1:])
        num_blocks = -(-seq_lens // bs)  # [B]
        first_block = np.concatenate([[0], np.cumsum(num_blocks)[:-1]])
        block_table = np.zeros((len(seq_lens), int(num_blocks.max())), np.int64)  # [B, max_blocks]
        for b, (first, n) in enumerate(zip(first_block, num_blocks)):
            block_table[b, :n] = np.arange(first, first + n)
        req_idx = np.repeat(np.arange(len(seq_lens)), seq_lens)  # [T]
        positions = np.arange(int(query_start_loc[-1])) - query_start_loc[req_idx]
        slot_mapping = block_table[req_idx, positions // bs] * bs + positions % bs  # [T]
        to = lambda a, dt=torch.int32: torch.from_numpy(a).to(device, dt)  # noqa: E731
        return CommonAttentionMetadata(
            query_start_loc=to(query_start_loc),
            seq_lens=to(seq_lens),
            context_lens=to(np.zeros_like(seq_lens)),
            block_table=to(block_table),
            slot_mapping=to(slot_mapping, torch.int64),
            num_reqs=len(seq_lens),
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(seq_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
