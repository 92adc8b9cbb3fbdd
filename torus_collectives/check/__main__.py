"""``python -m torus_collectives.check``: see ``torus_collectives.check``."""

import sys

from torus_collectives.check.cli import main

sys.exit(main())
