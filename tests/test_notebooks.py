"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, draws at
least one plot, and is saved with the outputs it produces now.

``make notebooks`` (``python tests/test_notebooks.py``) re-executes them and
saves the outputs; a cell edited without re-saving fails here.

Printed numbers are compared (to 3 significant digits) only on the kind of
CPU that saved the notebook: XLA:CPU compiles for the instruction set it
finds, so training that is not exact mode ends elsewhere with other
rounding, grown by the steps (measured: notebook 04's final loss 0.00627 on
one CPU, 0.00634 on an AVX2-only AMD EPYC). Elsewhere the words, the
output kinds and the plots are compared.
"""

import pathlib
import platform
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
SPACE = re.compile(r"[ \t]+")


def cpu_kind() -> str:
    """The CPU model and the instruction-set extensions XLA:CPU compiles for."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    isa = sorted(f for f in (flags.group(1).split() if flags else []) if f.startswith(ISA))
    return " ".join([platform.machine(), model.group(1) if model else "", *isa]).strip()


ISA = ("avx", "fma", "amx", "sse4", "f16c", "bmi")


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


def _same_text(saved: str, now: str, numbers: bool) -> bool:
    """Equal words, and with ``numbers`` numbers equal to 3 significant digits (printed rounded)."""
    if _words(saved) != _words(now):
        return False
    if not numbers:
        return True
    pairs = zip(NUMBER.findall(saved), NUMBER.findall(now), strict=True)
    return all(abs(float(a) - float(b)) <= 1e-3 * max(abs(float(b)), 1e-6) for a, b in pairs)


def _words(text: str) -> str:
    # numpy pads a printed array's columns to its widest number: "0.0092 " vs "0.00885".
    return SPACE.sub(" ", NUMBER.sub("#", text))


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
    numbers = saved.metadata.get("jdp", {}).get("cpu") == cpu_kind()
    for i, (was, now) in enumerate(cells):
        where = f"{path.name}, code cell {i}: saved outputs are stale (make notebooks)"
        assert _kinds(was) == _kinds(now), where
        same = _same_text(_text(was), _text(now), numbers)
        assert same, f"{where}\n{_text(was)}\n---\n{_text(now)}"


def test_numbers_count_only_where_they_were_printed():
    assert _same_text("loss 0.00627", "loss 0.00627", numbers=True)
    assert not _same_text("loss 0.00627", "loss 0.00634", numbers=True)
    assert _same_text("loss 0.00627", "loss 0.00634", numbers=False)
    assert not _same_text("loss 0.00627", "accuracy 0.00627", numbers=False)
    # Another CPU kind's numbers print in other widths (numpy pads an array's columns).
    saved, now = "[0.00347 0.0092  0.00151]", "[0.00334 0.00885 0.00151]"
    assert _same_text(saved, now, numbers=False)
    assert not _same_text(saved, now, numbers=True)
    assert not _same_text("a b", "ab", numbers=False)


if __name__ == "__main__":
    for path in NOTEBOOKS if len(sys.argv) == 1 else [pathlib.Path(a) for a in sys.argv[1:]]:
        executed = execute(path)
        executed.metadata["jdp"] = {"cpu": cpu_kind()}  # where its numbers were printed
        nbformat.write(executed, path)
        print("saved", path.name)
