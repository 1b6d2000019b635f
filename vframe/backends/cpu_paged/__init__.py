"""The ``cpu_paged`` attention backend: decodes attend the paged KV cache in place
through a C++ operator built on this machine (``build.py``); prefills take the
plain-PyTorch backend's SDPA path. ``backend`` holds the backend class."""
