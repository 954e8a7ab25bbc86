"""``python -m hulkjax.launch worker ...``: one process of a launch job."""

import sys

from hulkjax.launch.worker import main

sys.exit(main())
