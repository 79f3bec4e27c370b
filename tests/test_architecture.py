"""The pipeline's shape: no import cycle inside ``tracer/`` (function-local imports counted), no
function over 120 lines, importing ``tracer`` loads no heavy library, the public API shows real
signatures, kinds are PointKinds, annotations resolve, and the tests mirror the package."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "tracer"
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _resolve(target: str, mods: dict[str, Path]) -> str | None:
    """The module of ours an import names (``tracer.x.y.Name`` → ``tracer.x.y``), or None."""
    while target and target not in mods:
        target = target.rpartition(".")[0]
    return target if target and target != "tracer" else None


def import_graph() -> dict[str, set[str]]:
    """Module → modules of ``tracer`` it imports anywhere in its body (functions included)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                r = _resolve(t, mods)
                if r is not None and r != mod:
                    graph[mod].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_detector_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_function_local_imports_included():
    graph = import_graph()
    assert len(graph) > 20 and graph["tracer.pipeline"], "the walk must see the package"
    assert "tracer.diff.compare" in graph["tracer.pipeline"]  # a function-local import is an edge
    assert cycles(graph) == []


def test_stages_depend_downward():
    """Each module ranks at the stage of its longest matching prefix: the table of engines is read by
    every stage (ground floor); the synthetic engine dumps are written from a stored trace."""
    order = ["tracer.errors", "tracer.watchdog", "tracer.schema_fields", "tracer.schema", "tracer.files", "tracer.dtypes", "tracer.progress", "tracer.engines.table",
             "tracer.load", "tracer.plan", "tracer.execute", "tracer.engines", "tracer.store",
             "tracer.engines.dumps.sglang_writer", "tracer.engines.dumps.megatron_writer",
             "tracer.diff", "tracer.report", "tracer.config_help", "tracer.config", "tracer.validate", "tracer.run_result", "tracer.prompt_checks", "tracer.pipeline",
             "tracer.loops", "tracer.api_files", "tracer.api_capture", "tracer.api", "tracer.cli_exit", "tracer.cli_parser",
             "tracer.cli"]

    def rank(mod: str) -> int:
        return max((len(stage), i) for i, stage in enumerate(order) if mod == stage or mod.startswith(stage + "."))[1]

    upward = [(m, t) for m, ts in import_graph().items() if m not in ("tracer", "tracer.__main__")
              for t in ts if rank(t) > rank(m)]
    assert upward == []


#: the orchestration: what runs, stores and compares; results leave it as data, for report/ to render
ORCHESTRATION = ("tracer.pipeline", "tracer.run_result", "tracer.loops", "tracer.diff", "tracer.store",
                 "tracer.execute", "tracer.engines", "tracer.plan", "tracer.load")


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for t in graph[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_the_orchestration_does_not_import_the_renderer():
    """Nothing under the orchestration imports tracer/report/, directly or through another module
    (function-local imports counted): results are data, and report/ renders them."""
    graph = import_graph()
    orchestration = [m for m in graph if m in ORCHESTRATION or m.startswith(tuple(f"{o}." for o in ORCHESTRATION))]
    assert "tracer.pipeline" in orchestration and "tracer.loops.audit" in orchestration
    bad = {m: sorted(t for t in _reachable(graph, m) if t == "tracer.report" or t.startswith("tracer.report."))
           for m in orchestration}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_the_renderer_check_sees_an_import_of_report():
    """The check above on a planted graph: an import of report/ through another module is found."""
    graph = {"tracer.pipeline": {"tracer.run_result"}, "tracer.run_result": {"tracer.report.tables"},
             "tracer.report.tables": set()}
    assert _reachable(graph, "tracer.pipeline") == {"tracer.run_result", "tracer.report.tables"}


def test_no_function_over_the_limit():
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_import_tracer_loads_no_heavy_library():
    code = "import sys, tracer; print(sorted(m for m in ('torch', 'transformers', 'h5py', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("name, must", [
    ("run", ("scenario", "tp", "granularity", "store", "fail_on", "verdict", "length")),
    ("audit", ("levels", "length", "granularity", "tp")),
    ("sweep", ("lengths", "block_sizes", "scenario", "granularity")),
    ("compare", ("a", "b", "atol")),
    ("capture", ("model", "points")),
])
def test_public_api_has_real_signatures(name, must):
    import tracer

    params = inspect.signature(getattr(tracer, name)).parameters
    assert all(m in params for m in must)
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values())


KIND_VALUES = frozenset({"embedding", "layer", "final_norm", "logits", "linear", "norm", "attention", "attention_core",
                         "mlp", "mlp_hidden", "activation", "kv_cache", "module"})


