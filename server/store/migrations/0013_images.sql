-- The image catalogue (see images.go): a name, its properties, where its
-- digest is resolved from, and the versions it pointed at. The keyring is
-- the OpenPGP keys pinned for the image's SUMS signature.
CREATE TABLE images (
    name               TEXT PRIMARY KEY,
    os                 TEXT NOT NULL DEFAULT '',
    os_version         TEXT NOT NULL DEFAULT '',
    architecture       TEXT NOT NULL DEFAULT '',
    login_user         TEXT NOT NULL DEFAULT '',
    min_disk_gb        INTEGER NOT NULL DEFAULT 0,
    min_mem_mb         INTEGER NOT NULL DEFAULT 0,
    description        TEXT NOT NULL DEFAULT '',
    readiness          TEXT NOT NULL DEFAULT '',
    url                TEXT NOT NULL,
    sums_url           TEXT NOT NULL DEFAULT '',
    sums_signature_url TEXT NOT NULL DEFAULT '',
    sums_file_name     TEXT NOT NULL DEFAULT '',
    keyring            BLOB,
    current_version    INTEGER NOT NULL,
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL
);

-- The last few versions of each name, current among them.
CREATE TABLE image_versions (
    name               TEXT NOT NULL,
    version            INTEGER NOT NULL,
    url                TEXT NOT NULL,
    sha256             TEXT NOT NULL,
    sha512             TEXT NOT NULL DEFAULT '',
    size               INTEGER NOT NULL DEFAULT 0,
    sums_url           TEXT NOT NULL DEFAULT '',
    sums_signature_url TEXT NOT NULL DEFAULT '',
    signer             TEXT NOT NULL DEFAULT '',
    verified_at        INTEGER,
    added_by           TEXT NOT NULL DEFAULT '',
    created_at         INTEGER NOT NULL,
    PRIMARY KEY (name, version)
);

-- What a VM was created by: a catalogue name and version ('' and 0 for a
-- URL), and how its guest is judged ready ('' for the host's default).
ALTER TABLE vms ADD COLUMN image_name TEXT NOT NULL DEFAULT '';
ALTER TABLE vms ADD COLUMN image_version INTEGER NOT NULL DEFAULT 0;
ALTER TABLE vms ADD COLUMN readiness TEXT NOT NULL DEFAULT '';
