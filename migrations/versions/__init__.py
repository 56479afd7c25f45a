"""Alembic revisions of subengine's schema, applied in order by `subengine migrate`."""
