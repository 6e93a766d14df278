"""Re-execute chapters in place, the way the book shows them: `python tools/execute_notebooks.py [NOTEBOOK ...]`
(default: every notebook). Cells run in the notebook's folder with the installed `python3` kernel, whose name and
display name are stored, so that JupyterLab opens the file unmodified. Run through `make execute`."""
import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path):
    start = time.perf_counter()
    notebook = nbformat.read(path, as_version=4)
    spec = KernelSpecManager().get_kernel_spec("python3")
    notebook.metadata["kernelspec"] = {"display_name": spec.display_name, "language": spec.language,
                                       "name": "python3"}
    ExecutePreprocessor(timeout=1800, kernel_name="python3").preprocess(notebook, {"metadata": {"path": str(path.parent)}})
    nbformat.write(notebook, path)
    print(f"{path.relative_to(ROOT)}: executed in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    paths = [Path(p).resolve() for p in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        execute(path)
