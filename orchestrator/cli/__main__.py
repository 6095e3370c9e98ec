"""`python -m orchestrator.cli` is `spotctl`."""

from orchestrator.cli.app import main

main()