def bare_kinds(source: str) -> list[str]:
    """Bare-string capture-point kinds in ``source``: a comparison of an expression naming a kind
    (``p.kind``, ``info["kind"]``, ``kinds[i]``, ``k`` in a loop over ``kinds``) with a string that is
    a kind's value, and ``kind="..."`` arguments. ``tracer.execute.kinds.PointKind`` says it instead."""
    tree = ast.parse(source)
    loop_vars = {t.id for node in ast.walk(tree) if isinstance(node, ast.comprehension | ast.For)
                 and "kind" in ast.unparse(node.iter) for t in ast.walk(node.target) if isinstance(t, ast.Name)}

    def kindish(n: ast.AST) -> bool:
        text = ast.unparse(n)
        return "kind" in text.lower() or (isinstance(n, ast.Name) and n.id in loop_vars)

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(kindish(s) for s in sides):
                out += [f"line {node.lineno}: {ast.unparse(node)}" for s in sides if not kindish(s)
                        for c in ast.walk(s) if isinstance(c, ast.Constant) and c.value in KIND_VALUES]
        elif isinstance(node, ast.keyword) and node.arg and "kind" in node.arg and isinstance(node.value, ast.Constant) \
                and node.value.value in KIND_VALUES:
            out.append(f"line {node.lineno}: {node.arg}={node.value.value!r}")
    return out


def test_the_kind_detector_finds_bare_strings():
    for src in ('x = [p for p in points if p.kind == "layer"]', 'ok = info["kind"] in ("logits", "norm")',
                'y = [i for i, k in enumerate(kinds) if k != "kv_cache"]', 'CapturePoint(name=n, kind="module")'):
        assert bare_kinds(src), src
    assert not bare_kinds('x = [p for p in points if p.kind == PointKind.LAYER]; recipe.kind == "gguf"')


