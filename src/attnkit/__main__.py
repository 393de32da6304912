"""``python -m attnkit`` is the ``attnkit`` command."""

import sys

from .cli import main

sys.exit(main())
