"""`python -m cacheroute_proxy ...` is the `cacheroute-proxy` command."""

import sys

from .cli import main

sys.exit(main())
