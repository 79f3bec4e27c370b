"""Progress output while loading: rich status lines on stderr, transformers' bars on or off.

Each context manager restores the state it found, so loading changes no global state for good.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator


def console():
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def quiet_transformers(progress: bool) -> Iterator[None]:
    """Hide transformers' tqdm bars while loading unless ``progress``; restores the previous state."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not progress and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not progress and was_enabled:
            hf_logging.enable_progress_bar()


@contextmanager
def quiet_gguf_bar(progress: bool) -> Iterator[None]:
    """Silence the tqdm bar of ``load_gguf_checkpoint`` unless ``progress``; restored afterwards."""
    if progress:
        yield
        return

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # pragma: no cover - other transformers versions
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def status(progress: Any, message: str):
    """A status for one loading step: ``progress`` a callable (the caller's display) gets the
    message; True shows a rich status of its own; False nothing."""
    if callable(progress):
        progress(message)
        return nullcontext()
    return console().status(message) if progress else nullcontext()
