"""The statements of a worker batch that carries several partitions, as functions that
keep one plan.

When a batch's chosen partition leaves room, the batch also takes other partitions of
its subscription with work (lock_companions) and moves all their positions with one
compare-and-set (commit_positions). As prepared statements, PostgreSQL planned both again
on every call at 1,024 partitions (pg_stat_statements: 0.33 ms of planning for 0.45 ms of
execution, and 0.14 ms for 0.22 ms): the custom plans, made for one array or limit,
always looked cheaper than the generic one. Their plans are index lookups by key
whatever the values, so each moves into a function that plans it once per session, as
append_events does (revision 0007), with sequential scans off so that a plan made
before any ANALYZE stays a plan of lookups. (A batch of one partition, the common case
with few partitions, uses two plain statements, which PostgreSQL keeps planned and which
cost less than a function call.)

lock_companions: up to `companion_limit` partitions of the subscription other than the
chosen one, with work, oldest next event first, whose rows no batch holds (SKIP LOCKED:
never two batches of one partition at once), their rows locked until the transaction
ends. A row per event the batch takes from each, plus one (the next event's time), with
the partition's position, generation, head and share ("take"), in order, until `room`
events in all.

commit_positions: the compare-and-set of the positions of a batch's partitions (DESIGN.md
invariant 3): a row another worker moved, or whose generation a reset bumped, matches
nothing, and the caller rolls the batch back. Without a next event's time from the batch,
next_event_time looks (events committed since the batch read may have brought one).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        r"""
CREATE FUNCTION lock_companions(
    subscription_name  text,
    stream_name        text,
    chosen_partition   integer,
    room               integer,
    companion_limit    integer
) RETURNS TABLE (
    part            integer,
    part_position   bigint,
    part_generation bigint,
    halted          boolean,
    attempts        integer,
    head            bigint,
    take            bigint,
    id              uuid,
    stream          text,
    partition       integer,
    "position"      bigint,
    key             text,
    key_version     bigint,
    type            text,
    data            jsonb,
    metadata        jsonb,
    occurred_at     timestamptz,
    recorded_at     timestamptz
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $function$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH companion AS MATERIALIZED (
        SELECT sp.partition, sp.position, sp.generation, sp.next_time
          FROM subscription_positions sp
         WHERE sp.subscription = subscription_name AND sp.next_time IS NOT NULL
           AND NOT sp.stopped AND sp.partition <> chosen_partition AND sp.attempts = 0
           AND (sp.retry_at IS NULL OR sp.retry_at <= now())
           AND NOT EXISTS (SELECT FROM subscriptions s
                            WHERE s.name = subscription_name AND s.paused)
         ORDER BY sp.next_time
         -- each has an event at least: no more rows than the room can use
         LIMIT least(companion_limit, room)
           FOR UPDATE OF sp SKIP LOCKED
    ), member AS (
        SELECT c.partition, c.position, c.generation, p.head,
               row_number() OVER (ORDER BY c.next_time, c.partition) AS rank
          FROM companion c
          JOIN partitions p ON p.stream = stream_name AND p.partition = c.partition
    ), share AS (
        -- what each partition takes: its events, as far as the ones before it left room
        SELECT m.*,
               -- head - position is below 0 for a row that a batch moved past this
               -- statement's head and committed since: it has nothing
               greatest(0, least(m.head - m.position,
                                 room - coalesce(sum(greatest(0, least(m.head - m.position,
                                                                       room)))
                                                     OVER (ORDER BY m.rank ROWS BETWEEN
                                                           UNBOUNDED PRECEDING
                                                           AND 1 PRECEDING),
                                                 0)))::bigint AS take
          FROM member m
    )
    SELECT x.partition, x.position, x.generation, false, 0, x.head, x.take,
           e.id, e.stream, e.partition, e.position, e.key, e.key_version, e.type, e.data,
           e.metadata, e.occurred_at, e.recorded_at
      FROM share x
      CROSS JOIN LATERAL (
            SELECT * FROM events e
             WHERE e.stream = stream_name AND e.partition = x.partition
               AND e.position > x.position
             ORDER BY e.position
             LIMIT x.take + 1) e
     WHERE x.take > 0
     ORDER BY x.rank, e.position;
END
$function$;

CREATE FUNCTION commit_positions(
    subscription_name  text,
    stream_name        text,
    partition_numbers  integer[],
    old_positions      bigint[],
    new_positions      bigint[],
    generations        bigint[],
    next_times         timestamptz[]
) RETURNS TABLE (partition integer, next_time timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $function$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE subscription_positions sp
       SET position = x.new,
           next_time = coalesce(x.next_time, next_event_time(stream_name, x.partition, x.new)),
           attempts = 0, last_error = NULL, retry_at = NULL, updated_at = now()
      FROM unnest(partition_numbers, old_positions, new_positions, generations, next_times)
           AS x(partition, old, new, generation, next_time)
     WHERE sp.subscription = subscription_name AND sp.partition = x.partition
       AND sp.position = x.old AND sp.generation = x.generation
    RETURNING sp.partition, sp.next_time;
END
$function$;
"""
    )


def downgrade() -> None:
    op.execute(
        """
DROP FUNCTION commit_positions(text, text, integer[], bigint[], bigint[], bigint[],
                               timestamptz[]);
DROP FUNCTION lock_companions(text, text, integer, integer, integer);
"""
    )
