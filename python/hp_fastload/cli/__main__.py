"""``python -m hp_fastload.cli``."""

import sys

from hp_fastload.cli.main import main

sys.exit(main())
