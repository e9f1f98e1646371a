# Two entry points on a fresh clone: `make demo` and `make test`. Both create .venv and install
# torch (pinned, overridable: make test TORCH="torch==2.5.1") and the package with its test extras.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/zerospeed --num_procs 2 examples/train_gpt.py --config examples/configs/gpt_zero2.json

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