def test_point_kinds_are_compared_as_point_kinds():
    found = {str(p.relative_to(PKG.parent)): bare_kinds(p.read_text()) for p in PKG.rglob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


def _namespaces():
    """Each module of tracer (an optional engine's that cannot import here left out) with its
    globals plus what its ``if TYPE_CHECKING:`` block imports."""
    import importlib
    import pkgutil

    import tracer

    for m in pkgutil.walk_packages(tracer.__path__, "tracer."):
        if m.name.endswith("__main__"):
            continue
        try:
            mod = importlib.import_module(m.name)
        except ModuleNotFoundError as e:  # vllm is not installed here
            if (e.name or "tracer").startswith("tracer"):
                raise
            continue
        if not getattr(mod, "__file__", None):
            continue
        ns = dict(vars(mod))
        for node in ast.parse(Path(mod.__file__).read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                exec(compile(ast.Module(node.body, []), mod.__file__, "exec"), ns)
        yield mod, ns


def test_every_annotation_names_a_real_type():
    """Annotations are strings (``from __future__ import annotations``) that no run evaluates: each
    must resolve against its module and its ``TYPE_CHECKING`` imports, or it documents nothing."""
    import typing

    bad = []
    for mod, ns in _namespaces():
        for name, obj in vars(mod).items():
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj):
                items = [(name, obj, ns)]
            elif inspect.isclass(obj):  # a class's bases resolve in their own modules
                items = [(name, obj, None)] + [(f"{name}.{k}", v, ns) for k, v in vars(obj).items()
                                              if inspect.isfunction(v)]
            else:
                continue
            for label, x, g in items:
                try:
                    typing.get_type_hints(x, globalns=g, localns=ns)
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    bad.append(f"{mod.__name__}.{label}: {e}")
    assert bad == []


def test_the_public_api_says_what_it_returns():
    import typing

    import tracer
    import tracer.api as api

    ns = dict(next(ns for mod, ns in _namespaces() if mod is api))
    for name in api.__all__:
        ret = typing.get_type_hints(getattr(tracer, name), globalns=ns).get("return")
        assert ret is not None and ret is not typing.Any, name


def test_the_core_record_types_are_exported_and_import_on_first_use():
    code = ("import sys, tracer; light = not any(m in sys.modules for m in ('torch', 'numpy', 'h5py')); "
            "types = {n: getattr(tracer, n) for n in tracer.RECORD_TYPES}; "
            "print(light, all(t.__name__ == n and t.__module__ == tracer.RECORD_TYPES[n] for n, t in types.items()), "
            "set(tracer.RECORD_TYPES) <= set(tracer.__all__) <= set(dir(tracer)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout.split()
    assert out == ["True", "True", "True"]
    from tracer import schema

    import tracer

    records = {c.__name__ for c in schema.Record.__subclasses__()}
    assert {"Comparison", "PointResult", "RLComparison", "Audit", "SweepResult", "BenchResult"} <= records & set(tracer.RECORD_TYPES)


TESTS = Path(__file__).resolve().parent
STAGE_FOLDERS = ("load", "plan", "execute", "engines", "store", "diff", "report", "loops")
#: top-level test files: the top-level modules of tracer (api, cli, config, pipeline, schema) and what
#: spans the package (its architecture, the docs and README, the notebooks)
TOP_LEVEL = ("test_architecture.py", "test_docs.py", "test_notebooks.py", "test_readme.py")
#: words that say when or why a test was written, not what it covers
NOT_A_SUBJECT = re.compile(r"(^|_)(issue\d*|fixes|breaker|misc|more|new|extra|regressions?)(_|$)")


def misplaced_tests(root: Path) -> list[str]:
    """Test files that do not mirror the package: ``tests/<stage>/test_<module>[_aspect].py`` for a
    module (or subpackage) of ``tracer/<stage>/``, ``tests/test_<module>[_aspect].py`` for a top-level
    module of tracer, or one of :data:`TOP_LEVEL`; each folder a package (``__init__.py``)."""
    bad = []
    top_modules = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) == 1:
            if rel.name in ("__init__.py", "conftest.py", "helpers.py") or rel.name in TOP_LEVEL:
                continue
            ok = rel.name.startswith("test_") and any(rel.stem == f"test_{m}" or rel.stem.startswith(f"test_{m}_")
                                                      for m in top_modules)
        elif len(rel.parts) == 2 and rel.parts[0] in STAGE_FOLDERS:
            if rel.name in ("__init__.py", "conftest.py"):  # a folder's shared fixtures
                continue
            stage = PKG / rel.parts[0]
            modules = {p.stem for p in stage.glob("*.py")} | {p.name for p in stage.iterdir() if (p / "__init__.py").exists()}
            ok = (root / rel.parts[0] / "__init__.py").exists() and any(
                rel.stem == f"test_{m}" or rel.stem.startswith(f"test_{m}_") for m in modules - {"__init__"})
        else:
            ok = False
        if not ok or NOT_A_SUBJECT.search(rel.stem.removeprefix("test_")):
            bad.append(str(rel))
    return bad


def test_the_layout_check_finds_misplaced_tests(tmp_path):
    for name in ("test_breaker_fixes.py", "store/test_trace.py", "diff/test_nothing_here.py", "deep/er/test_x.py",
                 "test_cli.py", "test_cli_issue3.py", "test_api_errors.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "__init__.py").write_text("")
    assert misplaced_tests(tmp_path) == ["deep/er/test_x.py", "diff/test_nothing_here.py", "store/test_trace.py",
                                        "test_breaker_fixes.py", "test_cli_issue3.py"]


def test_tests_mirror_the_package():
    """``tests/<stage>/test_<module>.py``: a test lives beside the tests of the module it covers."""
    assert misplaced_tests(TESTS) == []


# ---------------------------------------------------------------- engines: one folder each, one door, one table

ENGINES_DIR = PKG / "engines"
#: names of engines that are also ordinary words of this code (HF's module names and model source; the
#: tensor-parallel scenario and its --tp option): for them, only a literal that stands for an engine counts
COMMON_WORDS = {"hf", "tp"}
#: the only modules outside tracer/engines/ that may name vLLM, and why (an external source's own words)
VLLM_CITED = {"tracer/plan/hierarchy.py": "the seed's citation of the scheduling fix, vLLM #34046",
              "tracer/plan/rollout.py": "TRL's option vllm_importance_sampling_cap"}


def _engine_rows():
    from tracer.engines.table import ENGINES

    return ENGINES


def _allowed(rel: str, name: str) -> bool:
    """Where an engine's name may appear: its own folder, the table, the dump formats (each named after
    the engine that writes it)."""
    return rel.startswith((f"tracer/engines/{name}/", "tracer/engines/dumps/")) or rel == "tracer/engines/table.py"


def engine_words(source: str, name: str) -> list[str]:
    """Where ``source`` names engine ``name``: for a distinctive name, every identifier, string, docstring
    or comment containing it (any case); for a :data:`COMMON_WORDS` name, a literal of it that stands for
    an engine (compared with, defaulting or assigned to something called ``engine``)."""
    import io
    import tokenize

    if name not in COMMON_WORDS:
        word = re.compile(re.escape(name), re.IGNORECASE)
        return [f"line {t.start[0]}: {t.string.strip()[:60]}" for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type in (tokenize.NAME, tokenize.STRING, tokenize.COMMENT) and word.search(t.string)]
    out = []
    for node in ast.walk(ast.parse(source)):
        lits = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any("engine" in ast.unparse(s) for s in sides):
                lits = [c for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)]
        elif isinstance(node, ast.BoolOp) and any("engine" in ast.unparse(v) for v in node.values):
            lits = [v for v in node.values if isinstance(v, ast.Constant)]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".get") and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "engine":
            lits = node.args[1:]
        elif isinstance(node, ast.keyword) and node.arg and "engine" in node.arg:
            lits = [node.value]
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any("engine" in ast.unparse(t) for t in targets) and node.value is not None:
                lits = [node.value]
        elif isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            pairs = list(zip(args[len(args) - len(node.defaults):], node.defaults)) + list(zip(node.kwonlyargs, node.kw_defaults))
            lits = [d for a, d in pairs if d is not None and "engine" in a.arg]
        out += [f"line {c.lineno}: {ast.unparse(c)}" for c in lits if isinstance(c, ast.Constant) and c.value == name]
    return out


