"""`python -m demonet ...`: the same as `demonet ...`."""

from demonet.cli import main

raise SystemExit(main())
