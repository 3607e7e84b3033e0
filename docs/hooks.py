"""Build hooks of the documentation site (mkdocs.yml names this file; it is not a page).

1. ``pyproject.toml`` installs the top-level folders ``kernels/`` and ``integrations/`` as ``ckpt.kernels``
   and ``ckpt.integrations``. griffe, which reads the sources for mkdocstrings, looks for
   ``ckpt/kernels/`` and does not follow that mapping, so the build gives it a temporary tree laid out
   as the installed package (symbolic links into the checkout) and points the Python handler there.
2. The docstrings write cross-references and literal blocks in reStructuredText (``:class:`~ckpt.X```,
   a paragraph ending in ``::``); :class:`RstRoles` turns the roles into Markdown code spans and the
   ``::`` into ``:`` as griffe loads each object, so the reference shows ``X`` rather than the markup.
"""

from __future__ import annotations

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
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in ("kernels", "integrations"):
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    handler = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    handler["paths"] = [str(tree)]
    return config


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