def test_the_engine_name_detector_finds_names():
    assert engine_words('x = "hf"\nif engine == "hf": pass', "hf") == ['line 2: \'hf\'']
    for src in ('e = plan.engine or "hf"', 'm.get("engine", "hf")', 'def f(engine="hf"): pass', 'engine: str = "hf"',
                'run(engine="hf")'):
        assert engine_words(src, "hf"), src
    assert not engine_words('source = "hf"\nhf_cache = 1', "hf")
    for src in ('import vllm', '# vLLM computes', 'x = "VllmCaptured"', 'def f():\n    """a vllm.LLM"""'):
        assert engine_words(src, "vllm"), src


def test_an_engine_name_stays_in_its_folder_and_the_table():
    """An engine's name, as a string or an identifier (any case for a distinctive name), appears only
    in its folder, the engine table and the dump formats; the reference is never re-derived
    (``engine or "hf"``) and no class name is tested as a string."""
    found = {}
    for row in _engine_rows():
        for path in sorted(PKG.rglob("*.py")):
            rel = str(path.relative_to(PKG.parent))
            if _allowed(rel, row.name) or (row.name == "vllm" and rel in VLLM_CITED):
                continue
            hits = engine_words(path.read_text(), row.name)
            if hits:
                found[f"{row.name} in {rel}"] = hits
    assert found == {}


def test_the_vllm_citations_are_the_only_ones_and_still_needed():
    outside = {str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
               if not str(p.relative_to(PKG.parent)).startswith("tracer/engines/") and re.search("vllm", p.read_text(), re.I)}
    assert outside == set(VLLM_CITED)


def test_only_the_door_imports_an_engine_folder():
    """Nothing outside an engine's folder imports it (statically or by importlib) but the door, and an
    engine folder its table row says it builds on."""
    rows = {r.name: r for r in _engine_rows()}
    bad = []
    for mod, targets in import_graph().items():
        for t in targets:
            parts = t.split(".")
            if len(parts) < 3 or parts[:2] != ["tracer", "engines"] or parts[2] not in rows:
                continue
            name, own = parts[2], mod.split(".")[2] if mod.startswith("tracer.engines.") else None
            if mod == "tracer.engines.door" or own == name or (own in rows and rows[own].builds_on == name):
                continue
            bad.append(f"{mod} -> {t}")
    assert bad == []
    importers = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py") if "import_module(" in p.read_text()]
    assert [p for p in importers if p.startswith("tracer/engines/")] == ["tracer/engines/door.py"]


def test_every_engine_row_has_its_folder_and_every_folder_a_row():
    from tracer.engines import door
    from tracer.engines.base import Engine

    rows = {r.name for r in _engine_rows()}
    folders = {p.name for p in ENGINES_DIR.iterdir() if (p / "__init__.py").exists()} - {"dumps"}
    assert folders == rows
    for name in rows:
        eng = door.engine(name)
        assert isinstance(eng, Engine) and eng.name == name and eng.row.name == name


def test_the_pipeline_loops_store_and_diff_reach_engines_through_the_door():
    """Outside tracer/engines/, modules import the door, the table, or the dump formats: no engine
    folder, no engine internals (tp's ranks, vLLM's engine) by a side door."""
    allowed = ("tracer.engines.door", "tracer.engines.table", "tracer.engines.base", "tracer.engines.dumps")
    bad = [f"{m} -> {t}" for m, ts in import_graph().items() if not m.startswith("tracer.engines")
           for t in ts if t.startswith("tracer.engines") and t != "tracer.engines" and not t.startswith(allowed)]
    assert bad == []
