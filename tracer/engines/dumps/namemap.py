"""Mapping an engine dump onto the HF capture points of a reference run: names, fusion, TP shards, tokens.

Planning and executing are one pass here because every step is cheap, but each decision is
recorded: a :class:`MappedDump` holds, per HF capture point, the rows of every compared position
and a one-line account of where they came from (``engine name → HF name``, what was split, how
many TP shards were concatenated along which dim, what was summed). Positions present on one side
only, and engine tensors that map to nothing tracer captures, are listed in ``notes``; nothing is
dropped silently. The map format is documented in ``hooks/engine-llama.toml``; maps are read by
:mod:`tracer.engines.dumps.rules`, TP/SP shards joined by :mod:`tracer.engines.dumps.shards`.
"""

from __future__ import annotations

import fnmatch
import gc
import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tracer.execute.records import DumpEntry, RawDump
from tracer.errors import TracerError, option
from tracer.execute.kinds import PointKind
from tracer.engines.dumps.coverage import one_side, only_in_dump, only_in_reference
from tracer.engines.dumps.tokens import align_steps, ranges, segments, token_rows  # align_steps: re-exported
from tracer.engines.dumps.shards import UNMARKED_PARTIAL, _unshard
from tracer.engines.dumps.slots import Slot, place, rows_of

_LAYER_RE = re.compile(r"^(?:.*\.)?(?:layers|h|blocks)\.(\d+)(?:\.(.+))?$")


@dataclass(frozen=True)
class RefLayout:
    """What the mapping needs to know about the HF reference run.

    Attributes:
        names: HF capture names in execution order → ``(kind, op, feature shape, dtype name)``;
            the feature shape excludes the leading token dim.
        layer_prefix: the HF decoder-layer list path (``model.layers``).
        n_layers: number of decoder layers.
        token_ids: the reference prompt, N ints.
        window: ``(start, stop)``: the positions the reference run kept.
        family: ``config.model_type`` of the reference model (``llama``).
        kv_heads: the model's key/value heads (query groups), None when the trace does not record
            them; a fused QKV split by groups (Megatron's ``linear_qkv``) needs it.
    """

    names: dict[str, tuple[str, str, tuple[int, ...], str]]
    layer_prefix: str
    n_layers: int
    token_ids: list[int]
    window: tuple[int, int]
    family: str
    kv_heads: int | None = None

    def special(self, kind: str) -> str | None:
        return next((n for n, (k, *_rest) in self.names.items() if k == kind), None)


@dataclass
class MappedDump:
    """An engine dump expressed as HF capture points over a contiguous range of positions.

    Attributes:
        engine: display name of the dump's layout (``SGLang dumper``).
        path: the dump folder/file.
        positions: ``(lo, hi)``: absolute positions every tensor covers.
        tensors: HF name → ``(hi - lo, *feature)`` tensor in the engine's dtype.
        mapping: HF name → one line (``non_intrusive__model.layers.3.mlp.gate_up_proj.output →
            model.layers.3.mlp.gate_proj (fused gate_up_proj, half 1 of 2; 2 TP shards along dim -1)``).
        notes: positions and names on one side only, ignored engine tensors, skipped logits.
        facts: ``tp_size``, ``steps``, ``tokenizer_path`` ...
        partial_logits: HF logits name → ``(positions, (len(positions), vocab) rows, mapping line)``
            for logits the engine dumped at some compared positions only (SGLang: next-token
            logits, the last position of each request).
        unmarked_partials: HF name → note, for points whose TP ranks held different values although
            neither the dims nor the map say they are partial sums: their tensor is the ranks'
            float64 sum, which the comparison checks against the reference (a capture-contract
            difference when it matches, inconsistent shards when it does not).
    """

    engine: str
    path: str
    positions: tuple[int, int]
    tensors: dict[str, torch.Tensor]
    mapping: dict[str, str]
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    partial_logits: dict[str, tuple[list[int], torch.Tensor, str]] = field(default_factory=dict)
    unmarked_partials: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- entries


