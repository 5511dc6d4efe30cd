"""``python -m toolgym ...`` is the ``toolgym`` console script."""

import sys

from toolgym.cli import main

sys.exit(main())
