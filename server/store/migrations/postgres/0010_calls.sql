-- Calls (consoles, console input, tunnels) on their way from the replica a
-- user's request landed on to the replica holding the host's Calls stream
-- (see calls.go). A row lives from the request until that replica takes
-- it, at most as long as the caller waits for the host to answer.
CREATE TABLE calls (
    id      TEXT COLLATE "C" PRIMARY KEY,
    host_id TEXT COLLATE "C" NOT NULL,
    call    BYTEA NOT NULL,
    at      BIGINT NOT NULL
);
CREATE INDEX calls_host ON calls (host_id);
