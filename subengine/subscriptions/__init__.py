"""Subscriptions: their lifecycle, reset, the batch transaction a worker runs, inspection
(status, dead letters) and deletion with their stream.
"""
