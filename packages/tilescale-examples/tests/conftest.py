"""tilescale-examples tests: helpers live in ``examples_helpers.py``."""

import examples_helpers  # noqa: F401  (sets CUDA_HOME before TileLang is imported)
