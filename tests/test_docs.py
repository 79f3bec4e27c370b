"""Docs that cannot drift: every file path and dotted name the docs and the package's own strings
mention resolves, and every module has its row in the README's layout table.

Checked: ``README.md``, ``traces/README.md``, ``hooks/README.md``, ``models/README.md``,
``scripts/README.md`` (which lists every script, and only scripts that exist) and
``docs/ARCHITECTURE.md`` (their inline code and link targets, fenced blocks excepted: those are
commands and sample output), and every string constant in ``tracer/`` (docstrings and error
messages). A path counts when its first part is a folder of this repository (``tracer/...``,
``hooks/...``); ``<placeholders>`` and globs must match at least one file. A dotted name counts when
it starts with ``tracer.`` or, in the docs, with a module or stage of the package (``pipeline.run``,
``diff.compare.compare_records``); it must import and resolve attribute by attribute.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "tracer"
DOCS = ("README.md", "traces/README.md", "hooks/README.md", "models/README.md", "scripts/README.md",
        "docs/ARCHITECTURE.md")
#: folders a path in the docs may start with
TOP = frozenset(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
#: the package's modules and stages: a dotted name in the docs may start with one (``pipeline.run``)
STAGES = frozenset(p.stem for p in PKG.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()) - {"__init__"}
#: dotted names in the docs that are the model's Hugging Face config (``config.json``, ``config.model_type``),
#: not :mod:`tracer.config`
HF_CONFIG = frozenset({"config.json", "config.dtype", "config.layer_types", "config.model_type"})
PATH = re.compile(r"[A-Za-z0-9_.*<>-]+(?:/[A-Za-z0-9_.*<>-]*)+")
DOTTED = re.compile(r"(?<![\w./-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def inline_code(text: str) -> list[str]:
    """The inline code spans and link targets of a markdown text (fenced blocks left out)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)#\s]+)", text)


def paths_in(text: str) -> set[str]:
    """Repository paths in ``text``: tokens of the form ``folder/...`` whose folder is one of :data:`TOP`."""
    return {m.rstrip(".,:;") for m in PATH.findall(text) if m.split("/")[0] in TOP}


def path_exists(path: str, base: Path) -> bool:
    """``path`` (relative to the repository or to ``base``) exists; a glob matches a file; a path with
    a ``<placeholder>`` (a file a run writes, ``traces/<model>-audit.h5``) has an existing folder."""
    if "<" in path:
        path = path[:path.index("<")].rpartition("/")[0] or "."
    for root in (ROOT, base):
        if (root / path).exists() or ("*" in path and any(root.glob(path))):
            return True
    return False


def resolves(name: str) -> bool:
    """``name`` imports as a module, or as attributes of the longest module prefix (a dataclass
    field without a default and a class attribute declared by annotation count)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("tracer"):  # an optional engine's module (vllm) not installed
                return True
            continue
        for attr in parts[i:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and (attr in getattr(obj, "__dataclass_fields__", {})
                                            or attr in getattr(obj, "__annotations__", {})):
                return attr == parts[-1]
            else:
                return False
        return True
    return False


def doc_names(text: str) -> set[str]:
    """Dotted names of the package in a doc's inline code: ``tracer.x.y`` and ``stage.module.name``."""
    out = set()
    for code in inline_code(text):
        for m in DOTTED.findall(code):
            m = m.rstrip(".")
            if m.startswith("tracer."):
                out.add(m)
            elif m.split(".")[0] in STAGES and m not in HF_CONFIG and not re.search(r"\.(py|toml|md|h5|json)$", m):
                out.add(f"tracer.{m}")
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc):
    path = ROOT / doc
    missing = [p for code in inline_code(path.read_text()) for p in paths_in(code) if not path_exists(p, path.parent)]
    assert missing == []


@pytest.mark.parametrize("doc", DOCS)
def test_every_dotted_name_a_doc_names_resolves(doc):
    names = doc_names((ROOT / doc).read_text())
    assert [n for n in sorted(names) if not resolves(n)] == []


