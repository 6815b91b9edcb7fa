-- Calls on their way to the replica holding a host's Calls stream (see
-- calls.go). A SQLite control plane is one process; the table keeps both
-- engines' schemas at one version.
CREATE TABLE calls (
    id      TEXT PRIMARY KEY,
    host_id TEXT NOT NULL,
    call    BLOB NOT NULL,
    at      BIGINT NOT NULL
);
