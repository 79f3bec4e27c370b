"""Type and range checks of the JSON fields a trace holds, in one validation pass before use.

The trace's checksums catch damage, not edits: the public spec (``traces/README.md``) lets anyone
change a value and recompute every CRC ("re-sealed tampering"). So every field tracer reads from a
header, a run's ``plan``/``meta``, an index entry's ``calls`` or a stored comparison's ``facts`` is
checked here for its JSON type and range before any code uses it; a bad one is one
:class:`~tracer.errors.TracerError` line naming the field, never a traceback later. Keys a reader
does not know are ignored (later versions may add them).
"""

from __future__ import annotations

from typing import Any, Callable

from tracer.errors import TracerError

Check = Callable[[Any], bool]
#: the largest count, position or dimension a field may hold (beyond any real model or prompt)
BIG = 1 << 48


def _int(x: Any, lo: int = 0, hi: int = BIG) -> bool:
    return type(x) is int and lo <= x <= hi  # bool is not an int here


def is_int(x: Any) -> bool:
    return _int(x)


def is_str(x: Any) -> bool:
    return isinstance(x, str)


def is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def opt(check: Check) -> Check:
    return lambda x: x is None or check(x)


def list_of(check: Check, max_len: int = BIG) -> Check:
    return lambda x: isinstance(x, list) and len(x) <= max_len and all(check(v) for v in x)


def dict_of(check: Check) -> Check:
    return lambda x: isinstance(x, dict) and all(isinstance(k, str) and check(v) for k, v in x.items())


def shape(x: Any) -> bool:
    return type(x) is list and len(x) <= 16 and all(type(v) is int and 0 <= v <= BIG for v in x)


def span(x: Any) -> bool:
    """``[start, stop]`` positions, ``0 <= start <= stop``."""
    return type(x) is list and len(x) == 2 and type(x[0]) is int and type(x[1]) is int and 0 <= x[0] <= x[1] <= BIG


def _shapes(x: Any) -> bool:
    """A list of shapes (None allowed), or one flat shape."""
    if type(x) is not list:
        return False
    return all(v is None or shape(v) for v in x) or shape(x)


def _kernel_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(k, dict) and is_str(k.get("name")) and _int(k.get("count"))
                                       for k in x)


def call_ok(c: Any) -> bool:
    """One forward call of a capture point: ``{"positions": [a, b], "in": [shapes], "out": [shapes],
    "kernels": {"device": [{"name", "count"}], "ops": [...]}}`` (every key optional)."""
    if not isinstance(c, dict):
        return False
    if "positions" in c and not span(c["positions"]):
        return False
    if ("in" in c and not _shapes(c["in"])) or ("out" in c and not _shapes(c["out"])):
        return False  # a list of shapes, or (the spec's example, an engine's flattened points) one flat shape
    k = c.get("kernels")
    return k is None or (isinstance(k, dict) and all(_kernel_list(k.get(p, [])) for p in ("device", "ops")))


def calls_problem(calls: Any) -> str | None:
    """None for a valid list of forward calls, else what is wrong."""
    if not isinstance(calls, list):
        return "calls is not a list"
    bad = next((i for i, c in enumerate(calls) if not call_ok(c)), None)
    return None if bad is None else f"call {bad} is not {{positions: [start, stop], in: [shapes], out: [shapes], kernels}}"


def check(doc: dict[str, Any], spec: dict[str, Check], where: str, fail: Callable[[str], TracerError]) -> None:
    """Check every key of ``spec`` present in ``doc``.

    Raises:
        the error ``fail`` builds, naming the first key of the wrong type or range.
    """
    for key, ok in spec.items():
        if key in doc and not ok(doc[key]):
            raise fail(f"{where}: {key} has the wrong type or range ({type(doc[key]).__name__})")


_SCENARIO = {"name": is_str, "level": opt(is_num), "params": opt(dict_of(lambda v: True)),
             "kv_block_format": opt(lambda f: isinstance(f, dict) and all(is_str(f.get(k)) for k in ("name", "element", "scale"))
                                    and opt(is_int)(f.get("block_size")))}
_CONTRACT = {"parameter_dtypes": dict_of(is_int), "buffers": dict_of(lambda b: isinstance(b, dict)),
             "cast_after_load": lambda x: isinstance(x, dict) and opt(lambda d: isinstance(d, bool))(x.get("detected")),
             "attention": dict_of(lambda a: isinstance(a, dict) and list_of(is_int)(a.get("layers", []))
                                  and opt(is_int)(a.get("sliding_window")) and opt(is_str)(a.get("implementation")))}
