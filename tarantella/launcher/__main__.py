import sys

from tarantella.launcher import main

sys.exit(main())
