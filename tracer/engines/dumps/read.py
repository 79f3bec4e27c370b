"""Reading engine tensor dumps (SGLang dumper, per-pass ``PassN.pt`` folders, safetensors/npz).

Three layouts are recognised (sources followed: ``traces/README.md``, section "Engine dumps"):

- **SGLang dumper** (``python/sglang/srt/debug_utils/dumper.py``): a folder (``<dir>/<exp_name>/``)
  of ``torch.save`` files named by their tags, ``step=S___rank=R___dump_index=I___name=NAME___...pt``,
  each holding ``{"value": tensor, "meta": {...}}``; the meta repeats the tags and adds
  ``world_rank``/``world_size``, ``sglang_parallel_info`` (``tp_rank``, ``tp_size``, ...), an optional
  ``dims`` string (``"t h(tp)"``) and ``tokenizer_path``. Token ids are the core fields ``input_ids``
  and ``positions`` of each step. Non-intrusive names are ``non_intrusive__<module>.output[.<i>]``
  and ``non_intrusive__<module>.inputs.<i>``. The same dumper run in a Megatron-LM trainer (Miles,
  slime) writes ``megatron_parallel_info`` (TP, PP, CP, DP, SP ranks) and Megatron's token fields
  (``input_ids`` ``[b, s]``, ``position_ids`` or ``cu_seqlens_q``/``qkv_format``); its layout is read
  by :mod:`tracer.engines.dumps.parallel` and its names mapped by ``hooks/engine-megatron.toml``.
- **Per-pass folders** (SGLang ``--debug-tensor-dump-output-folder``,
  ``python/sglang/srt/debug_utils/tensor_dump_forward_hook.py``; the vLLM proposal has the same
  shape): one sub-folder per rank, ``TP{t}_PP{p}_Rank{r}_pid{pid}/Pass{NNNNN}.pt``, each a dict of
  leaf-module name → tensor (or list of tensors for a tuple output); token ids under
  ``model.forward_batch_info.input_ids`` and ``...positions``. A folder of ``PassN.pt`` files
  without rank sub-folders is one rank.
- **Named tensors**: one ``.safetensors`` or ``.npz`` file, name → tensor, with the token ids
  under ``input_ids`` (and optionally ``positions``); one step, one rank.
- **vLLM hidden states**: one ``{request id}.safetensors`` of exactly ``hidden_states`` and
  ``token_ids`` (vLLM's ``ExampleHiddenStatesConnector``; :mod:`tracer.engines.dumps.hidden_states`).

Loading is safe: ``torch.load(..., weights_only=True)``, ``np.load(..., allow_pickle=False)``; a
file that needs more (a pickled object) is refused with a one-line error naming it. This module
reads and groups; mapping onto HF names, unsharding and token alignment are in
:mod:`tracer.engines.dumps.namemap` (the data classes live in :mod:`tracer.execute.records`).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tracer.dtypes import DTYPES
from tracer.errors import TracerError
from tracer.engines.dumps.hidden_states import is_hidden_states, read_hidden_states
from tracer.engines.dumps.namemap import pass_entries
from tracer.execute.records import DumpEntry, RawDump  # re-exported: the dump's plain data
from tracer.engines.dumps.parallel import (MEGATRON_FIELDS, Rank, check_supported, digest, has_layer, infer_positions,
                                        layer_offsets, meta_int, part_steps, rank_of, renumber)

#: names of SGLang's dumper core fields (token bookkeeping, not activations)
CORE_FIELDS = ("input_ids", "positions", "seq_lens", "req_pool_indices", "rids")
_PASS_RE = re.compile(r"^Pass(\d+)\.pt$")
_RANK_DIR_RE = re.compile(r"^(?:TP(\d+)_PP(\d+)_Rank\d+(?:_pid\d+)?|(?:rank|tp)[_-]?(\d+))$", re.IGNORECASE)
_NON_INTRUSIVE = "non_intrusive__"


def safe_load(path: Path, ledger: Any = None) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU through the input gate, within the budget
    (:func:`tracer.engines.dumps.files.load_pt`: a regular file; declared sizes, shapes and strides
    checked before anything is allocated; ``ledger``: the dump's :class:`tracer.files.Ledger`).

    Raises:
        TracerError: not a regular file, over the budget, unreadable, or holding pickled objects
            (naming the file).
    """
    from tracer.engines.dumps.files import load_pt

    return load_pt(path, ledger)


