"""``python -m hf_csa2`` is the ``hf-csa2`` command (so launchers such as torchrun can run it)."""

import sys

from .cli import main

sys.exit(main())
