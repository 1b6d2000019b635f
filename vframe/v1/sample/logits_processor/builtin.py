"""vLLM's ``vllm.v1.sample.logits_processor.builtin``: its helper for processors
that keep per-request state in a dict (vframe's own rewrites are not processors)."""

from vframe.core.sample.batch_processors import process_dict_updates

__all__ = ["process_dict_updates"]
