-- Secrets every replica must hold alike (see secrets.go): the TLS CA and
-- serving identity agents and clients pin, and the SSH CAs guests trust.
-- Kept in the database so any replica, new or rebuilt, presents the same.
CREATE TABLE secrets (
    name TEXT COLLATE "C" PRIMARY KEY,
    data BYTEA NOT NULL
);

-- A rotation on one replica reaches the others through the change feed.
CREATE FUNCTION eitri_note_secret() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(28544921504382978); -- as eitri_note_change
    INSERT INTO changes (kind, id, origin, at)
    VALUES ('secret', NEW.name, coalesce(current_setting('eitri.replica', true), ''),
            (extract(epoch FROM clock_timestamp()) * 1000000000)::bigint);
    PERFORM pg_notify('eitri_changes', '');
    RETURN NULL;
END $$;
CREATE TRIGGER secrets_change AFTER INSERT OR UPDATE ON secrets
    FOR EACH ROW EXECUTE FUNCTION eitri_note_secret();
