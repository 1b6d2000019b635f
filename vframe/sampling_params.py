"""vLLM's module path ``vllm.sampling_params``: the classes live in
``vframe/core/sampling_params.py``."""

from vframe.core.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)

__all__ = [
    "BeamSearchParams",
    "GuidedDecodingParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]
