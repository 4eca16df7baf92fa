"""`python -m demonet.coordinator`: the same as `demonet coordinator`."""

from . import main

raise SystemExit(main())
