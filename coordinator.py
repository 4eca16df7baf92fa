"""`python coordinator.py ...`: the same as `demonet coordinator ...`."""

from demonet.coordinator import main

raise SystemExit(main())