def pass_entries(name: str, value: Any, step: int, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                 file: str = "") -> list[DumpEntry]:
    """The :class:`DumpEntry` list of one module output in a per-pass dump: a tensor, or a tuple/list
    whose elements are tensors or None (vLLM's and SGLang's Linear layers return ``(output, bias)``
    with ``bias = None``; RMSNorm with a residual ``(normed, residual)``; ``rotary_emb`` ``(q, k)``).
    Tuple elements keep their index (``element``); None elements are skipped. Shapes: as dumped,
    ``(T, *feature)`` for the T tokens of the pass.

    Raises:
        TracerError: a value that is neither a tensor nor a list of tensors/None, or holds no tensor.
    """
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(v is None or isinstance(v, torch.Tensor) for v in values) or all(v is None for v in values):
        raise TracerError(f"{file}: {name!r} is not a tensor or a list of tensors (None elements allowed)")
    single = len(values) == 1
    return [DumpEntry(name=name if single else f"{name}#{i}", module=name, element=None if single else i, step=step,
                      tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, dims=None, tensor=v, file=file)
            for i, v in enumerate(values) if v is not None]


# ---------------------------------------------------------------- names


def locate(module: str) -> tuple[int | None, str]:
    """``model.layers.3.mlp`` → ``(3, "mlp")``; ``model.embed_tokens`` → ``(None, "embed_tokens")``;
    wrappers' prefixes (``model.``, ``transformer.``, Megatron's DDP/Float16Module ``module.``) are dropped."""
    m = _LAYER_RE.match(module)
    if m:
        return int(m.group(1)), m.group(2) or ""
    rel = module
    for prefix in ("module.", "model.", "transformer."):
        while rel.startswith(prefix) and rel != prefix.rstrip("."):
            rel = rel[len(prefix):]
    return None, rel


def hf_name(target: str, layer: int | None, ref: RefLayout) -> str | None:
    """Resolve a rule's ``hf`` value to an HF capture name (None for ``-`` or out of range)."""
    if target == "-":
        return None
    specials = {"@embedding": PointKind.EMBEDDING, "@final_norm": PointKind.FINAL_NORM, "@logits": PointKind.LOGITS}
    if target in specials:
        return ref.special(specials[target])
    if target == "@last_layer":
        return f"{ref.layer_prefix}.{ref.n_layers - 1}"
    if layer is None:
        return target
    if target == "@layer":
        return f"{ref.layer_prefix}.{layer}"
    if target == "@prev_layer":
        return f"{ref.layer_prefix}.{layer - 1}" if layer > 0 else None
    return f"{ref.layer_prefix}.{layer}.{target}"


# ---------------------------------------------------------------- mapping


def _group(raw: RawDump) -> dict[tuple[str, int], dict[int | None, dict[int, DumpEntry]]]:
    """(module, step) → element → TP rank → entry, refusing a tensor dumped twice with other values."""
    groups: dict[tuple[str, int], dict[int | None, dict[int, DumpEntry]]] = {}
    for e in raw.entries:
        slot = groups.setdefault((e.module, e.step), {}).setdefault(e.element, {})
        old = slot.get(e.tp_rank)
        if old is not None and old.pp_rank != e.pp_rank:  # a wrapper's output on every PP stage: the last stage's is the model's
            slot[e.tp_rank] = e if e.pp_rank > old.pp_rank else old
            continue
        if old is not None and not (old.tensor.shape == e.tensor.shape and torch.equal(old.tensor, e.tensor)):
            raise TracerError(f"{e.name} is dumped twice in step {e.step} on TP rank {e.tp_rank} with different "
                              f"values ({old.file}, {e.file}); dump one forward pass per step")
        slot.setdefault(e.tp_rank, e)
    return groups


