-- A host's image cache listing (ImageCacheReport, marshalled) and when it
-- came, written by the replica holding the host when the host sends a new
-- one, so `eitri host images` answers through any replica. Live, like the
-- rest of the row: the host sends it again on every connect.
ALTER TABLE host_live ADD COLUMN image_cache BYTEA;
ALTER TABLE host_live ADD COLUMN image_cache_at BIGINT;
