-- The hosts an image was pulled to (eitri image pull): each keeps the
-- image's current version pinned in its cache while its row is here.
CREATE TABLE image_pulls (
    name       TEXT NOT NULL,
    host_id    TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (name, host_id)
);
