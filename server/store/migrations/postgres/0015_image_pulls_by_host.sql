-- Each snapshot reads the images pulled to its host.
CREATE INDEX image_pulls_host ON image_pulls (host_id);

-- Other replicas hold some of the hosts an image is pulled to: a pull, its
-- end, and a new current version are in the change feed, so the replica
-- holding each host sends it a new snapshot (see changes.go).
CREATE FUNCTION eitri_note_image_change() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r jsonb;
BEGIN
    PERFORM pg_advisory_xact_lock(28544921504382978); -- as eitri_note_change
    IF TG_OP = 'DELETE' THEN r := to_jsonb(OLD); ELSE r := to_jsonb(NEW); END IF;
    INSERT INTO changes (kind, id, host_id, owner_id, removed, origin, at)
    VALUES (TG_ARGV[0], r->>'name', r->>'host_id', NULL, TG_OP = 'DELETE',
            coalesce(current_setting('eitri.replica', true), ''),
            (extract(epoch FROM clock_timestamp()) * 1000000000)::bigint);
    PERFORM pg_notify('eitri_changes', '');
    RETURN NULL;
END $$;

CREATE TRIGGER image_pulls_change AFTER INSERT OR DELETE ON image_pulls
    FOR EACH ROW EXECUTE FUNCTION eitri_note_image_change('image_pull');
CREATE TRIGGER images_version AFTER UPDATE ON images
    FOR EACH ROW WHEN (OLD.current_version IS DISTINCT FROM NEW.current_version)
    EXECUTE FUNCTION eitri_note_image_change('image');
