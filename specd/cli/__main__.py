"""`python -m specd.cli ...` is the `specd` command (specd up starts its services this way)."""
import sys

from specd.cli import main

sys.exit(main())
