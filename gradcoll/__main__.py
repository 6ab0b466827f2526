"""``python -m gradcoll``: the ``gradcoll`` command (see `gradcoll.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
