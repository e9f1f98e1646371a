"""``python -m zerospeed.checkpoint CHECKPOINT_DIR OUTPUT``: the ``zerospeed-consolidate`` command."""

import sys

from zerospeed.checkpoint.consolidate import main

sys.exit(main())