def test_every_file_colon_name_resolves():
    """``tracer/cli.py: run_cmd`` in the docs: the module defines the name."""
    bad = []
    for doc in DOCS:
        for code in inline_code((ROOT / doc).read_text()):
            for file, name in re.findall(r"(tracer/[\w/]+\.py): ?([A-Za-z_]\w*)", code):
                mod = file[:-3].replace("/", ".").removesuffix(".__init__")
                if not resolves(f"{mod}.{name}"):
                    bad.append(f"{doc}: {file}: {name}")
    assert bad == []


def _package_strings():
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield path.relative_to(ROOT), node.lineno, node.value


def test_every_name_and_path_in_the_packages_strings_resolves():
    """Docstrings and error messages: ``tracer.x.y`` resolves, ``hooks/README.md`` exists (a path to
    source or docs: ``.py``, ``.md``, ``.toml`` or a folder)."""
    bad = []
    for where, line, text in _package_strings():
        for name in set(re.findall(r"(?<![\w./-])tracer(?:\.[A-Za-z_]\w*)+", text)):
            if not resolves(name.rstrip(".")):
                bad.append(f"{where}:{line}: {name}")
        for p in paths_in(text):  # the source and docs named (an example's output file need not exist)
            if p.endswith((".py", ".md", ".toml", "/")) and not path_exists(p, ROOT):
                bad.append(f"{where}:{line}: {p}")
    assert bad == []


def test_the_checks_catch_what_they_are_for():
    assert not resolves("tracer.tp_dist.execute_plan") and resolves("tracer.engines.tp.dist.execute_loaded")
    assert not resolves("tracer.diff.result.Comparison.no_such_field") and resolves("tracer.diff.result.Comparison.points")
    assert doc_names("`pipeline.run_scenario`, `config.model_type`, `tracer.run`, `models/README.md`") == {
        "tracer.pipeline.run_scenario", "tracer.run"}
    assert paths_in("see hooks/README.md and tracer/no/such.py, not a/b") == {"hooks/README.md", "tracer/no/such.py"}
    assert not path_exists("tracer/no/such.py", ROOT) and not path_exists("hooks/*.nothing", ROOT)
    assert path_exists("hooks/*.toml", ROOT) and path_exists("traces/<model>-audit.h5", ROOT)
    assert not path_exists("tracer/nowhere/<x>.py", ROOT)


def layout_table() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("\n## Layout"):text.index("\n### How a run flows")]


def test_every_script_is_listed_once_in_the_scripts_readme():
    """``scripts/README.md`` is the one list of the scripts: each file there is linked, each link is a file."""
    folder = ROOT / "scripts"
    linked = re.findall(r"\]\(([^)#\s/]+)\)", (folder / "README.md").read_text())
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "README.md")
    assert sorted(set(linked)) == files and len(linked) == len(set(linked))


def test_every_module_is_in_the_readme_layout_table():
    table = layout_table()
    named = set(re.findall(r"`(tracer/[\w/]+\.py)`", table))
    folders = set(re.findall(r"`(tracer/[\w/]+/)`", table))
    modules = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if m not in named and not any(m.startswith(f) for f in folders)] == []
    assert [n for n in named if not (ROOT / n).exists()] == []


#: the longest prose line of README.md (fenced blocks, tables and headings aside)
PROSE_WIDTH = 100


def test_readme_prose_lines_fit_100_columns():
    """README prose had lines of up to 462 characters in a source that wraps at ~100. A longer line
    is allowed only when it is one unbreakable piece (after its indent and list marker): a command
    in backticks (a test reads each from one line), or a link or code span without spaces."""
    fence, long = False, []
    for n, line in enumerate((ROOT / "README.md").read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence or line.lstrip().startswith("|") or line.startswith("#") or len(line) <= PROSE_WIDTH:
            continue
        body = re.sub(r"^\s*(?:[-*]|\d+\.)?\s*", "", line)
        one_piece = re.fullmatch(r"[(\[]?`(?:tracer|torchrun|python|pip|git) [^`]*`[.,;:)]*", body) or " " not in body.strip()
        if not one_piece:
            long.append(f"README.md:{n}: {len(line)} characters")
    assert not long, long
