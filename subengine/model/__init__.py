"""The vocabulary: events, declarations, errors, settings, records, names, cursors and
secrets. Plain values with no I/O; every other layer builds on it, and the client imports
nothing else.
"""