def parse_output_name(name: str) -> tuple[str, int | str | None, bool]:
    """Split an engine name into ``(module path, element, is_input)``.

    ``non_intrusive__model.layers.3.output.1`` → ``("model.layers.3", 1, False)``;
    ``non_intrusive__model.layers.3.inputs.1`` → ``("model.layers.3", None, True)``;
    ``non_intrusive__logits_processor.output.next_token_logits`` → ``("logits_processor", "next_token_logits", False)``;
    a plain module path (per-pass dumps, named tensors) → ``(name, None, False)``.
    """
    if name.startswith(_NON_INTRUSIVE):
        name = name[len(_NON_INTRUSIVE):]
    m = re.match(r"^(?:(?P<module>.*)\.)?inputs\.\w+$", name)
    if m:
        return m.group("module") or "", None, True
    m = re.match(r"^(?:(?P<module>.*)\.)?output(?:\.(?P<element>\w+))?$", name)
    if m:
        el = m.group("element")
        return m.group("module") or "", (int(el) if el is not None and el.isdigit() else el), False
    return name, None, False


def _tags_of(stem: str, path: Path) -> dict[str, str]:
    tags = {}
    for part in stem.split("___"):
        k, sep, v = part.partition("=")
        if not sep:
            raise TracerError(f"{path} is not named like an SGLang dumper file (tags k=v joined by '___'); "
                              "rename it or dump with SGLang's dumper")
        tags[k] = v
    return tags


def _add_token(tokens: dict, step: int | tuple[int, int, int], key: str, value: Any, file: str,
               ledger: Any = None) -> None:
    """Record a step's ``input_ids``/``positions`` (``step``: the step, or ``(step, dp_rank, cp_rank)``)
    as an int64 vector; that copy is charged to ``ledger`` (the dump's) before it is made.

    Raises:
        TracerError: not an integer tensor, empty, negative, another rank's differs, or the copy
            over the input budget.
    """
    where = step[0] if isinstance(step, tuple) else step
    if isinstance(step, tuple) and step[1:] != (0, 0):
        where = f"{step[0]} (DP rank {step[1]}, CP rank {step[2]})"
    if not isinstance(value, torch.Tensor):
        raise TracerError(f"{file}: {key} is a {type(value).__name__}, not a tensor of token ids")
    if value.is_floating_point() or value.is_complex() or value.numel() == 0:
        raise TracerError(f"{file}: {key} of step {where} is {'empty' if value.numel() == 0 else str(value.dtype)}; "
                          "the dumper writes the step's token ids (an integer tensor) there")
    _charge_long(value, ledger, f"{file}: the int64 copy of {key} ({value.numel():,} ids)")
    value = value.reshape(-1).to(torch.long)
    if key == "input_ids" and bool((value < 0).any()) or key == "positions" and bool((value < 0).any()):
        raise TracerError(f"{file}: {key} of step {where} holds a negative value; the dump is damaged")
    slot = tokens.setdefault(step, {"input_ids": None, "positions": None, "file": file})
    old = slot.get(key)
    if old is not None and not torch.equal(old, value):
        raise TracerError(f"{file}: {key} of step {where} differs from the one in {slot['file']} "
                          "(ranks disagree on the batch); dump one request's run")
    slot[key] = value


def _charge_long(value: torch.Tensor, ledger: Any, what: str) -> None:
    """Charge the int64 copy of an integer tensor (none when it is already a contiguous int64 one)."""
    if ledger is not None and not (value.dtype == torch.long and value.is_contiguous()):
        ledger.charge(value.numel() * 8, what)


