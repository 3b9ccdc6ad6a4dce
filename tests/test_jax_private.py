"""jdp reads three things from JAX's private modules (jdp/_jax_private.py).

Each test pins what jdp reads, so a JAX release that moves one fails here, by
name, rather than in a user's job. Nothing else in jdp/ may import ``jax._src``.
"""

import ast
import pathlib
import subprocess
import sys

import jdp
from jdp import _jax_private

ROOT = pathlib.Path(jdp.__file__).parent


def test_only_one_module_imports_jax_private_modules():
    importers = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
                importers.append(path.relative_to(ROOT).as_posix())
    assert sorted(set(importers)) == ["_jax_private.py"]


def test_coordination_state_has_what_the_watchdog_reads():
    state = _jax_private.coordination_state()
    # One process, never initialized: no client, and the counts jdp falls back from.
    assert state.client is None
    assert hasattr(state, "process_id") and hasattr(state, "num_processes")


def test_coordination_state_client_has_the_key_value_store_after_initialize():
    # A fresh process: initialize a one-process job and look at the client jdp's
    # watchdog talks to.
    code = """
import jax
from jdp import _jax_private
jax.distributed.initialize("127.0.0.1:%d", num_processes=1, process_id=0)
client = _jax_private.coordination_state().client
print(all(callable(getattr(client, m, None)) for m in
          ("key_value_set", "key_value_try_get", "key_value_dir_get")))
print(_jax_private.coordination_state().num_processes, _jax_private.coordination_state().process_id)
jax.distributed.shutdown()
"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-c", code % port], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1", "0"]


def test_cluster_types_name_the_launchers_jdp_documents():
    types = _jax_private.cluster_types()
    names = {t.__name__ for t in types}
    assert {"SlurmCluster", "OmpiCluster"} <= names, names
    for t in types:
        assert isinstance(t.opt_in_only_method, bool)
        assert callable(t.is_env_present) and callable(t.get_process_count)
        assert t.name is None or isinstance(t.name, str)


def test_backends_started_turns_true_when_jax_creates_them():
    code = (
        "from jdp import _jax_private; import jax; a = _jax_private.backends_started(); "
        "jax.devices(); print(a, _jax_private.backends_started())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
