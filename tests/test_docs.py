"""Every code block in docs/ and every docstring example in jdp/ runs."""

import doctest
import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import jdp

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(jdp.__path__, "jdp.") if not m.name.endswith("__main__")
)


MULTIPROCESS = "import jdp.distributed"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_page_runs(page, tmp_path):
    blocks = BLOCK.findall(page.read_text())
    assert blocks, f"{page.name} has no python examples"
    namespace = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(blocks):
        if block.startswith(MULTIPROCESS):
            _launch(block, tmp_path / f"{page.stem}_{i}.py")
        else:
            exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)


def _launch(block: str, script: pathlib.Path) -> None:
    """A multi-process example runs as 2 processes x 2 CPU devices."""
    script.write_text(block)
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    cmd = [
        sys.executable,
        "-m",
        "jdp.launch",
        "--processes",
        "2",
        "--devices-per-process",
        "2",
        str(script),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"


def test_every_public_name_is_documented():
    api = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in jdp.__all__ if f"`{name}" not in api]
    assert not missing, f"docs/api.md does not mention {missing}"
