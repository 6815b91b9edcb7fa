-- The hosts an image was pulled to (eitri image pull): each keeps the
-- image's current version pinned in its cache while its row is here.
CREATE TABLE image_pulls (
    name       TEXT COLLATE "C" NOT NULL,
    host_id    TEXT COLLATE "C" NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (name, host_id)
);
