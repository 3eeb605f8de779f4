from bladesmith.cli import main

raise SystemExit(main())
