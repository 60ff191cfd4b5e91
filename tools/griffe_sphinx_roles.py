"""A griffe extension for the API reference (mkdocs.yml): Sphinx roles in docstrings become code spans.

The docstrings name other objects the Sphinx way (``:class:`~trainscale.train.config.TrainerConfig```),
which Markdown would print as is. Here ``:role:`~a.b.C``` becomes ```C``` and ``:role:`a.b.C``` becomes
```a.b.C```, at load time, so the sources keep one style.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|obj|exc|data|const):`(~?)([^`]+)`")


def _code_span(match: re.Match) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code_span, obj.docstring.value)
