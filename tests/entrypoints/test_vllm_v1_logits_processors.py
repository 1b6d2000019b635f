"""vLLM v1's engine-wide batch-level logits processors: ``LLM(logits_processors=[cls])``.

The end-to-end tests run vLLM's ``examples/offline_inference/logits_processor/custom.py``
in its vLLM form, with only the imports (``vllm`` -> ``vframe``) and the model (the
embedded SmolLM2 in float32) changed; lines changed for the test are marked ``# vframe:``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

# --------------------------------------------------------------------------- #
# examples/offline_inference/logits_processor/custom.py (vLLM form)
# --------------------------------------------------------------------------- #
from vframe import LLM, SamplingParams
from vframe.config import VllmConfig
from vframe.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
)
from vframe.v1.sample.logits_processor.builtin import process_dict_updates


# Hypothetical custom logits processor
class DummyLogitsProcessor(LogitsProcessor):
    """Fake logit processor to support unit testing and examples"""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(
            self.req_info,
            batch_update,
            # This function returns the LP's per-request state based on the
            # request details, or None if this LP does not apply to the
            # request.
            lambda params, _, __: params.extra_args and (params.extra_args.get("target_token")),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits

        # Save target values before modification
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
        values_to_keep = logits[rows, cols].clone()

        # Mask all but target tokens
        logits[rows] = float("-inf")
        logits[rows, cols] = values_to_keep

        return logits


# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a mixture of requests which do and don't utilize the dummy logitproc
sampling_params_list = [
    SamplingParams(temperature=0.0, extra_args={"target_token": 128}),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, extra_args={"target_token": 67}),
    SamplingParams(temperature=0.0),
]


@pytest.fixture(scope="module")
def llm_with_dummy():
    # Create an LLM.
    llm = LLM(
        dtype="float32", max_model_len=1024, num_threads=1,  # vframe: model="facebook/opt-125m"
        logits_processors=[DummyLogitsProcessor],
    )
    yield llm
    llm.shutdown()


def test_custom_example_forces_only_the_requests_that_name_a_target(llm_with_dummy, llm_fp32):
    llm = llm_with_dummy
    # Generate texts from the prompts.
    outputs = llm.generate(prompts, sampling_params_list)
    # vframe: the example prints the outputs; here they are checked.
    assert [o.prompt for o in outputs] == prompts
    assert outputs[0].outputs[0].token_ids == [128] * 16  # SamplingParams' default max_tokens
    assert outputs[2].outputs[0].token_ids == [67] * 16
    plain = llm_fp32.generate([prompts[1], prompts[3]], SamplingParams(temperature=0.0), use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert outputs[3].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert outputs[1].outputs[0].text == plain[0].outputs[0].text != ""


def test_rows_stay_forced_while_requests_finish_and_the_batch_moves(llm_with_dummy, llm_fp32):
    """Requests of different lengths finish at different steps, so the batch loses
    rows and the survivors move: each target stays with its request."""
    six = prompts + ["Write a haiku about the sea:", "def fibonacci(n):"]
    lengths = [2, 8, 4, 6, 1, 7]
    targets = [None, 128, None, 67, 300, None]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, extra_args=None if t is None else {"target_token": t})
        for n, t in zip(lengths, targets)
    ]
    outs = llm_with_dummy.generate(six, params, use_tqdm=False)
    plain = llm_fp32.generate(
        six, [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths], use_tqdm=False
    )
    for out, ref, n, target in zip(outs, plain, lengths, targets):
        if target is None:
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        else:
            assert out.outputs[0].token_ids == [target] * n
    # A second batch on the same engine: the processor's state starts from the new batch.
    short = [
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=3, extra_args={"target_token": 128}),
    ]
    again = llm_with_dummy.generate(prompts[:2], short, use_tqdm=False)
    assert again[1].outputs[0].token_ids == [128] * 3
    assert again[0].outputs[0].token_ids[:2] == plain[0].outputs[0].token_ids  # greedy: the same start


# --------------------------------------------------------------------------- #
# The batch updates themselves: what a processor is told, step by step
# --------------------------------------------------------------------------- #


class RecordingProcessor(LogitsProcessor):
    """Keeps ``index -> tag`` with vLLM's helper and records every update."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.tags: dict[int, str] = {}
        self.updates: list[BatchUpdate | None] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        self.updates.append(batch_update)
        process_dict_updates(self.tags, batch_update, lambda params, _, __: params.extra_args["tag"])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _batch():
    from vframe.core.config import EngineConfig
    from vframe.core.sample.batch_processors import BatchLogitsProcessors

    config = EngineConfig.from_sources(logits_processors=[RecordingProcessor])
    return BatchLogitsProcessors(config, torch.device("cpu"))


