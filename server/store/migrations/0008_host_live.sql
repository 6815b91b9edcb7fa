-- Which replica holds each host's stream, and what the host last said
-- (see live.go). A SQLite control plane is one process and keeps this in
-- memory; the table exists to keep both engines' schemas at one version.
CREATE TABLE host_live (
    host_id    TEXT PRIMARY KEY REFERENCES hosts (id) ON DELETE CASCADE,
    replica    TEXT NOT NULL,
    instance   TEXT NOT NULL,
    conn       BIGINT NOT NULL,
    connected  BOOLEAN NOT NULL,
    expires_at BIGINT NOT NULL,
    hello      BLOB,
    report     BLOB,
    rev        BIGINT NOT NULL
);
