"""`python peer.py ...`: the same as `demonet peer ...`."""

from demonet.peer import main

raise SystemExit(main())
