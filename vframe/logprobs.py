"""vLLM's module path ``vllm.logprobs``: the classes live in ``vframe/core/outputs.py``."""

from vframe.core.outputs import Logprob, SampleLogprobs

__all__ = ["Logprob", "SampleLogprobs"]
