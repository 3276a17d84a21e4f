"""``python -m ddo presets`` lists the presets; ``python -m ddo inspect PATH`` lists a
checkpoint's tensors, or says why it is invalid (exit 1); ``python -m ddo doctor`` measures this
machine and recommends settings; ``python -m ddo bench FOLDER`` times a model on several routes
side by side."""

from __future__ import annotations

import sys

from .tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
