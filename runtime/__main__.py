"""`python -m oobleck.runtime worker|profile ...` (the same subcommands as `oobleck worker|profile`)."""

import sys

from oobleck.runtime.cli import main

sys.exit(main())
