-- A host's image cache listing beside its live row (see live.go), for
-- replicas other than the holder. Kept in memory on SQLite; the columns
-- keep both engines' schemas at one version.
ALTER TABLE host_live ADD COLUMN image_cache BLOB;
ALTER TABLE host_live ADD COLUMN image_cache_at BIGINT;
