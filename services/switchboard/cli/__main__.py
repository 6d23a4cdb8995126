"""``python -m switchboard.cli``: the `switchboard` command."""

import sys

from switchboard.cli.commands import main

sys.exit(main())
