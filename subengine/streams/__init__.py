"""Streams: create, append, read, tail and listen, and retention. One module per concept,
each building the `Query`s of its concept for the SQL layer to run.
"""
