"""The docs, READMEs, changelog and docstrings speak of jdp only, and what they
name exists: every repository path resolves inside the checkout, every relative
path stays inside it, and every ``jdp.name`` in backticks is a real attribute.
"""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXTS = sorted(
    [
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("examples/**/*.md"),
        *ROOT.glob("examples/**/*.py"),
        *ROOT.glob("jdp/**/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
    ]
)
REPO_PATH = re.compile(
    r"(?<![\w./\-\[])((?:jdp|tests|docs|notebooks|benchmarks|examples|\.ci)/[\w./-]*[\w/])"
)
RELATIVE = re.compile(r"(?<![\w.])(\.\./[\w./-]+)")
OUTSIDE = re.compile(r"(/work/|/home/|/root/|\.\./shared|\.\./\.library)")
NAME = re.compile(r"`(jdp(?:\.[A-Za-z_]\w*)+)")


def _ids(paths):
    return [p.relative_to(ROOT).as_posix() for p in paths]


@pytest.mark.parametrize("text", TEXTS, ids=_ids(TEXTS))
def test_paths_resolve_inside_the_checkout(text):
    body = text.read_text()
    wrong = [m for m in OUTSIDE.findall(body)]
    for path in REPO_PATH.findall(body):
        if path in ("examples/s", "jdp/torch"):  # a unit and a ratio, not paths
            continue
        # A toctree names a page without its suffix.
        base = ROOT / path.split("#")[0]
        if not any(pathlib.Path(f"{base}{s}").exists() for s in ("", ".md", ".ipynb")):
            wrong.append(path)
    for path in RELATIVE.findall(body):
        target = (text.parent / path.split("#")[0]).resolve()
        if ROOT not in target.parents or not target.exists():
            wrong.append(path)
    assert not wrong, f"{text.relative_to(ROOT)} names what is not in the checkout: {wrong}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("text", TEXTS, ids=_ids(TEXTS))
def test_jdp_names_in_backticks_exist(text):
    missing = sorted({n for n in NAME.findall(text.read_text()) if not _resolves(n)})
    assert not missing, f"{text.relative_to(ROOT)} names what jdp does not have: {missing}"
