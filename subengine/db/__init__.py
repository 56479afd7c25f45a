"""The SQL layer: connections, the one executor of named queries (`sql/*.sql`), migrations,
the embedded server and advisory locks. It knows no concept; concepts give it `Query`s.
"""
