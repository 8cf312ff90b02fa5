"""The import hook's public home: ``tilescale_core._bootstrap`` *is* the top-level
``_tilescale_hook`` module (the same module object), which the ``.pth`` line imports at
interpreter start -- one small module, without the package ``__init__``; see its docstring."""

import sys

import _tilescale_hook

sys.modules[__name__] = _tilescale_hook
