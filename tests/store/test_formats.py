"""tracer.store.formats.json_dumps(safe=True): strict JSON text, non-finite floats as strings.

The expected texts are json.dumps of documents written by hand with the strings in place of
the floats; the tokens planted inside strings (and keys) must stay as they are.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from tracer.errors import TracerError
from tracer.store.formats import json_dumps
from tracer.store.trace import json_safe

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize("doc, by_hand", [
    ({"a": INF, "b": -INF, "c": NAN, "d": 1.5}, {"a": "inf", "b": "-inf", "c": "nan", "d": 1.5}),
    ({"s": 'x" NaN \\" -Infinity', "t": "Infinity", "NaN": [NAN, "NaN", (1, -INF)]},
     {"s": 'x" NaN \\" -Infinity', "t": "Infinity", "NaN": ["nan", "NaN", [1, "-inf"]]}),
    ({INF: "a", "\\": ["\\\\", '"', "é NaN ☃"], "n": None}, {"Infinity": "a", "\\": ["\\\\", '"', "é NaN ☃"], "n": None}),
    ([INF, [NAN, [-INF]]], ["inf", ["nan", ["-inf"]]]),
    (NAN, "nan"),
    ({"k": "no tokens", "v": [1, 2.5, True]}, {"k": "no tokens", "v": [1, 2.5, True]}),
])
def test_safe_text_is_the_documents_with_strings(doc, by_hand):
    assert json_dumps(doc, "doc", safe=True) == json.dumps(by_hand)
    assert json.loads(json_dumps(doc, "doc", safe=True)) == by_hand  # strict JSON: no bare tokens


def test_safe_text_equals_json_safe_on_random_documents():
    rng = random.Random(0)
    atoms = [INF, -INF, NAN, 0.0, -1e308, 3, "NaN", "-Infinity", 'a"b', "\\", "Infinity\\", None, False]

    def make(depth):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(atoms)
        if rng.random() < 0.5:
            return [make(depth - 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(["NaN", "x", 'q"', "Infinity"]) + str(i): make(depth - 1) for i in range(rng.randint(0, 4))}

    for _ in range(300):
        doc = make(4)
        assert json_dumps(doc, "doc", safe=True) == json.dumps(json_safe(doc))


def test_safe_keeps_the_plain_texts_errors():
    assert json_dumps({"a": INF}, "doc") == '{"a": Infinity}'  # not safe: as json.dumps writes it
    with pytest.raises(TracerError, match="doc is not JSON-serialisable"):
        json_dumps({"a": object()}, "doc", safe=True)
