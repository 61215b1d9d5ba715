"""Execute every research notebook (``notebooks/NN_*.ipynb``) top to bottom on the CPU with its
default parameters (the ``tiny`` preset) and check that it finished without an error and drew its
pictures.

The kernel is a kernelspec written to a temporary directory that points at *this* interpreter
(``sys.executable -m ipykernel_launcher``), handed to nbclient through its own KernelSpecManager: the
notebooks run in the test's environment whatever kernels (or none) are registered on the machine, so
a clean clone with the venv is enough. The kernel inherits the test's environment (``JAX_PLATFORMS=cpu``
from conftest) and its persistent compilation cache. ``DSV41_NOTEBOOK_TIMEOUT`` (seconds, default 600) bounds each
notebook; ``DSV41_NOTEBOOK_OUT`` (a directory) keeps the executed copies for inspection.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import jax
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (after the importorskips)
from jupyter_client.manager import KernelManager  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))
TIMEOUT = int(os.environ.get("DSV41_NOTEBOOK_TIMEOUT", "600"))
KERNEL = "dsv41-notebook-test"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    spec = d / KERNEL
    spec.mkdir()
    env = {
        # the repository on the path whatever the notebook's working directory
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    }
    # the persistent compilation cache of the test session (tests/conftest.py): the notebooks share
    # programs with each other (01 and 02 run the same traced forward) and with earlier runs
    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_dir:
        env.update({
            "JAX_COMPILATION_CACHE_DIR": os.path.abspath(cache_dir),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        })
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"dsv41 test ({sys.executable})",
        "language": "python",
        "env": env,
    }))
    return d


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names[:3] == ["01_architecture_tour.ipynb", "02_numerics.ipynb", "03_long_context.ipynb"], names


def test_committed_without_large_outputs():
    total = sum(p.stat().st_size for p in NOTEBOOKS)
    assert total < 1_000_000, f"notebooks total {total} bytes: clear their outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_dir):
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = nbclient.NotebookClient(nb, km=km, timeout=TIMEOUT, allow_errors=False,
                                     resources={"metadata": {"path": str(NB_DIR)}})
    t0 = time.time()
    try:
        client.execute()
    finally:
        out = os.environ.get("DSV41_NOTEBOOK_OUT")
        if out:
            os.makedirs(out, exist_ok=True)
            nbformat.write(nb, os.path.join(out, path.name))
    elapsed = time.time() - t0
    print(f"{path.name}: {elapsed:.0f}s")
    assert elapsed < TIMEOUT, f"{path.name} took {elapsed:.0f}s (limit {TIMEOUT}s)"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    images = sum("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", []))
    assert images >= 3, f"{path.name} drew only {images} figures"
