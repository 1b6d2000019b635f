"""vLLM's module path ``vllm.pooling_params``: the class lives in ``vframe/core/pooling_params.py``."""

from vframe.core.pooling_params import PoolingParams

__all__ = ["PoolingParams"]
