-- Agent builds the control plane hands out, and the rollouts that hand them
-- out (see releases.go, rollouts.go). A build is kept whole in its row: every
-- replica serves the same bytes, and uploads are bounded (MaxReleaseSize).
CREATE TABLE releases (
    sha256      TEXT COLLATE "C" PRIMARY KEY,
    version     TEXT COLLATE "C" NOT NULL,
    os          TEXT COLLATE "C" NOT NULL,
    arch        TEXT COLLATE "C" NOT NULL,
    size        BIGINT NOT NULL,
    key_id      TEXT COLLATE "C" NOT NULL,
    signature   BYTEA NOT NULL,
    data        BYTEA NOT NULL,
    uploaded_by TEXT COLLATE "C" NOT NULL,
    uploaded_at BIGINT NOT NULL,
    UNIQUE (version, os, arch)
);

-- One rollout row holds its hosts' states (JSON) so a step of the rollout
-- is one row's update; any replica may take the step.
CREATE TABLE rollouts (
    id              TEXT COLLATE "C" PRIMARY KEY,
    version         TEXT COLLATE "C" NOT NULL,
    state           TEXT COLLATE "C" NOT NULL,
    reason          TEXT NOT NULL DEFAULT '',
    max_unavailable INTEGER NOT NULL,
    allow_downgrade BOOLEAN NOT NULL DEFAULT FALSE,
    hosts           TEXT NOT NULL,
    created_by      TEXT COLLATE "C" NOT NULL,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL
);

-- The agent's platform (from its hello) and its own word on its last
-- upgrade (JSON; empty when it never had one).
ALTER TABLE hosts ADD COLUMN os TEXT COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE hosts ADD COLUMN arch TEXT COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE hosts ADD COLUMN upgrade TEXT NOT NULL DEFAULT '';
