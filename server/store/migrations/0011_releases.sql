-- Agent builds the control plane hands out, and the rollouts that hand them
-- out (see releases.go, rollouts.go). A build is kept whole in its row: every
-- replica serves the same bytes, and uploads are bounded (MaxReleaseSize).
CREATE TABLE releases (
    sha256      TEXT PRIMARY KEY,
    version     TEXT NOT NULL,
    os          TEXT NOT NULL,
    arch        TEXT NOT NULL,
    size        INTEGER NOT NULL,
    key_id      TEXT NOT NULL,
    signature   BLOB NOT NULL,
    data        BLOB NOT NULL,
    uploaded_by TEXT NOT NULL,
    uploaded_at INTEGER NOT NULL,
    UNIQUE (version, os, arch)
);

-- One rollout row holds its hosts' states (JSON) so a step of the rollout
-- is one row's update.
CREATE TABLE rollouts (
    id              TEXT PRIMARY KEY,
    version         TEXT NOT NULL,
    state           TEXT NOT NULL,
    reason          TEXT NOT NULL DEFAULT '',
    max_unavailable INTEGER NOT NULL,
    allow_downgrade BOOLEAN NOT NULL DEFAULT FALSE,
    hosts           TEXT NOT NULL,
    created_by      TEXT NOT NULL,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);

-- The agent's platform (from its hello) and its own word on its last
-- upgrade (JSON; empty when it never had one).
ALTER TABLE hosts ADD COLUMN os TEXT NOT NULL DEFAULT '';
ALTER TABLE hosts ADD COLUMN arch TEXT NOT NULL DEFAULT '';
ALTER TABLE hosts ADD COLUMN upgrade TEXT NOT NULL DEFAULT '';
