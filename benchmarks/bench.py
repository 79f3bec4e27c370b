"""tracer's performance benchmark (issue 6): the same command as ``tracer bench``.

    python benchmarks/bench.py [MODEL] --length 1024 --device cpu --reps 5 [--no-kv-cache] [--json > OUT.json]

See tracer/bench.py for what each mode measures, and ``--help`` for every option.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import typer  # noqa: E402

from tracer.cli import app  # noqa: E402

if __name__ == "__main__":
    typer.main.get_command(app).commands["bench"].main(sys.argv[1:], prog_name="python benchmarks/bench.py")
