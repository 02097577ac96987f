"""`python -m kvjax.cli ...` is `kvjax ...`."""

import sys

from kvjax.cli import main

sys.exit(main())
