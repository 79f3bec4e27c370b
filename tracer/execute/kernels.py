"""Kernel recording (``--kernels``): which kernels ran for each capture point, in each run.

While a run executes, :class:`KernelRecorder` opens a ``torch.profiler`` session and pushes one
``record_function`` range per firing of every hooked module (``tracer:<module>#<k>``), from a
forward pre-hook to a forward hook that runs *before* the capture hooks (so the capture's own
copies are not attributed to the module; they run inside ``tracer-capture`` ranges that the
attribution skips). After the run, the profiler's event tree gives, for every range:

- ``device``: the device kernels launched by the ops inside it (CUDA: cuBLAS/cuBLASLt/nvjet/
  CUTLASS GEMMs, flash/efficient attention, elementwise kernels), names and counts;
- ``ops``: the compute-level aten ops inside it (``aten::addmm``, ``aten::_scaled_dot_product_
  flash_attention_for_cpu``, ...), names and counts. On the CPU these are all there is: the
  profiler does not report which GEMM micro-kernel, tile or thread partition oneDNN/MKL chose,
  so **CPU GEMM tile choices are not visible** here.

:meth:`KernelRecorder.attach` adds them to each capture record's ``calls[k]["kernels"]`` =
``{"device": [{"name", "count"}], "ops": [{"name", "count"}]}`` (stored in the trace with the
calls). The attention core (input of ``o_proj``) gets the attention module's *own* kernels
(those not inside a hooked child: the SDPA/eager score-softmax-value kernels), a gated MLP's
``down_proj.input`` the MLP's own kernels (the act * up product).

:func:`parse_kernel` turns a kernel name into its library and, where the name encodes them, the
tile shape, K-tile and stages, cluster shape and split-K; :func:`summarize` gives the short text
of the report (``nvjet 32x64 (no split-K)``, ``nvjet 64x8 split-K + splitKreduce``).

:func:`torch_gemm` names the library torch runs its GEMMs on for a device and dtype (cuBLAS, oneDNN,
MKL, ATen's own CPU GEMM), probed once per process (oneDNN's verbose mode: :func:`onednn_verbose`):
the engines' numeric contracts name it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections import Counter
from typing import Any, Iterator

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from tracer.execute.handles import Hooks

#: aten ops that move no numbers (views, allocation, metadata): never reported as kernels
_TRIVIAL = frozenset(f"aten::{n}" for n in (
    "as_strided", "transpose", "t", "expand", "view", "reshape", "_reshape_alias", "empty", "empty_like",
    "empty_strided", "resolve_conj", "resolve_neg", "detach", "detach_", "alias", "slice", "select", "unsqueeze",
    "squeeze", "permute", "lift_fresh", "_unsafe_view", "unbind", "split", "narrow", "chunk", "view_as",
    "expand_as", "size", "stride", "is_nonzero", "item", "_local_scalar_dense", "result_type", "contiguous",
    "split_with_sizes", "movedim", "flatten", "unflatten", "_has_compatible_shallow_copy_type", "zeros",
    "zero_", "fill_", "arange", "full", "ones", "new_empty", "new_zeros", "scalar_tensor", "to", "dropout",
    "lift", "numpy_T", "matrix_H", "mT", "mH", "adjoint", "as_strided_", "set_", "record_stream",
))
#: ops reported as one kernel without looking inside (their children are their implementation)
_LEAF = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_addmm_activation|_scaled_dot_product_\w+|_efficient_attention_\w+|"
                   r"_flash_attention_\w+|mkldnn_\w+|_mkldnn_\w+|_weight_int\w+|copy_|_to_copy|softmax|_softmax|"
                   r"mul|add|sub|div|pow|rsqrt|mean|silu|gelu|tanh|exp|embedding|index_select|cat|where|"
                   r"masked_fill|matmul_\w+|linear_\w+)$")
_RANGE = "tracer:"
_SKIP = "tracer-capture"


class KernelRecorder(Hooks):
    """Context manager: profile one run and attribute kernels to capture points.

    Args:
        model: the HF model the :class:`~tracer.execute.capture.Capture` ``capture`` is hooked on.
        points: the capture points (:func:`tracer.execute.points.discover_points`).
        capture: the entered Capture; only forward calls it declared (``capture._call`` set) are
            recorded, so the k-th recorded firing matches the k-th entry of a record's ``calls``.

    Enter it after the Capture (its hooks must run after the capture's in the hook order). Costs
    the profiler's per-op overhead while active (measured in the README: a few percent on the CPU).

    Attributes:
        custom_ops: (class attribute) torch custom-op names counted as compute ops like aten's (an
            engine's recorder sets its own namespaces: on the CPU they are its GEMM and attention
            kernels); None: aten's only.
    """

    custom_ops: re.Pattern | None = None

    def __init__(self, model: nn.Module, points: list[Any], capture: Any) -> None:
        self.model, self.points, self.capture = model, list(points), capture
        mods: dict[str, None] = {}
        for p in self.points:
            if p.which == "cache":
                continue
            if p.which == "input" and "." in p.module:
                mods[p.module.rsplit(".", 1)[0]] = None  # the parent runs the op whose result it is
            mods[p.module] = None
        self.modules = list(mods)
        super().__init__()
        self._open: dict[str, list[Any]] = {}
        self._skip: dict[str, list[Any]] = {}
        self._firings: dict[str, list[tuple[str, list[int]]]] = {m: [] for m in self.modules}
        self._prof: Any = None
        self.ranges: dict[str, dict[str, Any]] = {}  # label -> {"device": Counter, "ops": Counter, "own_*"}

    def install(self) -> None:
        """Hook every module of the points (before and after the capture's own hook), then start the profiler."""
        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        for path in self.modules:
            m = self.model.get_submodule(path)
            self.hook(m, self._pre(path), pre=True)
            self.hook(m, self._post(path), prepend=True, always_call=True)
            self.hook(m, self._after_capture(path), always_call=True)
        self._prof = profile(activities=acts)
        with _quiet_stderr():
            self._prof.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.remove()
        for stack in list(self._open.values()) + list(self._skip.values()):
            while stack:
                stack.pop().__exit__(None, None, None)
        if self._prof is not None:
            with _quiet_stderr():
                self._prof.__exit__(None, None, None)
            if exc[0] is None:
                self._collect()

    def _pre(self, path: str):
        def hook(module: nn.Module, args: tuple) -> None:
            call = self.capture._call
            if call is None:
                return
            label = f"{_RANGE}{path}#{len(self._firings[path])}"
            self._firings[path].append((label, [call[0], call[1]]))
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            self._open.setdefault(path, []).append(rf)
        return hook

    def _post(self, path: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            stack = self._open.get(path)
            if stack:
                stack.pop().__exit__(None, None, None)
                rf = torch.profiler.record_function(_SKIP)
                rf.__enter__()
                self._skip.setdefault(path, []).append(rf)
        return hook

    def _after_capture(self, path: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            stack = self._skip.get(path)
            if stack:
                stack.pop().__exit__(None, None, None)
        return hook

    def _collect(self) -> None:
        for node in _event_tree(self._prof):
            if node.name.startswith(_RANGE):
                _walk_range(node, self.ranges, self.custom_ops)

    def attach(self, records: dict[str, Any]) -> None:
        """Add ``kernels`` to every call of every record (in place; copies the call dicts).

        A point's k-th call gets the k-th recorded firing of its module with the same positions;
        ``attention_core`` / ``mlp_hidden`` points get their parent module's own kernels.
        """
        for p in self.points:
            rec = records.get(p.name)
            if rec is None or p.which == "cache":
                continue
            own = p.which == "input" and "." in p.module
            module = p.module.rsplit(".", 1)[0] if own else p.module
            rec.calls = self.calls_with_kernels(rec.calls, module, own)

    def calls_with_kernels(self, calls: list[dict[str, Any]], module: str, own: bool = False) -> list[dict[str, Any]]:
        """``calls`` (copied) each with the ``kernels`` of ``module``'s recorded firing at the same
        positions, taken in order (a firing serves one call); ``own``: the module's own kernels,
        not its children's."""
        firings = list(self._firings.get(module, []))
        pick = ("own_device", "own_ops") if own else ("device", "ops")
        out = []
        for call in calls:
            i = next((j for j, (_, pos) in enumerate(firings) if pos == list(call.get("positions", []))), None)
            new = dict(call)
            if i is not None:
                label, _ = firings.pop(i)
                got = self.ranges.get(label, {})
                new["kernels"] = {"device": counted(got.get(pick[0])), "ops": counted(got.get(pick[1]))}
            out.append(new)
        return out


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for the block: the profiler's C++ side prints a line to stderr at
    every start and stop (``USDT: ... profiler_start``) whatever its log level."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (embedded interpreters): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _Node:
    """One CPU event of the profile (an op, a runtime call or a tracer range), its children and the
    device kernels launched by it."""

    __slots__ = ("name", "end", "children", "kernels")

    def __init__(self, name: str, end: int) -> None:
        self.name, self.end = name, end
        self.children: list[_Node] = []
        self.kernels: list[str] = []


def _event_tree(prof: Any) -> list[_Node]:
    """The profile's CPU events as nested nodes (roots returned), from the raw kineto events.

    Nesting is by time on each thread; device kernels (CUDA) are attached to the op whose
    correlation id their ``linked_correlation_id`` names, as torch's own post-processing does
    (``torch.autograd.profiler._parse_kineto_results``), but without building a FunctionEvent
    per event, which costs seconds per run on a model with thousands of ops.
    """
    from torch._C._autograd import DeviceType  # private: imported only when a profile is parsed

    events = prof.profiler.kineto_results.events()
    cpu_type = DeviceType.CPU
    kernels: dict[int, list[str]] = {}
    cpu = []
    for e in events:
        linked = e.linked_correlation_id()
        if e.device_type() != cpu_type:
            kernels.setdefault(linked, []).append(e.name())
        elif linked == 0:
            thread = e.start_thread_id()
            if thread == e.end_thread_id():
                cpu.append((thread, e.start_ns(), -e.end_ns(), e.name(), e.correlation_id()))
    cpu.sort(key=lambda t: t[:3])
    roots: list[_Node] = []
    stack: list[_Node] = []
    current = None
    for thread, start, neg_end, name, corr in cpu:
        if thread != current:
            current, stack = thread, []
        while stack and stack[-1].end <= start:
            stack.pop()
        node = _Node(name, -neg_end)
        node.kernels = kernels.get(corr, [])
        (stack[-1].children if stack else roots).append(node)
        stack.append(node)
    return [n for n in _ranges_outermost(roots)]


def _ranges_outermost(nodes: list[_Node]) -> list[_Node]:
    """The tracer ranges not nested in another tracer range."""
    out: list[_Node] = []
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n.name.startswith(_RANGE):
            out.append(n)
        else:
            todo.extend(n.children)
    return out


def counted(c: Counter | None) -> list[dict[str, Any]]:
    """A counter of kernel (or op) names as ``[{"name", "count"}]`` (the calls' ``kernels`` lists)."""
    return [{"name": n, "count": k} for n, k in (c or Counter()).items()]


def _walk_range(evt: Any, out: dict[str, dict[str, Any]], custom_ops: re.Pattern | None = None) -> tuple[Counter, Counter]:
    """Fill ``out[label]`` for ``evt`` (a tracer range) and every range nested in it; return its
    inclusive (device kernels, ops) counters (``custom_ops``: op names counted as compute ops
    besides aten's, :attr:`KernelRecorder.custom_ops`)."""
    dev, ops, own_dev, own_ops = Counter(), Counter(), Counter(), Counter()

    def visit(e: _Node, own: bool) -> None:
        for child in e.children:
            if child.name == _SKIP:
                continue
            if child.name.startswith(_RANGE):
                d, o = _walk_range(child, out, custom_ops)
                dev.update(d)
                ops.update(o)
                continue
            for k in child.kernels:
                dev[k] += 1
                if own:
                    own_dev[k] += 1
            custom = bool(custom_ops is not None and custom_ops.match(child.name))
            if child.name in _TRIVIAL or not (child.name.startswith("aten::") or custom):
                visit(child, own)
                continue
            if custom or _LEAF.match(child.name) or not any(g.name.startswith("aten::") and g.name not in _TRIVIAL
                                                  for g in child.children):
                ops[child.name] += 1
                if own:
                    own_ops[child.name] += 1
                _kernels_below(child, dev, own_dev if own else None)
            else:
                visit(child, own)

    visit(evt, True)
    out[evt.name] = {"device": dev, "ops": ops, "own_device": own_dev, "own_ops": own_ops}
    return dev, ops


def _kernels_below(e: _Node, dev: Counter, own: Counter | None) -> None:
    for child in e.children:
        for k in child.kernels:
            dev[k] += 1
            if own is not None:
                own[k] += 1
        _kernels_below(child, dev, own)


# -- kernel names --------------------------------------------------------------------------------

_NVJET = re.compile(r"nvjet_(?P<arch>sm\d+)_\w*?_(?P<tm>\d+)x(?P<tn>\d+)_(?P<tk>\d+)x(?P<st>\d+)_(?P<cm>\d+)x(?P<cn>\d+)_")
_XMMA = re.compile(r"(?P<arch>sm\d+)_xmma_gemm_.*?tilesize(?P<tm>\d+)x(?P<tn>\d+)x(?P<tk>\d+)")
_CUTLASS = re.compile(r"cutlass_(?P<arch>\d+)_\w*?gemm\w*?_(?P<tm>\d+)x(?P<tn>\d+)_(?P<tk>\d+)x(?P<st>\d+)_")
_AMPERE = re.compile(r"(?P<arch>ampere|volta|turing|hopper|sm\d+)_\w*?gemm\w*?_(?P<tm>\d+)x(?P<tn>\d+)_.*?stages_(?P<tk>\d+)x(?P<st>\d+)")
_FMHA = re.compile(r"fmha_cutlass[FB]_\w*?_(?P<tm>\d+)x(?P<tn>\d+)")


def parse_kernel(name: str) -> dict[str, Any]:
    """What a kernel's name says about it.

    Args:
        name: a device kernel name as the profiler reports it (possibly a demangled template).

    Returns:
        ``{"name", "family"}`` plus what the name encodes: ``library`` (``cuBLASLt``, ``cuBLAS``,
        ``CUTLASS``, ``flash``, ``efficient``, ``cuDNN``, ``aten``), ``tile`` (``"MxN"`` of the
        output tile), ``k_tile``, ``stages``, ``cluster`` (``"1x2"``), ``split_k`` (True when the
        GEMM splits K, ``"reduce"`` for a split-K reduction kernel, ``segment_k`` for cuBLAS's
        segment-K flag), ``schedule`` (``coop``/``pingpong`` where named), ``variant`` (attention:
        ``flash``, ``flash split-KV``, ``efficient``, ``cudnn``, ``math``). ``family`` is the short
        name used in the report (``nvjet``, ``xmma``, ``cutlass``, ``splitKreduce``, ...).
    """
    out: dict[str, Any] = {"name": name}
    low = name.lower()
    if name.startswith("aten::"):
        out.update(family=name[6:], library="aten")
        if "scaled_dot_product" in name or "attention" in name:
            out["variant"] = ("flash" if "flash" in name else "efficient" if "efficient" in name
                              else "cudnn" if "cudnn" in name else "math" if "math" in name else "?")
        return out
    m = _NVJET.search(name)
    if m:
        out.update(family="nvjet", library="cuBLASLt", arch=m["arch"], tile=f"{m['tm']}x{m['tn']}",
                   k_tile=int(m["tk"]), stages=int(m["st"]), cluster=f"{m['cm']}x{m['cn']}",
                   split_k="splitk" in low)
        if "coop" in low:
            out["schedule"] = "coop"
        elif "pingpong" in low:
            out["schedule"] = "pingpong"
        return out
    if "splitkreduce" in low or "splitk_reduce" in low:
        return dict(out, family="splitKreduce", library="cuBLAS", split_k="reduce")
    m = _XMMA.search(name)
    if m:
        seg = re.search(r"segment_k_(on|off)", low)
        out.update(family="xmma", library="cuBLAS", arch=m["arch"], tile=f"{m['tm']}x{m['tn']}", k_tile=int(m["tk"]))
        st = re.search(r"_stage(\d+)", low)
        if st:
            out["stages"] = int(st.group(1))
        cl = re.search(r"cluster(\d+)x(\d+)", low)
        if cl:
            out["cluster"] = f"{cl.group(1)}x{cl.group(2)}"
        out["split_k"] = bool(seg and seg.group(1) == "on") or "splitk" in low
        if seg:
            out["segment_k"] = seg.group(1) == "on"
        return out
    m = _CUTLASS.search(name)
    if m:
        return dict(out, family="cutlass", library="CUTLASS", arch=f"sm{m['arch']}", tile=f"{m['tm']}x{m['tn']}",
                    k_tile=int(m["tk"]), stages=int(m["st"]), split_k="splitk" in low)
    if "flash" in low and ("fwd" in low or "attention" in low or "fprop" in low) and "cudnn" not in low:
        variant = "flash split-KV" if "splitkv" in low else "flash"
        if "combine" in low:
            variant = "flash split-KV combine"
        return dict(out, family="flash", library="flash", variant=variant)
    m = _FMHA.search(name)
    if m or "memeffattention" in low or "efficient_attention" in low:
        out.update(family="efficient", library="efficient", variant="efficient")
        if m:
            out["tile"] = f"{m['tm']}x{m['tn']}"
        return out
    if "cudnn" in low and ("sdpa" in low or "fmha" in low or "flash" in low or "attention" in low):
        return dict(out, family="cudnn-sdpa", library="cuDNN", variant="cudnn")
    m = _AMPERE.search(name)
    if m:
        return dict(out, family=name.split("_", 1)[0].split("<")[-1].split(" ")[-1], library="cuBLAS",
                    tile=f"{m['tm']}x{m['tn']}", k_tile=int(m["tk"]), stages=int(m["st"]),
                    split_k="splitk" in low, sliced="sliced" in low)
    short = re.sub(r"^void\s+", "", name).split("<")[0].split("(")[0].rsplit("::", 1)[-1]
    return dict(out, family=short or name)


def _kernel_text(k: dict[str, Any]) -> str:
    fam = k.get("family", k["name"])
    if fam == "splitKreduce":
        return "splitKreduce"
    bits = [fam]
    if k.get("tile"):
        bits.append(k["tile"])
    if k.get("library") in ("cuBLASLt", "cuBLAS", "CUTLASS") and k.get("tile"):
        bits.append("split-K" if k.get("split_k") is True else "(no split-K)")
    if k.get("variant") and k.get("library") != "aten":
        bits = [k["variant"]] + bits[1:]
    if k.get("library") == "aten" and k.get("variant"):
        bits = [f"sdpa {k['variant']} ({fam})"]
    return " ".join(bits)


_GEMM_LIBS = ("cuBLASLt", "cuBLAS", "CUTLASS", "flash", "efficient", "cuDNN")


def summarize(kernels: dict[str, Any] | None) -> str:
    """The short text of one call's kernels for the report.

    Device kernels when there are any: the GEMM/attention kernels parsed (``nvjet 64x8 split-K +
    splitKreduce``), other kernels counted (``+ 3 other``); otherwise the compute aten ops
    (``aten::addmm``). ``-`` when nothing was recorded.
    """
    if not kernels:
        return "-"
    dev = kernels.get("device") or []
    if dev:
        parsed = [parse_kernel(k["name"]) for k in dev]
        main = [p for p in parsed if p.get("library") in _GEMM_LIBS]
        parts = list(dict.fromkeys(_kernel_text(p) for p in main))
        rest = sum(k["count"] for k, p in zip(dev, parsed) if p.get("library") not in _GEMM_LIBS)
        if rest:
            parts.append(f"{rest} other" if parts else ", ".join(dict.fromkeys(p["family"] for p in parsed)))
        return " + ".join(parts)
    ops = kernels.get("ops") or []
    if not ops:
        return "-"
    main = [k for k in ops if _MAIN_OP.match(k["name"])]
    shown = main or ops[:3]
    parts = [_op_text(k) for k in shown]
    rest = sum(k["count"] for k in ops if k not in shown)
    return " + ".join(parts + ([f"{rest} other"] if rest else []))


_MAIN_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_addmm_activation|_scaled_dot_product_\w+|_efficient_attention\w*|"
                      r"_flash_attention\w*|mkldnn_\w+|_mkldnn_\w+|matmul)$")


def _op_text(k: dict[str, Any]) -> str:
    name = k["name"]
    if "scaled_dot_product" in name:
        p = parse_kernel(name)
        text = f"sdpa {p.get('variant', '?')}{' (cpu)' if name.endswith('_for_cpu') else ''}"
    else:
        text = name[6:] if name.startswith("aten::") else name
    return text + (f" ×{k['count']}" if k["count"] > 1 else "")


def names(kernels: dict[str, Any] | None) -> tuple[tuple[str, ...], str]:
    """``(sorted "name×count" strings, "device"|"ops"|"none")``: what two runs' kernels are compared by."""
    if not kernels:
        return (), "none"
    part = "device" if kernels.get("device") else "ops"
    return tuple(sorted(f"{k['name']}×{k['count']}" for k in kernels.get(part) or [])), part


def main_names(kernels: dict[str, Any] | None) -> tuple[tuple[str, ...], str]:
    """Like :func:`names`, restricted to the GEMM and attention kernels (or ops) when the call ran
    any: an origin's class is decided by the kernels that reduce, not by the elementwise ones
    around them (RoPE, cache updates), whose variants change with the shape without changing bits."""
    got, by = names(kernels)
    if by == "device":
        main = tuple(n for n in got if parse_kernel(n.rsplit("×", 1)[0]).get("library") in _GEMM_LIBS)
    else:
        main = tuple(n for n in got if _MAIN_OP.match(n.rsplit("×", 1)[0]))
    return (main or got), by


def rows(kernels: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every kernel of one call with its count and parsed fields (the JSON ``kernels_a/b`` rows)."""
    if not kernels:
        return []
    src = kernels.get("device") or kernels.get("ops") or []
    return [dict(parse_kernel(k["name"]), count=k["count"],
                 device="cuda" if kernels.get("device") else "cpu") for k in src]
