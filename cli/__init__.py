"""The `subengine` command."""
