"""migrations/schema.sql, today's schema in one file to read, builds what the migrations
build: a migration added or changed without regenerating the file fails here. Both are
compared by their catalogs, on the same server, so the check holds on any PostgreSQL the
suite runs on."""

from __future__ import annotations

import difflib
import re

import psycopg
import pytest
from helpers import ROOT

SCHEMA_FILE = ROOT / "migrations" / "schema.sql"

# Each query: (name of the object, its definition) for every object of one kind in the
# schema `subengine`.
CATALOG: dict[str, str] = {
    "tables": """
        SELECT relname, concat_ws(' ', relkind, relpersistence, reloptions::text)
          FROM pg_class
         WHERE relnamespace = 'subengine'::regnamespace AND relkind IN ('r', 'p', 'v', 'm', 'f')
    """,
    "columns": """
        SELECT c.relname || '.' || a.attname,
               concat_ws(' ',
                   row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum),
                   format_type(a.atttypid, a.atttypmod),
                   CASE WHEN a.attnotnull THEN 'not null' END,
                   CASE WHEN a.attgenerated = 's' THEN 'generated' END,
                   'default ' || pg_get_expr(d.adbin, d.adrelid),
                   CASE WHEN a.attidentity <> '' THEN 'identity ' || a.attidentity::text END,
                   CASE WHEN a.attcollation <> t.typcollation
                        THEN 'collate ' || a.attcollation::regcollation END)
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_type t ON t.oid = a.atttypid
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE c.relnamespace = 'subengine'::regnamespace
           AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
           AND a.attnum > 0 AND NOT a.attisdropped
    """,
    "constraints": """
        SELECT conrelid::regclass || ' ' || conname, pg_get_constraintdef(oid)
          FROM pg_constraint
         WHERE connamespace = 'subengine'::regnamespace
    """,
    "indexes": """
        SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid)
          FROM pg_index i
          JOIN pg_class c ON c.oid = i.indexrelid
         WHERE c.relnamespace = 'subengine'::regnamespace
    """,
    "functions": """
        SELECT oid::regprocedure::text,
               CASE WHEN prokind IN ('f', 'p') THEN pg_get_functiondef(oid)
                    ELSE prokind::text END
          FROM pg_proc
         WHERE pronamespace = 'subengine'::regnamespace
    """,
    "views": """
        SELECT relname, pg_get_viewdef(oid)
          FROM pg_class
         WHERE relnamespace = 'subengine'::regnamespace AND relkind IN ('v', 'm')
    """,
    "triggers": """
        SELECT t.tgrelid::regclass || ' ' || t.tgname, pg_get_triggerdef(t.oid)
          FROM pg_trigger t
          JOIN pg_class c ON c.oid = t.tgrelid
         WHERE c.relnamespace = 'subengine'::regnamespace AND NOT t.tgisinternal
    """,
    "sequences": """
        SELECT s.seqrelid::regclass::text,
               concat_ws(' ', format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement,
                   s.seqmin, s.seqmax, s.seqcache, s.seqcycle,
                   (SELECT 'owned by ' || d.refobjid::regclass || '.' || a.attname
                      FROM pg_depend d
                      JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
                     WHERE d.classid = 'pg_class'::regclass AND d.objid = s.seqrelid
                       AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')))
          FROM pg_sequence s
          JOIN pg_class c ON c.oid = s.seqrelid
         WHERE c.relnamespace = 'subengine'::regnamespace
    """,
    "types": """
        SELECT t.oid::regtype::text,
               concat_ws(' ', t.typtype, format_type(t.typbasetype, t.typtypmod),
                   (SELECT string_agg(e.enumlabel, ', ' ORDER BY e.enumsortorder)
                      FROM pg_enum e WHERE e.enumtypid = t.oid))
          FROM pg_type t
          LEFT JOIN pg_class c ON c.oid = t.typrelid
         WHERE t.typnamespace = 'subengine'::regnamespace
           AND t.typcategory <> 'A' AND (c.relkind IS NULL OR c.relkind = 'c')
    """,
    "comments": """
        SELECT pg_describe_object(d.classoid, d.objoid, d.objsubid), d.description
          FROM pg_description d
         CROSS JOIN LATERAL pg_identify_object(d.classoid, d.objoid, d.objsubid) AS o
         WHERE o.schema = 'subengine'
            OR (d.classoid = 'pg_namespace'::regclass AND d.objoid = 'subengine'::regnamespace)
    """,
}


def catalog(dsn: str) -> dict[str, dict[str, str]]:
    """Every object of the schema `subengine` by kind, name and definition."""
    with psycopg.connect(dsn) as conn:
        return {
            kind: {name: definition for name, definition in conn.execute(query).fetchall()}
            for kind, query in CATALOG.items()
        }


def differences(migrated: dict[str, dict[str, str]], built: dict[str, dict[str, str]]) -> str:
    """What differs, object by object, with the definitions of the first few that do."""
    lines: list[str] = []
    diffs: list[str] = []
    for kind in CATALOG:
        made, from_file = migrated[kind], built[kind]
        for name in sorted(made.keys() | from_file.keys()):
            if name not in from_file:
                lines.append(f"  {kind}: {name} is made by the migrations, not by schema.sql")
            elif name not in made:
                lines.append(f"  {kind}: {name} is in schema.sql, not made by the migrations")
            elif made[name] != from_file[name]:
                lines.append(f"  {kind}: {name} differs")
                if diffs.count("") < 3:  # the first three differing definitions, in full
                    diffs.extend(
                        difflib.unified_diff(
                            from_file[name].splitlines(),
                            made[name].splitlines(),
                            f"{name} (schema.sql)",
                            f"{name} (migrations)",
                            lineterm="",
                        )
                    )
                    diffs.append("")
    return "\n".join(lines + diffs)


def test_schema_sql_builds_what_the_migrations_build(dsn: str, blank_dsn: str) -> None:
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA_FILE.read_text("utf-8"))  # as psql would run it
    migrated, built = catalog(dsn), catalog(blank_dsn)
    assert migrated["tables"], "the migrated database has no tables: the catalog queries broke"
    if migrated != built:
        pytest.fail(
            "migrations/schema.sql does not build what the migrations build; regenerate it "
            "with scripts/schema and commit it with the migration:\n" + differences(migrated, built)
        )


def test_schema_sql_creates_each_function_once(dsn: str) -> None:
    """Today's schema, not its history: no function written out again as migrations
    redefined it (which would build the same catalog)."""
    creates = re.findall(
        r"^CREATE (?:OR REPLACE )?FUNCTION ", SCHEMA_FILE.read_text("utf-8"), re.MULTILINE
    )
    functions = len(catalog(dsn)["functions"])
    assert len(creates) == functions, (
        f"migrations/schema.sql creates {len(creates)} functions, the migrations leave "
        f"{functions}: regenerate it with scripts/schema"
    )
