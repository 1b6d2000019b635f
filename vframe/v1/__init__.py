"""vLLM v1's public module paths: ``from vllm.v1.X import Y`` is ``from vframe.v1.X import Y``.

Thin re-exports; the implementations live in ``vframe.core``.
"""
