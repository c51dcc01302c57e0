from dgr.cli import main

raise SystemExit(main())
