"""The FlexAttention backend: paged attention through ``torch.nn.attention.flex_attention``.

``backend`` holds the backend class; it imports ``flex_attention`` only when a
step is attended, so the backend can be listed and refused without it.
"""
