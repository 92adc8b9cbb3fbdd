"""``python -m torus_collectives.tuning``: the tuner's command line (``tuner.main``)."""

import sys

from torus_collectives.tuning import tuner

tuner.main(sys.argv[1:])
