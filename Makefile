# `make train` and `make test` create (or refresh, when a requirements file changed) the virtualenv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

# The tests that compare runs whose float arithmetic differs (1 and N processes, strategies, packing, bf16):
# their bounds are measured on the machine that runs them, and `test-other-cpus` runs them again with the kernels
# of other CPUs.
EQUIVALENCE := tests/test_multigpu.py tests/test_fsdp.py tests/test_deepspeed.py tests/test_loss.py \
	tests/test_device_map.py tests/test_adapting.py tests/test_conversations.py tests/test_eval.py \
	tests/test_quantized.py tests/test_batched_generation.py
# A CPU without AVX-512 (older Intel, many laptops), as torch, oneDNN and MKL run on it.
AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
# An AVX-512 CPU with bf16 instructions but no AMX (AMD EPYC): what oneDNN runs bf16 with there. Only where the
# CPU has AMX, which oneDNN would otherwise use: elsewhere it is the default run.
NO_AMX := ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
HAS_AMX := $(shell grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null && echo yes)

# The two scripts are read side by side (`diff train.py train_multigpu.py`): lines of at most 100 characters.
SCRIPTS := train.py train_multigpu.py
LINT = $(PY) -m ruff check . && $(PY) -m ruff check --line-length 100 $(SCRIPTS)

.PHONY: setup train test test-fast test-other-cpus lint

$(STAMP): requirements.txt requirements-nodeps.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(LINT)
	$(PY) -m pytest

# A few minutes: the unit tests and one run of each script (torchrun on 2 processes included).
test-fast: $(STAMP)
	$(LINT)
	$(PY) -m pytest -m fast

test-other-cpus: $(STAMP)
	$(AVX2) $(PY) -m pytest $(EQUIVALENCE)
ifeq ($(HAS_AMX),yes)
	$(NO_AMX) $(PY) -m pytest $(EQUIVALENCE)
endif

lint: $(STAMP)
	$(LINT)
