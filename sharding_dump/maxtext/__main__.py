"""`python -m sharding_dump.maxtext`: see :mod:`sharding_dump.maxtext.command`."""

import sys

from sharding_dump.maxtext.command import main

sys.exit(main())
