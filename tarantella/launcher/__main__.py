"""`python -m tarantella.launcher`: the `tarantella` command."""

import sys

from tarantella.launcher import main

sys.exit(main())
