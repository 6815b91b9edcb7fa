-- The image catalogue (see images.go): a name, its properties, where its
-- digest is resolved from, and the versions it pointed at. The keyring is
-- the OpenPGP keys pinned for the image's SUMS signature.
CREATE TABLE images (
    name               TEXT COLLATE "C" PRIMARY KEY,
    os                 TEXT COLLATE "C" NOT NULL DEFAULT '',
    os_version         TEXT COLLATE "C" NOT NULL DEFAULT '',
    architecture       TEXT COLLATE "C" NOT NULL DEFAULT '',
    login_user         TEXT COLLATE "C" NOT NULL DEFAULT '',
    min_disk_gb        BIGINT NOT NULL DEFAULT 0,
    min_mem_mb         BIGINT NOT NULL DEFAULT 0,
    description        TEXT COLLATE "C" NOT NULL DEFAULT '',
    readiness          TEXT COLLATE "C" NOT NULL DEFAULT '',
    url                TEXT COLLATE "C" NOT NULL,
    sums_url           TEXT COLLATE "C" NOT NULL DEFAULT '',
    sums_signature_url TEXT COLLATE "C" NOT NULL DEFAULT '',
    sums_file_name     TEXT COLLATE "C" NOT NULL DEFAULT '',
    keyring            BYTEA,
    current_version    BIGINT NOT NULL,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL
);

-- The last few versions of each name, current among them.
CREATE TABLE image_versions (
    name               TEXT COLLATE "C" NOT NULL,
    version            BIGINT NOT NULL,
    url                TEXT COLLATE "C" NOT NULL,
    sha256             TEXT COLLATE "C" NOT NULL,
    sha512             TEXT COLLATE "C" NOT NULL DEFAULT '',
    size               BIGINT NOT NULL DEFAULT 0,
    sums_url           TEXT COLLATE "C" NOT NULL DEFAULT '',
    sums_signature_url TEXT COLLATE "C" NOT NULL DEFAULT '',
    signer             TEXT COLLATE "C" NOT NULL DEFAULT '',
    verified_at        BIGINT,
    added_by           TEXT COLLATE "C" NOT NULL DEFAULT '',
    created_at         BIGINT NOT NULL,
    PRIMARY KEY (name, version)
);

-- What a VM was created by: a catalogue name and version ('' and 0 for a
-- URL), and how its guest is judged ready ('' for the host's default).
ALTER TABLE vms ADD COLUMN image_name TEXT COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE vms ADD COLUMN image_version BIGINT NOT NULL DEFAULT 0;
ALTER TABLE vms ADD COLUMN readiness TEXT COLLATE "C" NOT NULL DEFAULT '';
