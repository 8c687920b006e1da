"""Shared fixtures. Run the suite with `make test` (or `.venv/bin/python -m pytest tests -q`)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_path():
    """The tiny Qwen3-MoE directory, built once (deterministically) the first time any test needs it."""
    from model import ensure_tiny_model
    return ensure_tiny_model(os.path.join(ROOT, ".cache", "tiny-qwen3-moe"))
