"""The FlashAttention backend: the ``flash-attn`` package's paged kernels.

``backend`` holds the backend class and imports no ``flash_attn``: the package
(a CUDA extension) is imported only when an attention layer is built.
"""
