"""Shared fixtures: a tiny random-init Llama and the CLI environment (the code behind them: tests/helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# keep the CPU thread count fixed so CI machines of any size compute the same way
torch.set_num_threads(min(2, torch.get_num_threads()))

from tests.helpers import cli_env as _cli_env  # noqa: E402 - after ROOT is importable
from tests.helpers import make_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama():
    return make_model("llama")


@pytest.fixture
def cli_env(tmp_path):
    """Environment for CLI subprocesses: run from the checkout, cwd in a temp dir."""
    return _cli_env()
