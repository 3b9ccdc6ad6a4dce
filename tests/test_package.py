"""The wheel a user installs: built from a copy of the checkout, installed with no
extras into a fresh virtual environment, outside the repository.

It must carry its license and metadata, run the README's quickstart to the
hand-derived result, import none of its optional or heavy dependencies on
``import jdp``, and answer a missing extra with the line that installs it.
"""

import email
import os
import pathlib
import re
import shutil
import subprocess
import sys
import venv
import zipfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _git_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    if shutil.which("git") is None:
        pytest.skip("git is needed to copy the checkout's files")
    src = tmp_path_factory.mktemp("src")
    for name in _git_files():  # a copy: building writes build/ and *.egg-info
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (found,) = dist.glob("jdp-*.whl")
    return found


@pytest.fixture(scope="module")
def python(wheel, tmp_path_factory) -> pathlib.Path:
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    run = subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return py


def _run(py: pathlib.Path, code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "PYTHON"))}
    return subprocess.run(
        [str(py), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_wheel_carries_license_metadata_and_types(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith("/METADATA"))))
    assert "jdp/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Programming Language :: Python :: 3.11" in meta.get_all("Classifier")
    requires = meta.get_all("Requires-Dist")
    # Flax only with an extra: jdp itself never imports it.
    assert not any(r.startswith("flax") and "extra" not in r for r in requires), requires
    assert any(r.startswith("flax") and 'extra == "flax"' in r for r in requires), requires
    assert not any("jax._src" in n for n in names)
    # The description a package index shows: no link or image that is relative.
    description = meta.get_payload()
    assert "jdp.shard_map" in description
    targets = re.findall(r"\]\(([^)]*)\)", description)
    assert all(t.startswith("https://") for t in targets), targets


def test_readme_quickstart_runs_from_the_wheel(python, tmp_path):
    readme = (ROOT / "README.md").read_text()
    quickstart = re.search(r"```python\n(.*?)```", readme, re.DOTALL).group(1)
    run = _run(python, quickstart + "\nprint(repr(np.asarray(params).tolist()))\n", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    # One Adam step from zeros, by hand: the gradient is g = -2 on every
    # parameter, so the update is lr * 2 / sqrt(nu_hat) (eps aside), with
    # nu_hat = (1 - b2) g^2 / (1 - b2^1). optax forms 1 - b2 in Python but
    # 1 - b2^1 in float32 (b2 ** count, count an int32): that rounding is 6.4e-6.
    f32 = np.float32
    nu_hat = f32(1e-3) * f32(4.0) / (f32(1) - f32(0.999))
    expected = float(f32(1e-3) * f32(2.0) / (np.sqrt(nu_hat) + f32(1e-8)))
    params = eval(run.stdout.strip().splitlines()[-1])
    assert params == pytest.approx([expected] * 3, rel=1e-6)


def test_import_jdp_loads_no_optional_or_heavy_dependency(python, tmp_path):
    code = (
        "import sys, jdp\n"
        "heavy = ('flax', 'orbax', 'tensorstore', 'rich', 'matplotlib', 'sklearn', 'grain')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    run = _run(python, code, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "code, line",
    [
        (
            "import jdp.nnx",
            "jdp.nnx needs flax, which jdp installs only with its 'flax' extra: "
            "pip install 'jdp[flax]'.",
        ),
        (
            "import runpy; runpy.run_module('jdp.demo', run_name='__main__')",
            "jdp.demo needs flax, scikit-learn, matplotlib, which jdp installs only with its "
            "'demo' extra: pip install 'jdp[demo]'.",
        ),
    ],
    ids=["nnx", "demo"],
)
def test_a_missing_extra_is_answered_with_its_install_line(python, tmp_path, code, line):
    run = _run(python, code, tmp_path)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"ModuleNotFoundError: {line}"


def test_checkpointer_loads_orbax_when_first_used(python, tmp_path):
    code = (
        "import sys, jdp\n"
        f"c = jdp.Checkpointer({str(tmp_path / 'ckpt')!r})\n"
        "print('orbax.checkpoint' in sys.modules)\n"
    )
    run = _run(python, code, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "True"
