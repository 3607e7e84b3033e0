"""Build hooks of the documentation site (mkdocs.yml names this file; it is not a page).

1. ``pyproject.toml`` installs the top-level folders ``kernels/`` and ``integrations/`` as ``ckpt.kernels``
   and ``ckpt.integrations``. griffe, which reads the sources for mkdocstrings, looks for
   ``ckpt/kernels/`` and does not follow that mapping, so the build gives it a temporary tree laid out
   as the installed package (symbolic links into the checkout) and points the Python handler there.
   ``ckpt/__init__.py`` binds the names that need torch on first use (PEP 562: ``exports(__name__,
   _WHERE)``), which griffe cannot follow; the tree's copy of that file adds the same names as imports
   under ``if TYPE_CHECKING:``, read from ``_WHERE``, so the reference finds them where users do.
2. The docstrings write cross-references and literal blocks in reStructuredText (``:class:`~ckpt.X```,
   a paragraph ending in ``::``); :class:`RstRoles` turns the roles into Markdown code spans and the
   ``::`` into ``:`` as griffe loads each object, so the reference shows ``X`` rather than the markup.
"""

from __future__ import annotations

import ast
import atexit
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from griffe import Extension, Object
from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]


@event_priority(100)   # before mkdocstrings makes its handler from the configuration
def on_config(config: Any) -> Any:
    tree = Path(tempfile.mkdtemp(prefix="ckpt-docs-"))
    atexit.register(shutil.rmtree, tree, True)
    package = tree / "ckpt"
    package.mkdir()
    for entry in (ROOT / "ckpt").iterdir():
        if entry.name == "__init__.py":
            (package / entry.name).write_text(_with_lazy_imports(entry.read_text()))
        elif entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in ("kernels", "integrations"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    handler = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    handler["paths"] = [str(tree)]
    return config


def _with_lazy_imports(source: str) -> str:
    """``source`` with ``if TYPE_CHECKING:`` imports of the names its ``exports(__name__, TABLE)`` call binds
    lazily (``TABLE``: a literal dict of name -> submodule)."""
    tree = ast.parse(source)
    tables = {node.args[1].id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "exports"
              and len(node.args) == 2 and isinstance(node.args[1], ast.Name)}
    where: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in tables for t in node.targets):
            where.update(ast.literal_eval(node.value))
    if not where:
        return source
    lines = [f"    from .{module} import {name}" for name, module in sorted(where.items(), key=lambda kv: kv[1])]
    return source + "\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:   # docs/hooks.py\n" + "\n".join(lines) + "\n"


_ROLE = re.compile(r":(?:class|meth|func|mod|attr|exc|data|obj):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    target = m.group(2).removesuffix("()")
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


class RstRoles(Extension):
    """``:class:`~ckpt.errors.LockedError``` -> ```LockedError```, in every docstring griffe loads."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _ROLE.sub(_role, obj.docstring.value)
            # a paragraph ending in "::" introduces an indented literal block: Markdown's indented code
            obj.docstring.value = re.sub(r"::\n(\s*\n)", r":\n\1", text)
