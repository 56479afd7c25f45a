"""subengine's Alembic environment and versions: the only place DDL lives.

Installed as `subengine.migrations`; `subengine.migrate` runs them.
"""