def _rule_parts(elements: dict[int | None, dict[int, DumpEntry]], rule: dict[str, Any], hf: list[str | None],
                ref: RefLayout, what: str, ledger: Any = None) -> tuple[list[torch.Tensor], str, list[str]] | None:
    """The tensors one rule produces for one (module, step): one per HF target; None if an element is absent.
    The copies it makes (shards joined, tuple elements summed) are charged to ``ledger`` (the dump's) first.

    Raises:
        TracerError: a tuple without an element rule, Megatron's fused QKV without KV heads, shards
            that do not join, copies over the input budget.
    """
    if "sum" in rule and set(elements) == {None}:  # a layer dumped as one tensor: already the residual stream
        rule = {k: v for k, v in rule.items() if k != "sum"}
    if rule.get("element") is None and "sum" not in rule and set(elements) == {0}:
        # a tuple whose only tensor is element 0: a Linear's (output, bias=None) in vLLM and SGLang
        elements = {None: elements[0]}
    wanted = rule.get("sum") or [rule.get("element")]
    if rule.get("element") is None and "sum" not in rule and None not in elements:
        raise TracerError(f"{what} is a tuple of {len(elements)} tensors; its map rule must pick an element "
                          "(element = 0) or add them (sum = [1, 0])")
    picked = []
    for el in wanted:
        shards = elements.get(el, elements.get(None) if el == 0 else None)
        if shards is None:
            return None
        picked.append(shards)
    used = [(lambda e: e.name + (f" [PP stage {e.pp_rank}]" if e.pp_rank else ""))(next(iter(s.values()))) for s in picked]
    if rule.get("split"):
        dims = [ref.names[n][2] for n in hf if n is not None and n in ref.names]
        if len(dims) != len(hf):
            return None  # the reference did not capture the split parts (e.g. --granularity layers)
        rule = dict(rule, _sizes=[d[-1] if d else 1 for d in dims])
        if rule["split"] == "qkv_groups":
            if not ref.kv_heads:
                raise TracerError(f"{what} is Megatron's fused QKV (query groups side by side) but the reference trace does not "
                                  "record the model's KV heads; re-trace it with this tracer or give kv_heads = G in the "
                                  "[engine] table of a --map file")
            rule["_groups"] = ref.kv_heads
    outs, note = [], ""
    for shards in picked:
        if ledger is not None and (len(shards) > 1 or "sum" in rule):
            ledger.charge(sum(_nbytes(e.tensor) for e in shards.values()) * (2 if "sum" in rule else 1),
                          f"{what}: joining its {len(shards)} TP shard(s)")
        parts, note = _unshard(shards, rule, what)
        outs.append(parts)
    if "sum" in rule:
        dtype = _torch_dtype(ref.names[hf[0]][3]) if hf[0] in ref.names else outs[0][0].dtype
        total = outs[0][0].to(dtype)
        for p in outs[1:]:
            total = total + p[0].to(dtype)  # HF: hidden_states = residual + hidden_states, in the model dtype
        return [total], note, used
    return outs[0], note, used


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "float64": torch.float64}.get(name, torch.float32)


def _describe(names: list[str], module: str, rule: dict[str, Any], i: int, n: int, note: str, is_tuple: bool,
              last: bool = False) -> str:
    bits = []
    if rule.get("split"):
        bits.append(f"fused {module.rsplit('.', 1)[-1]}, part {i + 1} of {n}")
    if "sum" in rule and (is_tuple or len(names) > 1):  # a single plain tensor (vLLM's hidden-states slot) is the sum
        bits.append("(hidden, residual) summed in the HF dtype")
    elif rule.get("element") is not None and is_tuple:
        bits.append(f"element {rule['element']} of a tuple")
    if last:
        bits.append("last position of each request")
    elif rule.get("rows") == "last":
        bits.append("one logits row per computed token")
    if note:
        bits.append(note)
    src = " + ".join(names)
    return src + (f" ({'; '.join(bits)})" if bits else "")


