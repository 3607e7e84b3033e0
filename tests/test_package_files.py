"""The files every package has, and what the docs say about installing it.

One version (pyproject.toml's, read back from the installed metadata), a wheel that carries the licence and
``py.typed``, extras whose minimum versions are the ones the docs and the integrations state, and install
commands in the docs that work: from a checkout or a built wheel (the package is on no registry), extras
quoted (zsh expands an unquoted ``[...]``).
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _minimum(extra: str, package: str) -> str:
    """The lower bound pyproject.toml puts on ``package`` in ``extra``."""
    for req in PYPROJECT["project"]["optional-dependencies"][extra]:
        m = re.fullmatch(rf"{re.escape(package)}(?:\[[^]]*\])?>=([0-9.]+).*", req)
        if m:
            return m.group(1)
    raise AssertionError(f"{package} has no lower bound in the {extra!r} extra")


def test_the_version_is_pyprojects_read_from_the_installed_metadata():
    import ckpt

    assert ckpt.__version__ == importlib.metadata.version("tierckpt") == PYPROJECT["project"]["version"]


def test_ckpt_version_prints_it(capsys):
    import ckpt
    from ckpt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.split() == ["ckpt", "(tierckpt)", ckpt.__version__]


def test_the_changelog_has_an_entry_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(
        rf"^## \[{re.escape(PYPROJECT['project']['version'])}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M
    )


def test_license_file_is_the_apache_license_pyproject_names():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert (
        "Apache License" in text
        and "Version 2.0, January 2004" in text
        and "END OF TERMS AND CONDITIONS" in text
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``python -m build --wheel`` of a copy of the tree (no isolation: the test environment's setuptools)."""
    pytest.importorskip("build")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("ckpt", "kernels", "integrations"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    wheels = list(tmp.glob("tierckpt-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_carries_the_version_the_licence_and_py_typed(wheel):
    version = PYPROJECT["project"]["version"]
    assert wheel.name.startswith(f"tierckpt-{version}-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"tierckpt-{version}.dist-info/METADATA").decode()
    assert "ckpt/py.typed" in names
    assert f"tierckpt-{version}.dist-info/licenses/LICENSE" in names
    assert re.search(rf"^Version: {re.escape(version)}$", meta, re.M)
    assert re.search(r"^License-Expression: Apache-2.0$", meta, re.M)
    hf = _minimum("hf", "transformers")
    assert re.search(rf"^Requires-Dist: transformers>={re.escape(hf)}; extra == \"hf\"$", meta, re.M), meta


def test_the_hf_extra_allows_no_transformers_the_integration_refuses():
    """pyproject's ``hf`` extra, ``ckpt.integrations.hf``'s own check and docs/hf.md name one minimum."""
    pytest.importorskip("transformers")
    from ckpt.integrations import hf

    extra = _minimum("hf", "transformers")
    assert tuple(int(p) for p in extra.split(".")[:2]) == hf._MIN_TRANSFORMERS
    assert _minimum("dev", "transformers") == extra


@pytest.mark.parametrize(
    "page, name, extra, package",
    [
        ("hf.md", "transformers", "hf", "transformers"),
        ("hf.md", "accelerate", "hf", "accelerate"),
        ("lightning.md", "Lightning", "lightning", "lightning"),
        ("install.md", "transformers", "hf", "transformers"),
        ("install.md", "accelerate", "hf", "accelerate"),
        ("install.md", "lightning", "lightning", "lightning"),
        ("install.md", "triton", "kernels", "triton"),
        ("install.md", "safetensors", "export", "safetensors"),
        ("install.md", "pyarrow", "arrow", "pyarrow"),
    ],
)
def test_the_docs_state_the_extras_minimum_versions(page, name, extra, package):
    text = (ROOT / "docs" / page).read_text()
    stated = set(re.findall(rf"\b{name} ([0-9][0-9.]*[0-9]) or newer", text))
    assert stated == {_minimum(extra, package)}, (page, stated)


def test_the_install_page_names_the_wheel_this_version_builds():
    version = PYPROJECT["project"]["version"]
    named = set(re.findall(r"tierckpt-[^\s'\"\[]*\.whl", (ROOT / "docs" / "install.md").read_text()))
    assert named == {f"tierckpt-{version}-py3-none-any.whl"}, named


def _pip_installs() -> list[tuple[str, str]]:
    """Every ``pip install ...`` command in the docs and the README, with its file."""
    found = []
    for path in _doc_files():
        for line in path.read_text().splitlines():
            for m in re.finditer(r"pip install [^`\n&|;)]*", line):
                found.append((path.name, m.group(0).strip()))
    return found


def test_docs_install_from_a_checkout_or_a_wheel_with_quoted_extras():
    installs = _pip_installs()
    assert installs
    for page, cmd in installs:
        raw = cmd.split()
        for word in raw:
            if "[" in word and not word.startswith(("'", '"')):
                pytest.fail(f"{page}: {cmd!r}: quote {word} (zsh expands an unquoted [...])")
        for arg in shlex.split(cmd)[2:]:
            if arg.startswith("-"):
                continue
            # tierckpt is on no registry: a path (a checkout, '.[extra]') or a wheel file
            assert not re.match(r"tierckpt\b", arg), f"{page}: {cmd!r} installs tierckpt from a registry"
