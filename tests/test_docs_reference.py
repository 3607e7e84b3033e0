"""The reference is generated from the docstrings: every public name has one, every public name is on a
reference page, and the site builds with no warning (``mkdocs build --strict``, when mkdocs is installed)."""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"

# The public modules: ckpt.__all__, ckpt.kernels.__all__ and every ckpt.integrations module's __all__.
MODULES = [
    "ckpt",
    "ckpt.kernels",
    "ckpt.integrations.dcp",
    "ckpt.integrations.signals",
    "ckpt.integrations.lightning",
    "ckpt.integrations.hf",
]
NEEDS = {"ckpt.integrations.lightning": "lightning", "ckpt.integrations.hf": "transformers"}


def _module(name: str):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    return importlib.import_module(name)


def _statements(body: list[ast.stmt]):
    """Each statement list of a module, nested ones (``try``, ``if``) included."""
    yield body
    for node in body:
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield from _statements(inner)
        for handler in getattr(node, "handlers", []):
            yield from _statements(handler.body)


def _attribute_docstring(module, name: str) -> str | None:
    """The string literal right after ``name``'s assignment, following ``from .x import name``."""
    tree = ast.parse(inspect.getsource(module))
    for body in _statements(tree.body):
        for node, nxt in zip(body, body[1:] + [None]):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    return nxt.value.value
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                source = importlib.import_module("." * node.level + (node.module or ""), module.__package__)
                return _attribute_docstring(source, name)
    return None


def _own_doc(obj) -> str | None:
    """``obj``'s own docstring: not one a dataclass or an enum made up for it."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if not doc or not doc.strip():
        return None
    if inspect.isclass(obj) and (
        doc.startswith(f"{obj.__name__}(")
        or (issubclass(obj, enum.Enum) and doc.strip() == "An enumeration.")
    ):
        return None
    return doc


def _members_without_docs(cls) -> list[str]:
    """Public methods and properties ``cls`` defines that have no docstring, their own or the one of the
    base-class method they override (a framework hook such as ``on_fit_start`` or ``forward``)."""
    missing = []
    for key, value in vars(cls).items():
        if key.startswith("_"):
            continue
        if isinstance(value, property):
            doc = value.__doc__
        elif inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)):
            doc = inspect.getdoc(getattr(cls, key))
        else:
            continue
        if not (doc or "").strip():
            missing.append(f"{cls.__name__}.{key}")
    return missing


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_has_a_docstring(name):
    module = _module(name)
    missing = []
    for public in module.__all__:
        obj = getattr(module, public)
        if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
            if _own_doc(obj) is None:
                missing.append(public)
            if inspect.isclass(obj) and obj.__module__.startswith("ckpt."):
                missing += _members_without_docs(obj)
        elif not _attribute_docstring(module, public):
            missing.append(public)  # a constant: a string literal after its assignment
    assert not missing, f"{name}: public names without a docstring: {missing}"


def _directives() -> set[str]:
    return {
        m for page in REFERENCE.glob("*.md") for m in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M)
    }


def test_every_public_name_is_on_a_reference_page():
    import ckpt

    shown = _directives()
    missing = [f"ckpt.{n}" for n in ckpt.__all__ if f"ckpt.{n}" not in shown]
    missing += [m for m in MODULES[1:] if m not in shown]  # a module's directive shows its __all__
    assert not missing, f"add '::: NAME' for these to a page of docs/reference/: {missing}"


def test_the_site_builds_with_no_warning(tmp_path):
    """``mkdocs build --strict``: the reference from the docstrings, every link and anchor checked."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "checkpointer" / "index.html").exists()
