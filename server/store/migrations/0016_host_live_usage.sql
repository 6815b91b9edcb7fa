-- A host's newest usage sample beside its report (see live.go), so
-- watchers on every replica chart it. Kept in memory on SQLite; the column
-- keeps both engines' schemas at one version.
ALTER TABLE host_live ADD COLUMN usage BLOB;
