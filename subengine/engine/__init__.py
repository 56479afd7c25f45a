"""The facades users call, `Engine` and `AsyncEngine`: they own the connections and call
the concept packages below.
"""