def _load_dumper_file(path: Path, ledger: Any = None) -> tuple[dict, Any]:
    """``(meta, value)`` of one dumper file, checked against its file name.

    Raises:
        TracerError: a file without ``value``/``meta``, a meta without ``step``/``name``, pickled objects.
    """
    tags = _tags_of(path.stem, path)
    data = safe_load(path, ledger)
    if not isinstance(data, dict) or "value" not in data or not isinstance(data.get("meta"), dict):
        raise TracerError(f"{path} holds no {{'value', 'meta'}} dict (missing meta); an SGLang dumper "
                          "file is torch.save({'value': tensor, 'meta': {...}})")
    meta = data["meta"]
    for key in ("name", "step"):
        if key not in meta:
            raise TracerError(f"{path}: meta has no '{key}' (missing meta); the SGLang dumper writes "
                              "step, rank, dump_index and name into every file's meta")
    if str(meta["name"]) != tags.get("name", str(meta["name"])):
        raise TracerError(f"{path}: meta name {meta['name']!r} differs from the file name's {tags['name']!r}")
    return meta, data["value"]


def _add_core(tokens: dict, key: Any, name: str, value: Any, file: str, ledger: Any = None) -> None:
    """One token-bookkeeping field of a step (SGLang's or Megatron's core fields; others are dropped)."""
    if name in ("input_ids", "positions", "position_ids"):
        if name == "input_ids" and isinstance(value, torch.Tensor) and value.dim() == 2:
            tokens.setdefault(key, {"input_ids": None, "positions": None, "file": file})["shape"] = tuple(value.shape)
        _add_token(tokens, key, "positions" if name == "position_ids" else name, value, file, ledger)
    elif name == "cu_seqlens_q" and isinstance(value, torch.Tensor):
        _charge_long(value, ledger, f"{file}: the int64 copy of cu_seqlens_q")
        slot = tokens.setdefault(key, {"input_ids": None, "positions": None, "file": file})
        old, new = slot.get("cu_seqlens_q"), value.reshape(-1).to(torch.long)
        if old is not None and not torch.equal(old, new):
            raise TracerError(f"{file}: cu_seqlens_q differs from the one in {slot['file']} for the same step and CP rank; "
                              "dump one forward pass per step")
        slot["cu_seqlens_q"] = new
    elif name == "qkv_format":
        tokens.setdefault(key, {"input_ids": None, "positions": None, "file": file})["qkv_format"] = str(value)


def read_sglang_dumper(folder: Path, ledger: Any = None) -> RawDump:
    """Read an SGLang dumper folder (``k=v___k=v.pt`` files of ``{"value", "meta"}``), written by an
    SGLang server or by a Megatron-LM trainer (``megatron_parallel_info``; :mod:`tracer.engines.dumps.parallel`).

    Each (step, DP rank, CP rank) keeps its own token ids and is numbered as a step of its own
    when the dump has more than one; a PP stage's layers are renumbered to the global layer ids.

    Raises:
        TracerError: a file without ``value``/``meta``, a meta without ``step``/``name``, pickled
            objects, a non-tensor activation, virtual pipeline stages, inconsistent token bookkeeping.
    """
    files = sorted(p for p in folder.iterdir() if p.suffix == ".pt")
    found: list[tuple[tuple[int, int, int], Rank, Any, DumpEntry]] = []
    tokens: dict = {}
    ranks: dict[tuple[int, int, int], Rank] = {}
    ignored, facts, digests = [], {}, {}
    tp_seen: set[tuple[int, int]] = set()
    for path in files:
        meta, value = _load_dumper_file(path, ledger)
        name, step = str(meta["name"]), meta_int(meta, "step", path)
        rank = rank_of(meta, path)
        check_supported(rank, str(path))
        key = (step, rank.dp_rank, rank.cp_rank)
        ranks.setdefault(key, rank)
        tp_seen.add((rank.tp_size, rank.tp_rank))
        if "tokenizer_path" in meta:
            facts["tokenizer_path"] = meta["tokenizer_path"]
        if name in CORE_FIELDS or name in MEGATRON_FIELDS:
            _add_core(tokens, key, name, value, str(path), ledger)
            continue
        if name.startswith(("grad__", "param__")):  # gradients and parameters (Miles' fwd_bwd phase): not activations
            ignored.append(name)
            continue
        module, element, is_input = parse_output_name(name)
        if is_input:
            ignored.append(name)
            if name.endswith(".inputs.0") and isinstance(value, torch.Tensor):
                digests[(module, key, rank.tp_rank, rank.pp_rank)] = digest(value)
            continue
        if not isinstance(value, torch.Tensor):
            raise TracerError(f"{path}: value of {name!r} is a {type(value).__name__}, not a tensor")
        if isinstance(element, str):  # a named output field: LogitsProcessorOutput → output.next_token_logits
            module, element = (f"{module}.{element}" if module else element), None
        layer_id = None if meta.get("layer_id") is None else meta_int(meta, "layer_id", path)
        found.append((key, rank, layer_id, DumpEntry(
            name=name, module=module, element=element, step=step, tp_rank=rank.tp_rank, tp_size=rank.tp_size,
            pp_rank=rank.pp_rank, dims=meta.get("dims"), tensor=value, file=str(path), sp=rank.sp)))
    _check_tp(tp_seen, folder)
    return _assemble_dumper(folder, found, tokens, ranks, ignored, facts, digests)


