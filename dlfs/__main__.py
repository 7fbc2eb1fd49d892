from dlfs.cli import main

raise SystemExit(main())
