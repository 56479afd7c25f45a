"""`python -m subengine.cli`: the `subengine` command, for when the script is not on PATH."""

from .main import main

main()
