"""vLLM's ``vllm.utils`` names that user code imports (older vLLM exported
``FlexibleArgumentParser`` from here; newer from ``vllm.utils.argparse_utils``)."""

from vframe.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
