-- Each snapshot reads the images pulled to its host.
CREATE INDEX image_pulls_host ON image_pulls (host_id);
