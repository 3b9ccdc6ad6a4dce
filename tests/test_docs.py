"""Every code block in docs/ and every docstring example in jdp/ runs."""

import doctest
import importlib
import pathlib
import pkgutil
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import jdp
from tests.launching import clean_env, launch_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
# changelog.md only includes CHANGELOG.md, which has no code.
PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "changelog.md")
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
    cmd = launch_command(str(script))
    run = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"


LAUNCHER_LINE = {"mpirun": re.compile(r"^mpirun .*$", re.M), "srun": re.compile(r"^srun .*$", re.M)}


@pytest.mark.parametrize("launcher", sorted(LAUNCHER_LINE))
def test_multi_host_launcher_lines_run_the_script(launcher, tmp_path):
    """docs/multi-host.md's own mpirun and srun lines run its script, 2 tasks x 2 CPU devices."""
    from tests.launching import slurm_up
    from tests.test_failfast import base_env, free_port

    if not shutil.which(launcher) or (launcher == "srun" and not slurm_up()):
        pytest.skip(f"{launcher} is not installed or has no cluster here")
    page = (ROOT / "docs" / "multi-host.md").read_text()
    script = tmp_path / "train.py"
    script.write_text(next(b for b in BLOCK.findall(page) if b.startswith(MULTIPROCESS)))
    cmd = shlex.split(LAUNCHER_LINE[launcher].search(page).group(0))
    cmd = [
        str(script) if arg == "train.py" else sys.executable if arg == "python" else arg
        for arg in cmd
    ]
    # This machine's sizes: 2 tasks (the page runs 8 a node) of 2 CPU devices each.
    if launcher == "mpirun":
        cmd[cmd.index("-np") + 1] = "2"
        cmd[1:1] = [
            "--allow-run-as-root",
            "--oversubscribe",
            "-x",
            "PYTHONPATH",
            "-x",
            "JDP_CPU_DEVICES_PER_PROCESS",
            "-x",
            "JAX_COORDINATOR_PORT",
        ]
    else:
        cmd[1:1] = ["-n", "2"]
    env = base_env(
        JDP_CPU_DEVICES_PER_PROCESS="2",
        JAX_COORDINATOR_PORT=str(free_port()),
        OMPI_MCA_btl="self,vader",
        OMPI_MCA_oob_tcp_if_include="lo",
    )
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    # Both processes printed the job's mean loss, each on its own stream.
    streams = _rank_streams(run.stdout)
    losses = {
        rank: re.findall(r"\d+\.\d{6}", re.sub(r".*\[Gloo\].*", "", text))
        for rank, text in streams.items()
    }
    found = sorted(loss for found in losses.values() for loss in found)
    assert len(found) == 2 and len(set(found)) == 1, (losses, run.stdout)


RANK_TAG = re.compile(r"\[\d+,(\d+)\]<stdout>:|^(\d+): ", re.M)


def _rank_streams(stdout):
    """Each rank's output, its pieces joined in order: mpirun cuts a line into tagged
    pieces and interleaves the ranks' pieces ("[1,1]<stdout>:1[1,0]<stdout>:0..."), so
    the text with the tags removed can glue one rank's digits onto another's number."""
    marks = list(RANK_TAG.finditer(stdout))
    streams: dict[str, str] = {}
    for mark, after in zip(marks, [*marks[1:], None], strict=True):
        end = after.start() if after else len(stdout)
        rank = mark.group(1) or mark.group(2)
        streams[rank] = streams.get(rank, "") + stdout[mark.end() : end]
    return streams


def test_rank_streams_regroup_interleaved_mpirun_pieces():
    """The failure seen once in CI: rank 0's "0 " glued onto rank 1's loss."""
    out = (
        "[1,1]<stdout>:1[1,1]<stdout>: [1,0]<stdout>:0[1,1]<stdout>:2.122509"
        "[1,0]<stdout>: [1,0]<stdout>:2.122509\n[1,1]<stdout>:\n"
    )
    assert _rank_streams(out) == {"1": "1 2.122509\n", "0": "0 2.122509\n"}
    assert _rank_streams("0: 0 1.500000\n1: 1 1.500000\n") == {
        "0": "0 1.500000\n",
        "1": "1 1.500000\n",
    }
