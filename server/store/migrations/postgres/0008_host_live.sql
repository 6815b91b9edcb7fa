-- Which replica holds each host's stream, and what the host last said
-- (see live.go). Live state is not durable truth: it is written with
-- synchronous_commit off, and a replica that finds it lost rebuilds it
-- from the agents, which resend a full report on every reconnect.
CREATE TABLE host_live (
    host_id    TEXT COLLATE "C" PRIMARY KEY REFERENCES hosts (id) ON DELETE CASCADE,
    -- The replica holding the host's stream, and the agent process on it.
    replica    TEXT COLLATE "C" NOT NULL,
    instance   TEXT COLLATE "C" NOT NULL,
    -- Rises with every stream the host opens anywhere: a replica writes
    -- only while its stream is the current one.
    conn       BIGINT NOT NULL,
    connected  BOOLEAN NOT NULL,
    -- The holder renews its claim; a dead replica's lapses.
    expires_at BIGINT NOT NULL,
    hello      BYTEA,
    report     BYTEA,
    -- Followers read rows past the revision they have seen; numbered in
    -- commit order like changes.rev (the writer holds the same kind of
    -- lock to commit).
    rev        BIGINT NOT NULL
);
CREATE SEQUENCE host_live_rev;
CREATE SEQUENCE host_live_conn;
CREATE INDEX host_live_rev_idx ON host_live (rev);