def map_dump(raw: RawDump, ref: RefLayout, emap: dict[str, Any]) -> MappedDump:
    """Express ``raw`` as HF capture points of ``ref`` over one contiguous range of positions.

    Python's cyclic garbage collector is paused meanwhile: the mapping builds a ``(tensor, row)``
    pair per position and point (freed by reference counting), whose allocations would otherwise
    run full collections over the whole heap (a vLLM process's is large): 2/3 of the mapping's
    time for 4096 tokens × 29 layers, measured.

    Raises:
        TracerError: an engine name with no rule and no ignore pattern, inconsistent shards, a
            tensor whose rows do not match its step's token count, token ids that match nowhere.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        return _map_dump(raw, ref, emap)
    finally:
        if paused:
            gc.enable()


#: the keys of a map rule :func:`map_window` applies itself: a renaming (``sum`` is dropped for a
#: module dumped as one tensor, as :func:`_rule_parts` drops it)
_PLAIN_RULE = frozenset({"hf", "sum"})


def map_window(path: str, engine: str, entries: list[DumpEntry], token_ids: torch.Tensor, ref: RefLayout,
               emap: dict[str, Any], facts: dict[str, Any] | None = None) -> MappedDump | None:
    """What :func:`map_dump` gives for a dump of one step on one rank that computed the whole
    prompt (positions ``0..T-1``, one tensor per module), from only the rows of the reference's
    kept window: ``entries`` hold ``(w1 - w0, *feature)`` rows of positions ``ref.window`` (element
    None, step 0, TP size 1), ``token_ids`` the step's ``T`` ids, ``facts`` the dump's
    (:attr:`RawDump.facts`). The same tensors (the entries' rows), mapping lines, notes and facts.

    Returns:
        The :class:`MappedDump`, or None where the two could differ and :func:`map_dump` must
        decide over the whole dump: token ids other than the reference's, a window outside
        ``0..T-1``, a map rule that is not a plain renaming (one rule of ``hf``/``sum``) or a module
        without one, two modules on one HF name, rows of another width than the reference's
        point, logits, a ``tokens`` setting, no module named onto any HF name (``map_dump`` then
        refuses the dump: no position on both sides).
    """
    w0, w1 = ref.window
    n = len(token_ids)
    if (emap.get("settings", {}).get("tokens", "t") != "t" or not 0 <= w0 < w1 <= n or n != len(ref.token_ids)
            or not torch.equal(token_ids.to(torch.long), torch.tensor(ref.token_ids, dtype=torch.long))):
        return None
    rows: dict[str, torch.Tensor] = {}
    mapping: dict[str, str] = {}
    for e in entries:
        if e.element is not None or e.step != 0 or e.tp_size != 1 or e.tensor.dim() < 1 or e.tensor.shape[0] != w1 - w0:
            return None
        layer, rel = locate(e.module)
        rules = (emap["layer"] if layer is not None else emap["model"]).get(rel)
        if not rules or len(rules) != 1 or not set(rules[0]) <= _PLAIN_RULE or not isinstance(rules[0]["hf"], str):
            return None
        name = hf_name(rules[0]["hf"], layer, ref)
        if name is None:
            continue
        spec = ref.names.get(name)
        if name in rows or spec is not None and (spec[0] == PointKind.LOGITS or tuple(e.tensor.shape[1:]) != spec[2]):
            return None
        rows[name] = e.tensor
        mapping[name] = _describe([e.name], e.module, rules[0], 0, 1, "", False)
    if not rows:  # no slot names a point: map_dump refuses the dump (no position on both sides)
        return None
    notes = []
    outside = ", ".join(ranges(r) for r in (range(0, w0), range(w1, n)) if r)  # two runs, never adjacent
    if outside:
        notes.append(only_in_dump(outside, ref.window))
    tensors = {name: rows[name] for name in ref.names if name in rows}
    notes += one_side(ref.names, set(rows) - set(ref.names), set(tensors), set(), [])
    return MappedDump(engine=engine, path=path, positions=(w0, w1), tensors=tensors,
                      mapping={name: mapping[name] for name in tensors}, notes=notes,
                      facts={"tp_size": 1, "steps": [0], "step_tokens": [n], **(facts or {})})


def _map_dump(raw: RawDump, ref: RefLayout, emap: dict[str, Any]) -> MappedDump:
    plan, notes = align_steps(raw, ref.token_ids)
    settings = emap.get("settings", {})
    if settings.get("kv_heads"):
        ref = replace(ref, kv_heads=int(settings["kv_heads"]))
    rows: dict[str, Slot] = {}
    mapping: dict[str, str] = {}
    ignored: set[str] = set()
    uncaptured: set[str] = set()
    identities: set[str] = set()
    conflicts: dict[str, list[int]] = {}
    unmarked: dict[str, str] = {}
    segs: dict[int, dict[int, tuple[int, int]]] = {}  # step -> its requests: first row -> (stop row, index)
    for (module, step), elements in sorted(_group(raw).items(), key=lambda kv: kv[0][1]):  # stable: dump order
        layer, rel = locate(module)
        rules = (emap["layer"] if layer is not None else emap["model"]).get(rel)
        if rules is None and (hf_name(rel, layer, ref) if layer is not None else module) in ref.names:
            rules = [{"hf": rel if layer is not None else module}]  # already an HF module path
        if rules is None:
            if any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(rel, p) for p in emap["ignore"]):
                ignored.add(module)
                continue
            e = next(iter(next(iter(elements.values())).values()))
            raise TracerError(f"unknown engine tensor {e.name!r} ({e.file}): no rule for "
                              f"{'layer-relative ' if layer is not None else ''}{rel!r} in {', '.join(emap['sources'])}; "
                              "add one (or an ignore pattern) in a map passed with --map FILE")
        for rule in rules:
            targets = rule["hf"] if isinstance(rule["hf"], list) else [rule["hf"]]
            hf = [hf_name(t, layer, ref) for t in targets]
            if all(h is None for h in hf):
                continue
            if rule.get("split") and not all(h in ref.names for h in hf):
                uncaptured.update(h for h in hf if h is not None)  # e.g. a reference traced at layers granularity
                continue
            if rule.get("identity") == "skip" and _is_identity(elements, raw, module, step):
                identities.add(module)
                continue
            where = f"{module} (step {step})"
            got = _rule_parts(elements, rule, hf, ref, where, raw.ledger)
            if got is None:
                continue
            parts, note, used = got
            if step not in segs:  # the step's requests, once (vectorised; bounded by MAX_REQUESTS)
                found = segments(raw.tokens[step]["input_ids"], raw.tokens[step].get("positions"), f"{raw.path}: step {step}")
                segs[step] = {a: (b, i) for i, (a, b, _p) in enumerate(found)}
            for i, (name, t) in enumerate(zip(hf, parts)):
                if name is None:
                    continue
                last = rule.get("rows") == "last" and _one_per_request(t, len(raw.tokens[step]["input_ids"]),
                                                                       len(segs[step]), where)
                if not last:
                    t = token_rows(t, rule.get("tokens", settings.get("tokens", "t")), raw.tokens[step], where,
                                   raw.ledger)
                if UNMARKED_PARTIAL in note:
                    unmarked.setdefault(name, note)
                place(rows.setdefault(name, Slot()), t, plan.get(step, []), segs[step], len(raw.tokens[step]["input_ids"]),
                       last, step, name, conflicts, module)
                mapping.setdefault(name, _describe(used, module, rule, i, len(parts), note, None not in elements, last))
    notes += [f"{name} at position(s) {ranges(sorted(ps))}: a later engine tensor mapped there differs from the first; "
              "the first is compared" for name, ps in conflicts.items()]
    if identities:
        notes.append(f"identity modules (each output equals its input bit for bit: Megatron's IdentityOp where Transformer "
                     f"Engine fuses the norm into the next linear), not mapped: {', '.join(sorted(identities)[:4])}"
                     f"{f' ... ({len(identities)} in all)' if len(identities) > 4 else ''}")
    mapped = _assemble(raw, ref, rows, mapping, notes, ignored, uncaptured, emap.get("override"))
    mapped.unmarked_partials.update({n: v for n, v in unmarked.items() if n in mapped.tensors})
    return mapped


def _is_identity(elements: dict[int | None, dict[int, DumpEntry]], raw: RawDump, module: str, step: int) -> bool:
    """Every rank's output of ``module`` in ``step`` has the bits of its first input (the dump's
    ``inputs.0``, kept as a digest); False when the dump holds no inputs."""
    entries = [e for shards in elements.values() for e in shards.values()]
    return bool(entries) and all(raw.input_digests.get((module, step, e.tp_rank)) == tensor_digest(e.tensor) for e in entries)


def tensor_digest(t: torch.Tensor) -> str:
    """A fingerprint of a tensor's bits, shape and dtype (blake2b, 16 bytes, hex): the reader keeps
    one per module input so that an identity module's output can be recognised without the input."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{tuple(t.shape)}{t.dtype}".encode())
    h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _one_per_request(t: torch.Tensor, n_tokens: int, n_requests: int, what: str) -> bool:
    """Whether the rows of a ``rows = "last"`` tensor (logits) are one per request (at its last
    position: True) or one per computed token (False), told by their count.

    Raises:
        TracerError: a row count that is neither (the shapes named).
    """
    n = t.shape[0] if t.dim() else 0
    if n == n_tokens:  # one per computed token (also when every request is one token long)
        return False
    if n == n_requests:
        return True
    raise TracerError(f"{what} holds logits of shape {tuple(t.shape)}: {n} rows, but the step has {n_tokens} token(s) "
                      f"in {n_requests} request(s); tracer matches logits rows one per computed token or one per "
                      "request (its last position): dump one of those")


