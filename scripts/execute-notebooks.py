"""Execute every notebook in notebooks/ in place (outputs saved), as committed: python scripts/execute-notebooks.py"""

import sys
from pathlib import Path

import nbclient
import nbformat

root = Path(__file__).resolve().parent.parent
for path in sorted((root / "notebooks").glob("*.ipynb")):
    if len(sys.argv) > 1 and not any(a in path.name for a in sys.argv[1:]):
        continue
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=900,
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    print("executed", path.name, flush=True)
