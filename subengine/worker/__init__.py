"""The registry users declare (`App`) and the loop that runs it (`Worker`), which calls
the subscriptions package for every statement it needs.
"""