def _check_tp(seen: set[tuple[int, int]], folder: Path) -> None:
    """Every file's ``tp_size`` against the TP ranks the dump holds: one size, and as many ranks as it
    says (checked here, before anything is sized by it).

    ``seen``: the ``(tp_size, tp_rank)`` of every file.

    Raises:
        TracerError: files that disagree on ``tp_size``, or a ``tp_size`` the dump's ranks do not fill.
    """
    sizes = sorted({size for size, _rank in seen})
    present = sorted({rank for _size, rank in seen})
    if len(sizes) > 1:
        raise TracerError(f"{folder}: the files' meta disagree on tp_size ({', '.join(map(str, sizes[:4]))}); "
                          "dump one TP group per folder")
    if sizes and sizes[0] > len(present):
        shown = ", ".join(map(str, present[:8])) + (" ..." if len(present) > 8 else "")
        raise TracerError(f"{folder}: the meta says tp_size {sizes[0]:,} but the dump holds TP rank(s) {shown}; "
                          "dump every rank of the TP group")


def _assemble_dumper(folder: Path, found: list, tokens: dict, ranks: dict, ignored: list, facts: dict,
                     digests: dict) -> RawDump:
    """Number the steps (one per step, DP rank and CP rank), renumber PP stages' layers, infer
    Megatron's positions; execution order within a step: the dumper's ``dump_index`` per rank."""
    pp_size = max((r.pp_size for r in ranks.values()), default=1)
    offsets = layer_offsets(((r.pp_rank, e.module, lid) for _k, r, lid, e in found if lid is not None), pp_size, str(folder))
    if pp_size > 1:
        bare = sorted({r.pp_rank for _k, r, _l, e in found if has_layer(e.module)} - set(offsets))
        if bare:
            raise TracerError(f"{folder}: PP stage {bare[0]} dumped layers without layer_id tags, so their global "
                              "numbers are unknown; dump with the dumper's non-intrusive hooks (they tag layer_id)")
    steps = part_steps(list(ranks) + list(tokens))
    entries = [replace(e, step=steps[k], module=renumber(e.module, offsets.get(r.pp_rank, 0))) for k, r, _l, e in found]
    entries.sort(key=lambda e: (e.step, e.pp_rank, e.tp_rank, _index_of(e.file)))
    out_tokens = {}
    for key, slot in tokens.items():
        if slot.get("input_ids") is None:
            continue
        if slot.get("positions") is None and (slot.get("cu_seqlens_q") is not None or slot.get("shape") is not None):
            rank = ranks.get(key, Rank())
            slot["positions"] = infer_positions(slot, rank, f"{folder} step {key[0]} (CP rank {rank.cp_rank})")
        out_tokens[steps[key]] = slot
    frameworks = {r.framework for r in ranks.values()} - {""}
    facts["framework"] = "megatron" if "megatron" in frameworks else "sglang"
    if len({(dp, cp) for _s, dp, cp in steps}) > 1:
        facts["parts"] = {v: f"step {s}, DP rank {dp}, CP rank {cp}" for (s, dp, cp), v in sorted(steps.items())}
    for what in ("cp_size", "pp_size", "dp_size"):
        n = max((getattr(r, what) for r in ranks.values()), default=1)
        if n > 1:
            facts[what] = n
    if any(r.sp for r in ranks.values()):
        facts["sequence_parallel"] = True
    input_digests = {(renumber(m, offsets.get(pp, 0)), steps[k], tp): d for (m, k, tp, pp), d in digests.items()}
    engine = "Megatron-LM dump" if facts["framework"] == "megatron" else "SGLang dumper"
    return RawDump(path=str(folder), layout="sglang-dumper", engine=engine, entries=entries, tokens=out_tokens,
                   facts=facts, ignored_inputs=sorted(set(ignored)), input_digests=input_digests)


