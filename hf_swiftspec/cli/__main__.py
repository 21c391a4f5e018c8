"""`python -m hf_swiftspec.cli`: the `swiftspec` command."""

import sys

from . import main

sys.exit(main())
