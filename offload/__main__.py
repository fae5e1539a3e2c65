from offload.cli import main

raise SystemExit(main())