def _state(tag: str, prompt: tuple[int, ...] = (5, 6)):
    from vframe.core.sample.batch_state import RequestSamplingState

    return RequestSamplingState(SamplingParams(extra_args={"tag": tag}), [*prompt, 7], len(prompt), torch.device("cpu"))


def test_batch_updates_report_removals_additions_and_moves_in_vllms_order():
    from vframe.v1.sample.logits_processor import MoveDirectionality

    batch = _batch()
    rec = batch.processors[0]
    a, b, c, d = (_state(t) for t in "abcd")
    batch.update([a, b, c])
    first = rec.updates[-1]
    assert (first.batch_size, first.removed, first.moved) == (3, [], [])
    assert [(i, p.extra_args["tag"], prompt, out) for i, p, prompt, out in first.added] == [
        (0, "a", [5, 6], [7]), (1, "b", [5, 6], [7]), (2, "c", [5, 6], [7])
    ]
    batch.update([a, b, c])
    assert rec.updates[-1] is None  # unchanged

    batch.update([a, c])  # b finished: c moves into its row
    assert rec.updates[-1] == BatchUpdate(2, removed=[1], added=[], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)])
    assert rec.tags == {0: "a", 1: "c"}

    batch.update([d, c, a])  # d takes a's row, a goes to the end
    update = rec.updates[-1]
    assert update.removed == [] and [i for i, *_ in update.added] == [2]
    assert update.moved == [(2, 0, MoveDirectionality.SWAP)]
    assert rec.tags == {0: "d", 1: "c", 2: "a"}

    batch.update([c])  # d and a leave; an added request replacing a removed one is not in `removed`
    assert rec.updates[-1] == BatchUpdate(1, removed=[0, 2], added=[], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)])
    e = _state("e")
    batch.update([e, c])
    assert rec.updates[-1].removed == [] and rec.tags == {0: "e", 1: "c"}


def test_output_token_ids_of_an_added_request_is_a_live_list():
    from vframe.core.sample.batch_state import SamplingBatch

    sampling = SamplingBatch(torch.device("cpu"), _batch())
    a = _state("a")
    sampling.metadata([a], vocab_size=16)
    _, _, prompt, output = sampling.batch_processors.processors[0].updates[-1].added[0]
    sampling.record_sampled([a], [9])
    sampling.record_sampled([a], [11])
    assert (prompt, output) == ([5, 6], [7, 9, 11])


def test_random_batch_changes_keep_every_index_on_its_request():
    """Over many steps of requests joining, leaving and reordering, the helper's
    ``index -> tag`` always equals the batch's rows."""
    rng = random.Random(0)
    batch = _batch()
    rec = batch.processors[0]
    pool = [_state(f"r{i}") for i in range(12)]
    for _ in range(300):
        rows = rng.sample(pool, rng.randint(0, 8))
        batch.update(rows)
        assert rec.tags == {i: s.params.extra_args["tag"] for i, s in enumerate(rows)}
        if rec.updates[-1] is not None:
            assert rec.updates[-1].batch_size == len(rows)
            assert not {i for i, *_ in rec.updates[-1].added} & set(rec.updates[-1].removed)


