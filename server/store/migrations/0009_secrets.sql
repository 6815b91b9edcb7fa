-- Secrets every replica must hold alike (see secrets.go). A SQLite control
-- plane keeps them as files in its data dir; the table keeps both engines'
-- schemas at one version.
CREATE TABLE secrets (
    name TEXT PRIMARY KEY,
    data BLOB NOT NULL
);