def _assemble(raw: RawDump, ref: RefLayout, rows: dict[str, Slot],
              mapping: dict[str, str], notes: list[str], ignored: set[str], uncaptured: set[str],
              override: str | None = None) -> MappedDump:
    """Stack the rows of the compared positions; list what exists on one side only (``override``:
    the user's map file, named when a width does not match)."""
    w0, w1 = ref.window
    runs: set[range] = set()  # the layers of one prefill share one range: taken once
    keyed = []
    for slot in rows.values():
        placed = slot.positions()
        if isinstance(placed, range):
            runs.add(placed)
        else:
            keyed.append(placed)
    dumped = sorted(set().union(*runs, *keyed))  # every placed position
    inside = [p for p in dumped if w0 <= p < w1]
    if not inside:
        raise TracerError(f"{raw.path}: the dump covers positions {ranges(dumped)} but the reference kept {w0}..{w1 - 1}; "
                          "no position is on both sides (trace the reference with --positions all)")
    lo, kept = inside[-1], set(inside)
    while lo - 1 in kept:  # the run of dumped positions that ends at the last one
        lo -= 1
    hi = inside[-1] + 1
    if w0 < lo or hi < w1:
        notes.append(only_in_reference([p for p in range(w0, w1) if not lo <= p < hi], raw))
    outside = [p for p in dumped if not lo <= p < hi]
    if outside:
        notes.append(only_in_dump(ranges(outside), ref.window))
    tensors: dict[str, torch.Tensor] = {}
    partial: set[str] = set()
    partial_rows: dict[str, tuple[list[int], torch.Tensor]] = {}
    for name in ref.names:
        slot = rows.get(name)
        if slot is None:
            continue
        missing = sorted(set(range(lo, hi)).difference(slot.positions()))
        if missing:
            partial.add(name)
            slot.spread()
            present = [p for p in range(lo, hi) if p in slot]
            if present and ref.names[name][0] == PointKind.LOGITS:
                partial_rows[name] = (present, _vocab(torch.stack([slot[p][0][slot[p][1]] for p in present]), name, ref, notes))  # a few rows
                continue  # compared at those positions on their own (compare_dump)
            notes.append(f"{name}: the dump holds {hi - lo - len(missing)} of the {hi - lo} compared positions "
                         f"(missing {ranges(missing)}); not compared")
            mapping.pop(name, None)
            continue
        feat = ref.names[name][2]
        stacked = rows_of(slot, lo, hi, raw.ledger, f"{name} of {raw.path}")
        if ref.names[name][0] == PointKind.LOGITS:
            stacked = _vocab(stacked, name, ref, notes)
        if tuple(stacked.shape[1:]) != feat:
            if stacked[0].numel() != math.prod(feat):
                raise TracerError(_width_error(name, tuple(stacked.shape[1:]), feat, ref, override))
            stacked = stacked.reshape(hi - lo, *feat)
        tensors[name] = stacked
    notes += one_side(ref.names, (set(rows) - set(ref.names)) | uncaptured, set(tensors) | partial, ignored, raw.ignored_inputs)
    tp = max((e.tp_size for e in raw.entries), default=1)
    steps = sorted({e.step for e in raw.entries})
    facts = {"tp_size": tp, "steps": steps, "step_tokens": [len(raw.tokens[s]["input_ids"]) for s in steps], **raw.facts}
    return MappedDump(engine=raw.engine, path=raw.path, positions=(lo, hi), tensors=tensors,
                      mapping={n: mapping[n] for n in tensors}, notes=notes, facts=facts,
                      partial_logits={n: (ps, t, mapping[n]) for n, (ps, t) in partial_rows.items()})