# --------------------------------------------------------------------------- #
# Argmax-invariant processors, validation, bad settings
# --------------------------------------------------------------------------- #


class TemperatureTwiceProcessor(LogitsProcessor):
    """Argmax-invariant: halves every logit and counts its calls (per process)."""

    calls = 0

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.max_model_len = vllm_config.model.max_model_len

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None):
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return logits / 2

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        if sampling_params.extra_args and "refuse" in sampling_params.extra_args:
            raise ValueError("TemperatureTwiceProcessor refuses extra_args['refuse']")


def test_argmax_invariant_processors_skip_greedy_steps_and_validate_params(llm_fp32):
    llm = LLM(dtype="float32", max_model_len=256, num_threads=1, logits_processors=[TemperatureTwiceProcessor])
    try:
        runner_processor = llm.llm_engine.executor.driver_runner.input_batch.sampling.batch_processors.processors[0]
        assert runner_processor.max_model_len == 256  # built with the engine's EngineConfig
        greedy = SamplingParams(temperature=0.0, max_tokens=5)
        TemperatureTwiceProcessor.calls = 0
        out = llm.generate("The capital of France is", greedy, use_tqdm=False)[0]
        assert TemperatureTwiceProcessor.calls == 0  # all greedy: the argmax was taken already
        ref = llm_fp32.generate("The capital of France is", greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        # Halving the logits after temperature 0.8 is sampling at temperature 1.6.
        hot = SamplingParams(temperature=0.8, max_tokens=6, seed=7)
        out = llm.generate("Once upon a time", hot, use_tqdm=False)[0]
        assert TemperatureTwiceProcessor.calls == len(out.outputs[0].token_ids) == 6
        ref = llm_fp32.generate("Once upon a time", SamplingParams(temperature=1.6, max_tokens=6, seed=7), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        refused = llm.generate("Hi", SamplingParams(max_tokens=2, extra_args={"refuse": 1}), use_tqdm=False)[0]
        assert refused.outputs[0].finish_reason == "error"
        assert "TemperatureTwiceProcessor refuses extra_args['refuse']" in str(refused.outputs[0].error)
    finally:
        llm.shutdown()


def test_bad_logits_processors_settings_name_the_entry():
    from vframe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^logits_processors: cannot import 'no_such_module:Proc'"):
        LLM(logits_processors=["no_such_module:Proc"])
    with pytest.raises(ConfigError, match=r"^logits_processors: <class 'int'> is not a subclass of "
                       r"vframe\.v1\.sample\.logits_processor\.LogitsProcessor"):
        LLM(logits_processors=[int])


@pytest.mark.slow  # about 17 s; tests/distributed keeps processors rebuilt on every rank in make test
def test_processor_is_built_in_every_tensor_parallel_worker(monkeypatch):
    """With tensor_parallel_size > 1 the runners live in worker processes: the class
    travels by reference (its module must be importable there) and is built there."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    llm = LLM(dtype="float32", tensor_parallel_size=3, max_model_len=256, logits_processors=[DummyLogitsProcessor])
    try:
        outs = llm.generate(prompts[:2], sampling_params_list[:2], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == [128] * 16
        assert outs[1].outputs[0].token_ids != [128] * 16
    finally:
        llm.shutdown()


def test_vllm_module_paths_name_vframes_objects():
    from vframe.core.config import EngineConfig
    from vframe.core.sample import batch_processors
    from vframe.v1.sample.logits_processor import MoveDirectionality, builtin, interface

    assert LogitsProcessor is interface.LogitsProcessor is batch_processors.LogitsProcessor
    assert BatchUpdate is interface.BatchUpdate is batch_processors.BatchUpdate
    assert MoveDirectionality is batch_processors.MoveDirectionality
    assert process_dict_updates is builtin.process_dict_updates is batch_processors.process_dict_updates
    assert VllmConfig is EngineConfig
