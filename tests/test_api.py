"""The notebook API (:mod:`tracer.api`): what it refuses before anything loads."""

from __future__ import annotations

import pytest

import tracer
from tracer.errors import TracerError


@pytest.mark.parametrize("ids, message", [([1.9] * 8, "1.9"), ("1" * 8, "got str"), ({1: 1}, "got dict"),
                                          ([True] * 8, "True"), ([None] * 8, "None")])
def test_api_token_ids_must_be_ints(ids, message):
    with pytest.raises(TracerError, match=message):
        tracer.run("tiny-llama", token_ids=ids, store="none", progress=False)