def _width_error(name: str, got: tuple[int, ...], feat: tuple[int, ...], ref: RefLayout, override: str | None) -> str:
    """The message for engine rows of another width than the reference's point ``name``: the two
    hidden sizes when it is a residual-stream point (a dump of another model than the reference's),
    and the user's map only when one was given (the built-in maps are not the user's to fix)."""
    hidden = next((f for k, _op, f, _dt in ref.names.values() if k in (PointKind.EMBEDDING, PointKind.LAYER)), None)
    blame = (f"; or the map given with {option('engine_map', override, flag='--map')} points that tensor at the "
             "wrong HF module" if override is not None else "")
    if hidden is not None and feat == hidden and len(got) == 1:
        return (f"{name}: the dump's hidden size is {got[0]} but the reference's ({ref.family}, {ref.n_layers} layers) is "
                f"{feat[0]}: the dump is of another model; compare it with a reference trace of the model the engine "
                f"ran, traced at sublayers{blame}")
    return (f"{name}: the engine's rows have shape {got} but the reference's {feat}: a dump of another model (or "
            f"another configuration) than the reference's {ref.family}; compare it with a trace of the model the engine "
            f"ran{blame}")


def _vocab(rows: torch.Tensor, name: str, ref: RefLayout, notes: list[str]) -> torch.Tensor:
    """Logits rows ``(k, V')`` cut to the reference's vocabulary V when the engine padded it (V' > V:
    Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by`` × TP), with a note."""
    feat = ref.names[name][2]
    if rows.dim() != 2 or len(feat) != 1 or rows.shape[1] <= feat[0]:
        return rows
    notes.append(f"{name}: the dump's {rows.shape[1]} logits columns cut to the reference's vocabulary of {feat[0]} "
                 "(the engine pads its vocabulary; the padding columns are not tokens)")
    return rows[:, :feat[0]]
