"""``python -m distmoe.cli``: the ``distmoe`` command."""

import sys

from distmoe.cli import main

sys.exit(main())
