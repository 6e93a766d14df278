"""Re-execute chapters in place, the way the book shows them: `python tools/execute_notebooks.py [NOTEBOOK ...]`
(default: every notebook). Cells run in the notebook's folder with the installed `python3` kernel, whose name and
display name are stored, so that JupyterLab opens the file unmodified. Run through `make execute`.
`--cells ID,ID` runs every cell but stores the new outputs of the named cells only: the others keep the outputs
their prose quotes (timings on a loaded CPU move between runs; tests/test_prose_numbers.py reads what is stored)."""
import copy
import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path, only_cells=None):
    start = time.perf_counter()
    notebook = nbformat.read(path, as_version=4)
    # copies: the preprocessor writes new timestamps into each cell's metadata in place
    stored = {cell.id: copy.deepcopy((cell.get("outputs"), cell.get("execution_count"), cell.metadata))
              for cell in notebook.cells}
    missing = set(only_cells or ()) - set(stored)
    if missing:                                  # before the run, which can take minutes
        raise SystemExit(f"{path.name}: no cell with id {', '.join(sorted(missing))}")
    spec = KernelSpecManager().get_kernel_spec("python3")
    notebook.metadata["kernelspec"] = {"display_name": spec.display_name, "language": spec.language,
                                       "name": "python3"}
    ExecutePreprocessor(timeout=1800, kernel_name="python3").preprocess(notebook, {"metadata": {"path": str(path.parent)}})
    if only_cells is not None:
        for cell in notebook.cells:
            if cell.cell_type == "code" and cell.id not in only_cells:
                cell.outputs, cell.execution_count, cell.metadata = stored[cell.id]
    nbformat.write(notebook, path)
    print(f"{path.relative_to(ROOT)}: executed in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    only = None
    if "--cells" in args:
        i = args.index("--cells")
        only, args = set(args[i + 1].split(",")), args[:i] + args[i + 2:]
    paths = [Path(p).resolve() for p in args] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        execute(path, only)
