-- Initial schema.
--
-- Portability notes (for a later PostgreSQL backend): times are BIGINT unix
-- nanoseconds (UTC), booleans are BOOLEAN, secrets' hashes are BLOB (BYTEA in
-- PostgreSQL) and vm_events.id is SQLite's rowid alias (an identity column in
-- PostgreSQL). Everything else is plain SQL.

CREATE TABLE users (
    id         TEXT PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    admin      BOOLEAN NOT NULL DEFAULT FALSE,
    created_at BIGINT NOT NULL
);

CREATE TABLE tokens (
    id           TEXT PRIMARY KEY,
    user_id      TEXT NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    name         TEXT NOT NULL,
    kind         TEXT NOT NULL CHECK (kind IN ('pat', 'session')),
    hash         BLOB NOT NULL UNIQUE,
    created_at   BIGINT NOT NULL,
    expires_at   BIGINT,
    last_used_at BIGINT
);
CREATE INDEX tokens_user_kind ON tokens (user_id, kind, created_at);

CREATE TABLE hosts (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL,
    credential_hash BLOB NOT NULL UNIQUE,
    agent_version   TEXT NOT NULL DEFAULT '',
    address         TEXT NOT NULL DEFAULT '',
    accelerator     TEXT NOT NULL DEFAULT '',
    created_at      BIGINT NOT NULL,
    last_seen_at    BIGINT
);
CREATE INDEX hosts_name ON hosts (name, id);

CREATE TABLE join_tokens (
    id         TEXT PRIMARY KEY,
    hash       BLOB NOT NULL UNIQUE,
    created_by TEXT NOT NULL DEFAULT '',
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    used_at    BIGINT,
    -- The host this token enrolled; the token row outlives a decommissioned host.
    host_id    TEXT REFERENCES hosts (id) ON DELETE SET NULL
);

CREATE TABLE vms (
    id                 TEXT PRIMARY KEY,
    owner_id           TEXT NOT NULL REFERENCES users (id),
    -- NULL while the VM is not placed on a host.
    host_id            TEXT REFERENCES hosts (id),
    name               TEXT NOT NULL,
    image_url          TEXT NOT NULL DEFAULT '',
    image_sha256       TEXT NOT NULL DEFAULT '',
    vcpus              INTEGER NOT NULL DEFAULT 0,
    mem_mb             BIGINT NOT NULL DEFAULT 0,
    disk_gb            BIGINT NOT NULL DEFAULT 0,
    power_state        TEXT NOT NULL CHECK (power_state IN ('running', 'stopped')),
    status             TEXT NOT NULL DEFAULT '',
    last_error         TEXT NOT NULL DEFAULT '',
    assigned_ip        TEXT NOT NULL DEFAULT '',
    ssh_authorized_key TEXT NOT NULL DEFAULT '',
    ssh_host_pubkey    TEXT NOT NULL DEFAULT '',
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL,
    deleted_at         BIGINT,
    destroy_at         BIGINT,
    -- A soft-deleted VM keeps its name until it is destroyed, so a restore
    -- can never collide.
    UNIQUE (owner_id, name)
);
CREATE INDEX vms_created ON vms (created_at, id);
CREATE INDEX vms_owner ON vms (owner_id, created_at, id);
CREATE INDEX vms_host ON vms (host_id, created_at, id);

CREATE TABLE exposures (
    id           TEXT PRIMARY KEY,
    vm_id        TEXT NOT NULL REFERENCES vms (id) ON DELETE CASCADE,
    host_id      TEXT NOT NULL REFERENCES hosts (id),
    guest_port   INTEGER NOT NULL CHECK (guest_port BETWEEN 1 AND 65535),
    host_port    INTEGER NOT NULL CHECK (host_port BETWEEN 1 AND 65535),
    protocol     TEXT NOT NULL CHECK (protocol IN ('tcp', 'udp')),
    scope        TEXT NOT NULL CHECK (scope IN ('lan', 'local')),
    max_sessions BIGINT NOT NULL DEFAULT 0,
    created_at   BIGINT NOT NULL,
    UNIQUE (host_id, protocol, host_port)
);
CREATE INDEX exposures_vm ON exposures (vm_id, created_at, id);
CREATE INDEX exposures_created ON exposures (created_at, id);
CREATE INDEX exposures_host ON exposures (host_id, created_at, id);

CREATE TABLE vm_events (
    id      INTEGER PRIMARY KEY,
    vm_id   TEXT NOT NULL REFERENCES vms (id) ON DELETE CASCADE,
    at      BIGINT NOT NULL,
    kind    TEXT NOT NULL,
    message TEXT NOT NULL DEFAULT ''
);
CREATE INDEX vm_events_vm ON vm_events (vm_id, at, id);