def _index_of(file: str) -> int:
    m = re.search(r"(?:^|___)dump_index=(\d+)", Path(file).stem)
    return int(m.group(1)) if m else 0


def _rank_dirs(folder: Path) -> list[tuple[int, int, Path]]:
    out = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        m = _RANK_DIR_RE.match(sub.name)
        if m and any(_PASS_RE.match(f.name) for f in sub.iterdir()):
            tp = int(m.group(1) if m.group(1) is not None else m.group(3))
            pp = int(m.group(2)) if m.group(2) is not None else 0
            out.append((tp, pp, sub))
    return out


def read_passes(folder: Path, ledger: Any = None) -> RawDump:
    """Read a per-pass dump: rank sub-folders (or one folder) of ``PassN.pt`` dicts name → tensor(s).

    Raises:
        TracerError: a pass file that is not a dict of tensors, pickled objects, ranks with
            different sets of passes.
    """
    ranks = _rank_dirs(folder) or [(0, 0, folder)]
    tp_size = len({tp for tp, _, _ in ranks})
    passes_of = {}
    entries, tokens, ignored = [], {}, []
    for tp, pp, sub in ranks:
        files = sorted((int(_PASS_RE.match(f.name).group(1)), f) for f in sub.iterdir() if _PASS_RE.match(f.name))
        passes_of[sub.name] = [n for n, _ in files]
        for step, path in files:
            data = safe_load(path, ledger)
            if not isinstance(data, dict):
                raise TracerError(f"{path} holds a {type(data).__name__}, not a dict of module name → tensor")
            for name, value in data.items():
                if name.endswith(".forward_batch_info.input_ids") or name.endswith(".forward_batch_info.positions"):
                    if tp == 0:
                        _add_token(tokens, step, name.rsplit(".", 1)[1], value, str(path), ledger)
                    continue
                if ".forward_batch_info." in name or name == "model":
                    ignored.append(name)  # seq_lens; the root model's output lands in the next pass
                    continue
                entries += pass_entries(name, value, step, tp, tp_size, pp, str(path))
    if len({tuple(v) for v in passes_of.values()}) > 1:
        detail = ", ".join(f"{k}: {len(v)}" for k, v in passes_of.items())
        raise TracerError(f"{folder}: rank folders hold different passes ({detail}); the shards are inconsistent")
    return RawDump(path=str(folder), layout="passes", engine="SGLang/vLLM per-pass dump", entries=entries,
                   tokens=tokens, facts={"tp_size": tp_size}, ignored_inputs=sorted(set(ignored)))


