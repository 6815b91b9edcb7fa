-- The change feed replicas follow (see changes.go). A SQLite control plane
-- is one process and publishes its own writes, so here the table exists only
-- to keep both engines' schemas at one version; nothing fills it.
CREATE TABLE changes (
    rev      INTEGER PRIMARY KEY AUTOINCREMENT,
    kind     TEXT NOT NULL,
    id       TEXT NOT NULL,
    host_id  TEXT,
    owner_id TEXT,
    removed  BOOLEAN NOT NULL DEFAULT FALSE,
    origin   TEXT NOT NULL DEFAULT '',
    at       BIGINT NOT NULL
);