_HEADER = {"model": lambda m: isinstance(m, (dict, str)), "scenario": lambda s: isinstance(s, (dict, str)),
           "numeric_contract": opt(lambda c: isinstance(c, dict)), "tensor_parallel": lambda x: isinstance(x, dict),
           "engine_dump": lambda x: isinstance(x, dict) and all(is_str(x.get(k)) for k in ("engine", "path")),
           "audit": lambda x: isinstance(x, dict), "sweep": lambda x: isinstance(x, dict),
           "store": opt(is_str), "hostname": opt(is_str), "device_name": opt(is_str), "layers_path": opt(is_str),
           "attention_path": opt(is_str)}
_MODEL = {"name": is_str, "dtype": opt(is_str), "device": opt(is_str), "family": opt(is_str),
          "attn_implementation": opt(is_str), "device_map": opt(lambda d: isinstance(d, (dict, str)))}


def check_header(header: dict[str, Any], fail: Callable[[str], TracerError]) -> None:
    """The header's fields tracer reads (model, scenario, numeric contract, engine dump, ...).

    Raises:
        the error ``fail`` builds.
    """
    check(header, _HEADER, "the header", fail)
    if isinstance(header.get("model"), dict):
        check(header["model"], _MODEL, "the header's model", fail)
    if isinstance(header.get("scenario"), dict):
        check(header["scenario"], _SCENARIO, "the header's scenario", fail)
        params = header["scenario"].get("params")
        if isinstance(params, dict):
            check(params, {"kv_block_format": _SCENARIO["kv_block_format"]}, "the header's scenario params", fail)
    if isinstance(header.get("numeric_contract"), dict):
        check(header["numeric_contract"], _CONTRACT, "the header's numeric contract", fail)


_PLAN = {"name": opt(is_str), "description": opt(is_str), "chunks": opt(list_of(span)),
         "gemm_m": opt(lambda g: is_int(g) or list_of(is_int)(g)), "generate": opt(is_int),
         "batch": lambda b: b is None or isinstance(b, (int, dict, list))}
_STORE_AUTO = {"dropped": list_of(is_str), "kept": list_of(is_str), "kinds": dict_of(is_str), "logits": opt(is_str)}
_ENGINE_DUMP = {"engine": is_str, "path": is_str, "mapping": dict_of(is_str), "notes": list_of(is_str),
                "facts": lambda x: isinstance(x, dict)}
_META = {"store_auto": lambda x: isinstance(x, dict), "decode_tokens": list_of(is_int), "decode_text": opt(is_str),
         "generated": list_of(is_int), "engine_dump": lambda x: isinstance(x, dict), "scenario": opt(is_str),
         "level": opt(is_num), "rollout": lambda x: isinstance(x, dict), "train": lambda x: isinstance(x, dict)}


def check_run_json(plan: dict[str, Any], meta: dict[str, Any], run: str, fail: Callable[[str], TracerError]) -> None:
    """A run's ``plan`` and ``meta`` fields tracer reads (chunks, GEMM M, decode tokens, ``--store
    auto`` record, an imported run's ``engine_dump`` mapping, ...).

    Raises:
        the error ``fail`` builds.
    """
    check(plan, _PLAN, f"plan of run {run}", fail)
    check(meta, _META, f"meta of run {run}", fail)
    if isinstance(meta.get("store_auto"), dict):
        check(meta["store_auto"], _STORE_AUTO, f"meta.store_auto of run {run}", fail)
    if isinstance(meta.get("engine_dump"), dict):
        info = meta["engine_dump"]
        check(info, _ENGINE_DUMP, f"meta.engine_dump of run {run}", fail)
        if not all(k in info for k in ("engine", "path", "mapping", "notes")):
            raise fail(f"meta.engine_dump of run {run} lacks engine, path, mapping or notes")


_FACTS = {"notes": list_of(is_str), "versions_differ": list_of(is_str), "contract_differs": list_of(is_str),
          "sliding_layers": list_of(is_int), "sliding_window": opt(is_int), "layers_path": opt(is_str),
          "attention_path": opt(is_str), "chunks_a": opt(list_of(span)), "chunks_b": opt(list_of(span)),
          "plan_a": opt(is_str), "plan_b": opt(is_str), "mapping": dict_of(is_str), "tp_size": opt(is_int),
          "n_tokens": opt(is_int), "generated_a": list_of(is_int), "generated_b": list_of(is_int),
          "first_token_difference": opt(is_int), "kv_block_format": _SCENARIO["kv_block_format"],
          "step_tokens": opt(lambda s: is_int(s) or list_of(is_int)(s)), "steps": list_of(is_int),
          "gemm_m_a": opt(lambda g: is_int(g) or list_of(is_int)(g)),
          "gemm_m_b": opt(lambda g: is_int(g) or list_of(is_int)(g))}


def check_facts(facts: dict[str, Any], fail: Callable[[str], TracerError]) -> None:
    """A comparison's ``facts`` (stored, or built from a header): the keys the reports read.

    Raises:
        the error ``fail`` builds.
    """
    check(facts, _FACTS, "the comparison's facts", fail)
