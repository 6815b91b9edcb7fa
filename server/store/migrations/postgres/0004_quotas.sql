-- Per-user quotas. A NULL limit is "not set here": a user's limit then
-- follows the default, and a default follows the built-in value.
CREATE TABLE quota_defaults (
    -- One row at most.
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    vms       BIGINT,
    vcpus     BIGINT,
    mem_mb    BIGINT,
    disk_gb   BIGINT,
    exposures BIGINT,
    streams   BIGINT
);

CREATE TABLE user_quotas (
    user_id   TEXT COLLATE "C" PRIMARY KEY REFERENCES users (id) ON DELETE CASCADE,
    vms       BIGINT,
    vcpus     BIGINT,
    mem_mb    BIGINT,
    disk_gb   BIGINT,
    exposures BIGINT,
    streams   BIGINT
);
