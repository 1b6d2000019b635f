"""The Triton paged attention backend: vframe's own kernels for NVIDIA GPUs.

``backend`` holds the backend class and imports no Triton; ``kernels`` holds
the kernels and is imported only when an attention layer is built.
"""
