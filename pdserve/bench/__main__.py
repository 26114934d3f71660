"""`python -m pdserve.bench ...`, the same as `pdserve bench ...`."""

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
