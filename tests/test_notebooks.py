"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, draws at
least one plot, and is saved with the outputs it produces now.

``make notebooks`` (``python tests/test_notebooks.py``) re-executes them and
saves the outputs; a cell edited without re-saving fails here.
"""

import pathlib
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def execute(path: pathlib.Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    return notebook


def _kinds(cell) -> list[str]:
    kinds = []
    for output in cell.get("outputs", []):
        kinds += [output["output_type"]] + sorted(output.get("data", {}))
    return kinds


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if "text" in o)


def _same_text(saved: str, now: str) -> bool:
    """Equal words, numbers equal to 3 significant digits (they are printed rounded)."""
    if NUMBER.sub("#", saved) != NUMBER.sub("#", now):
        return False
    pairs = zip(NUMBER.findall(saved), NUMBER.findall(now), strict=True)
    return all(abs(float(a) - float(b)) <= 1e-3 * max(abs(float(b)), 1e-6) for a, b in pairs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_plots_and_is_saved_fresh(path):
    saved = nbformat.read(path, as_version=4)
    executed = execute(path)
    errors = [
        output
        for cell in executed.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors
    cells = [
        (s, e) for s, e in zip(saved.cells, executed.cells, strict=True) if s.cell_type == "code"
    ]
    assert any("image/png" in _kinds(e) for _, e in cells), f"{path.name} draws no plot"
    for i, (was, now) in enumerate(cells):
        where = f"{path.name}, code cell {i}: saved outputs are stale (make notebooks)"
        assert _kinds(was) == _kinds(now), where
        assert _same_text(_text(was), _text(now)), f"{where}\n{_text(was)}\n---\n{_text(now)}"


if __name__ == "__main__":
    for path in NOTEBOOKS if len(sys.argv) == 1 else [pathlib.Path(a) for a in sys.argv[1:]]:
        nbformat.write(execute(path), path)
        print("saved", path.name)