def read_named_tensors(path: Path, ledger: Any = None) -> RawDump:
    """Read a ``.safetensors`` or ``.npz`` file of named tensors (token ids under ``input_ids``).

    Raises:
        TracerError: not a regular file, over the input budget, unreadable, pickled arrays in an
            npz, no tensors, no ``input_ids``.
    """
    from tracer.engines.dumps.files import load_npz, load_safetensors

    tensors = load_npz(path, ledger) if path.suffix == ".npz" else load_safetensors(path, ledger)
    if not tensors:
        raise TracerError(f"{path} holds no tensors; an engine dump file holds the activations by module name and the "
                          "prompt's input_ids (or vLLM's hidden_states and token_ids)")
    if is_hidden_states(tensors):  # vLLM's own hidden-states file (ExampleHiddenStatesConnector)
        return read_hidden_states(str(path), tensors, ledger)
    tokens: dict = {}
    entries = []
    for name, value in tensors.items():
        if name in ("input_ids", "positions"):
            _add_token(tokens, 0, name, value, str(path), ledger)
            continue
        module, element, is_input = parse_output_name(name)
        if is_input:
            continue
        if isinstance(element, str):
            module, element = (f"{module}.{element}" if module else element), None
        entries.append(DumpEntry(name=name, module=module, element=element,
                                 step=0, tp_rank=0, tp_size=1, pp_rank=0, dims=None, tensor=value, file=str(path)))
    return RawDump(path=str(path), layout="tensors", engine="named tensors", entries=entries, tokens=tokens)


def read_dump(path: str | Path) -> RawDump:
    """Read an engine dump, recognising its layout (see the module docstring).

    A floating tensor of a dtype the trace does not hold (float8, ...) is refused in one line.

    ``path``: an SGLang dumper folder (or its parent holding one ``<exp_name>/`` folder), a
    per-pass folder (rank sub-folders of ``PassN.pt``, or ``PassN.pt`` files), or a
    ``.safetensors``/``.npz`` file.

    Raises:
        TracerError: missing path, unrecognised layout, or any malformed file (one line naming it).
    """
    from tracer.files import Ledger

    p = Path(path)
    if not p.exists():
        raise TracerError(f"engine dump {p} does not exist; give an SGLang dumper folder, a PassN.pt folder, "
                          "or a .safetensors/.npz file")
    ledger = Ledger(f"engine dump {p}")  # one budget for the whole dump: its files and every copy made of them
    raw = _read_layout(p, ledger)
    for e in raw.entries:
        t = e.tensor
        if isinstance(t, torch.Tensor) and t.is_floating_point() and str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise TracerError(f"{e.file}: {e.name} is {str(t.dtype).removeprefix('torch.')}; tracer compares "
                              f"{', '.join(DTYPES)} activations: convert the dump's tensors to one of them (e.g. the "
                              "model's dtype) first")
    return raw


def _read_layout(p: Path, ledger: Any) -> RawDump:
    """:func:`read_dump` of an existing path, its layout recognised."""
    if not p.is_dir():
        from tracer.files import check_input_file

        check_input_file(p, "engine dump")  # a FIFO or device is refused here, before anything reads it
        if p.suffix in (".safetensors", ".npz"):
            return replace(read_named_tensors(p, ledger), ledger=ledger)
        raise TracerError(f"{p} is a file but not .safetensors/.npz; give the dump's folder for .pt dumps")
    if _rank_dirs(p) or any(_PASS_RE.match(f.name) for f in p.iterdir()):
        return replace(read_passes(p, ledger), ledger=ledger)
    if any(f.suffix == ".pt" and "___" in f.name for f in p.iterdir()):
        return replace(read_sglang_dumper(p, ledger), ledger=ledger)
    subs = [s for s in p.iterdir() if s.is_dir() and any(f.suffix == ".pt" for f in s.iterdir())]
    if len(subs) == 1:
        return replace(read_sglang_dumper(subs[0], ledger), ledger=ledger)
    if len(subs) > 1:
        raise TracerError(f"{p} holds {len(subs)} dump folders ({', '.join(s.name for s in subs[:4])}); give one of them")
    raise TracerError(f"{p} holds no engine dump (no k=v___k=v.pt dumper files, PassN.pt files or rank folders)")
