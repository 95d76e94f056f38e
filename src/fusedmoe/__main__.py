from fusedmoe.cli import main

raise SystemExit(main())
