-- What `subengine migrate` reads besides what Alembic runs (the DDL lives in migrations/).

-- name: version_table_exists
-- Whether the schema has subengine's migration version table (not: never migrated).
SELECT to_regclass(quote_ident(%(schema)s) || '.subengine_alembic_version') IS NOT NULL

-- name: schema_revision
-- The migration revision the schema is at.
SELECT version_num FROM {schema}.subengine_alembic_version
