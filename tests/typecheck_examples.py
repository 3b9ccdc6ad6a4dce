"""Type-checks the code users copy: every docs page's python blocks and every notebook's cells.

Each page (each notebook) becomes one module, its blocks in order, as the suite runs
them (tests/test_docs.py, tests/test_notebooks.py); mypy then checks them against jdp's
own annotations with jdp's mypy settings. Run by ``make lint``.
"""

import json
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# jdp's own settings (pyproject.toml), checking what user code gets from jdp. Flax is
# followed as untyped: its Linen ``apply`` is typed as ``Any | tuple[...]``, which
# every caller would have to narrow, and that is Flax's to type, not jdp's.
CONFIG = """
[mypy]
python_version = 3.11
check_untyped_defs = True
no_implicit_optional = True
strict_equality = True
warn_redundant_casts = True
ignore_missing_imports = True

[mypy-flax.*]
follow_imports = skip
"""
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def sources() -> dict[str, str]:
    out = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        blocks = BLOCK.findall(page.read_text())
        if blocks:
            out[f"docs_{page.stem}.py"] = "\n\n".join(blocks)
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        code = [
            "".join(c["source"])
            for c in cells
            if c["cell_type"] == "code" and not "".join(c["source"]).lstrip().startswith(("%", "!"))
        ]
        out[f"notebook_{notebook.stem}.py"] = "\n\n".join(code)
    return out


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for name, text in sources().items():
            path = pathlib.Path(folder) / name
            path.write_text(text + "\n")
            paths.append(str(path))
        config = pathlib.Path(folder) / "mypy.ini"
        config.write_text(CONFIG)
        run = subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(config), *paths],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        report = run.stdout.replace(folder + "/", "")
    print(report.strip().splitlines()[-1] if run.returncode == 0 else report, end="\n")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
