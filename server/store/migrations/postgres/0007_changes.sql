-- The change feed replicas follow (see changes.go). Triggers write it, so
-- every write of a VM, host or exposure is recorded in its own
-- transaction, including writes added later by code that never heard of
-- replicas.
CREATE TABLE changes (
    rev      BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind     TEXT COLLATE "C" NOT NULL,
    id       TEXT COLLATE "C" NOT NULL,
    host_id  TEXT COLLATE "C",
    owner_id TEXT COLLATE "C",
    removed  BOOLEAN NOT NULL DEFAULT FALSE,
    -- The replica whose write it was (its eitri.replica setting), which
    -- has published it already.
    origin   TEXT COLLATE "C" NOT NULL DEFAULT '',
    at       BIGINT NOT NULL
);
CREATE INDEX changes_at ON changes (at);

CREATE FUNCTION eitri_note_change() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r jsonb;
BEGIN
    -- Revisions must become visible in the order they are numbered, or a
    -- follower that has read past N could later find a smaller one commit.
    -- The lock is held to commit, so the next writer numbers after it.
    PERFORM pg_advisory_xact_lock(28544921504382978);
    IF TG_OP = 'DELETE' THEN r := to_jsonb(OLD); ELSE r := to_jsonb(NEW); END IF;
    INSERT INTO changes (kind, id, host_id, owner_id, removed, origin, at)
    VALUES (TG_ARGV[0], r->>'id',
            CASE WHEN TG_ARGV[0] = 'host' THEN r->>'id' ELSE r->>'host_id' END,
            r->>'owner_id', TG_OP = 'DELETE',
            coalesce(current_setting('eitri.replica', true), ''),
            (extract(epoch FROM clock_timestamp()) * 1000000000)::bigint);
    -- A wake-up only (one per transaction: PostgreSQL folds equal ones).
    PERFORM pg_notify('eitri_changes', '');
    RETURN NULL;
END $$;

CREATE TRIGGER vms_change AFTER INSERT OR UPDATE OR DELETE ON vms
    FOR EACH ROW EXECUTE FUNCTION eitri_note_change('vm');
CREATE TRIGGER exposures_change AFTER INSERT OR UPDATE OR DELETE ON exposures
    FOR EACH ROW EXECUTE FUNCTION eitri_note_change('exposure');
CREATE TRIGGER hosts_change AFTER INSERT OR DELETE ON hosts
    FOR EACH ROW EXECUTE FUNCTION eitri_note_change('host');
-- A host's heartbeat (last_seen_at) is no change anybody watches.
CREATE TRIGGER hosts_update AFTER UPDATE ON hosts
    FOR EACH ROW WHEN ((to_jsonb(OLD) - 'last_seen_at') IS DISTINCT FROM (to_jsonb(NEW) - 'last_seen_at'))
    EXECUTE FUNCTION eitri_note_change('host');
