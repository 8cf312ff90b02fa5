"""TileLang's bundled TVM (the ``tvm.tirx`` fork).

``tvm`` is importable only after ``tilelang`` has put its bundled copy on ``sys.path``, so
every module here takes ``tirx`` from this one instead of importing ``tvm`` directly.
"""

import tilelang  # noqa: F401  (puts TileLang's bundled tvm on sys.path)
from tvm import tirx

__all__ = ["tirx"]
