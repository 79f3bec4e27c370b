"""Recipes are data: nothing a recipe names is imported or called unless it is a known assemble hook
of a known package, and a GGUF of another architecture is refused before anything is cached."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tracer.errors import TracerError

ROOT = Path(__file__).resolve().parents[2]


def _load_recipe_in_a_subprocess(tmp_path: Path, package: str, module: str, assemble: str) -> subprocess.CompletedProcess:
    """``load_model`` of a GGUF recipe with this ``assemble``, in a child process (a regression
    that calls ``os.abort`` kills the child, not the test run)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "bad.toml").write_text(
        f'name = "bad"\nkind = "gguf"\ndescription = "d"\npackage = "{package}"\nmodule = "{module}"\n'
        f'file = "x.gguf"\nassemble = "{assemble}"\n')
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from pathlib import Path\n"
            "import tracer.load.recipes as R\n"
            f"R.data_dir = lambda kind: Path({str(tmp_path / 'models')!r})\n"
            "from tracer.errors import TracerError\n"
            "from tracer.load.models import load_model\n"
            "try:\n"
            "    load_model('bad', device='cpu', progress=False)\n"
            "except TracerError as e:\n"
            "    print('refused:', e)\n"
            f"print('imported:', {module!r} in sys.modules)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_an_assemble_of_os_abort_is_refused_not_called(tmp_path):
    p = _load_recipe_in_a_subprocess(tmp_path, "os", "os", "abort")
    assert p.returncode == 0, (p.returncode, p.stderr)  # -6 would be SIGABRT
    assert "refused: recipe" in p.stdout and "'abort' of module 'os' is not an assemble hook tracer knows" in p.stdout


def test_an_unknown_assemble_is_refused_before_its_module_is_imported(tmp_path):
    p = _load_recipe_in_a_subprocess(tmp_path, "this", "this", "assemble")
    assert p.returncode == 0, p.stderr
    assert "refused: recipe" in p.stdout and "imported: False" in p.stdout
    assert "Beautiful is better than ugly" not in p.stdout  # the import side effect of `this` never ran


def test_the_known_assemble_hook_is_allowed():
    from tracer.load.gguf import ASSEMBLE_HOOKS, check_assemble
    from tracer.load.recipes import recipes

    gemma = recipes()["gemma3-270m"]
    check_assemble(gemma)  # the one hook tracer ships a recipe for
    assert (gemma.data["package"], gemma.data["module"], gemma.data["assemble"]) in ASSEMBLE_HOOKS


def test_a_gguf_of_another_architecture_is_refused_before_caching(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from tests.load.test_gguf import tiny_qwen3, write_gguf

    from tracer.load.models import load_model

    path = write_gguf(tiny_qwen3(), tmp_path / "qwen3.gguf")
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRACER_CACHE_DIR", str(cache))
    with pytest.raises(TracerError, match=r"holds a qwen3 model, but smollm2-135m is llama"):
        load_model("smollm2-135m", gguf=str(path), device="cpu", progress=False)
    assert not cache.exists() or list(cache.iterdir()) == []  # nothing of it was cached


def test_gguf_recipe_declares_its_architecture():
    from tracer.load.recipes import recipes

    table = recipes()
    assert table["smollm2-135m"].data["model_type"] == "llama"
    assert table["gemma3-270m"].data["model_type"] == "gemma3_text"


def test_a_broken_recipe_file_is_an_error_only_for_its_own_recipe(tmp_path, monkeypatch, capsys):
    """Issue 37 item 10: one bad recipe file (zz3.toml, invalid TOML) made every model unusable
    ('tracer run tiny-llama' failed on zz3.toml's error). It is that recipe's error when it is used,
    and otherwise one warning line while the other recipes work."""
    import shutil

    import tracer.load.recipes as R
    from tracer.load.models import load_model
    from tracer.load.preflight import check_model

    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(R.data_dir("models") / "tiny-llama.toml", models)
    (models / "zz3.toml").write_text('name = "zz3"\nkind = "random-init"\ndescription = "broken"\n[config\n')
    monkeypatch.setattr(R, "data_dir", lambda kind: models)
    monkeypatch.setattr(R, "_WARNED", set())
    loaded = load_model("tiny-llama", device="cpu", progress=False)
    assert loaded.info.name == "tiny-llama"
    err = capsys.readouterr().err
    assert err.count("warning: recipe") == 1 and "zz3.toml is not valid TOML" in err and "'zz3' is skipped" in err
    for call in (lambda: load_model("zz3", device="cpu", progress=False), lambda: check_model("zz3")):
        with pytest.raises(TracerError, match=r"zz3.toml is not valid TOML") as e:
            call()
        assert "\n" not in str(e.value)
    assert list(R.recipes()) == ["tiny-llama"]
