"""Import boundaries: pyproject's [tool.importlinter] contracts hold on the package as it is, and break
when an upward import or a jax import is added to a copy of it; host-only modules import without jax
at run time too (the package's public names load lazily)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINT = ("import sys\nfrom importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))")
HOST_ONLY = ["atlas_jax.errors", "atlas_jax.frontend.tokenizer", "atlas_jax.frontend.chat", "atlas_jax.frontend.parsers",
             "atlas_jax.frontend.detokenizer", "atlas_jax.engine.scheduler", "atlas_jax.engine.sequence",
             "atlas_jax.engine.sampling_params", "atlas_jax.engine.outputs", "atlas_jax.engine.client",
             "atlas_jax.state.prefix_cache", "atlas_jax.server.app", "atlas_jax.server.connections"]


def lint(root: str) -> subprocess.CompletedProcess:
    """lint-imports on the package under `root` (it comes first on the path)."""
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=dict(os.environ, PYTHONPATH=root),
                          capture_output=True, text=True, timeout=300)


def test_the_contracts_hold():
    r = lint(ROOT)
    assert r.returncode == 0 and "4 kept, 0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("module,line,contract", [
    ("errors.py", "from .engine import core", "The errors module imports nothing"),
    ("frontend/chat.py", "from ..server import app", "The server over the engine"),
    ("engine/scheduler.py", "from ..layers import attention", "Host-only modules import no jax"),
    ("server/metrics.py", "from ..engine import core", "The server reaches the engine only through"),
])
def test_an_added_import_breaks_its_contract(tmp_path, module, line, contract):
    shutil.copytree(os.path.join(ROOT, "atlas_jax"), tmp_path / "atlas_jax",
                    ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    with open(tmp_path / "atlas_jax" / module, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    r = lint(str(tmp_path))
    assert r.returncode != 0 and "Broken contracts" in r.stdout, r.stdout[-3000:]
    assert contract in r.stdout.split("Broken contracts", 1)[1], r.stdout[-3000:]


def test_host_only_modules_import_without_jax():
    code = f"import sys\nimport {', '.join(HOST_ONLY)}\nassert 'jax' not in sys.modules, 'jax was imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
