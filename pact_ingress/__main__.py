"""`python -m pact_ingress` is the same as the `pact-ingress` command."""

from pact_ingress.cli import main

raise SystemExit(main())
