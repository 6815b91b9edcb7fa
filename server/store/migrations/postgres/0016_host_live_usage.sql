-- A host's newest usage sample (UsageSample, marshalled) beside its
-- report: the holder writes each one as it arrives, and followers on other
-- replicas add it to their own windows, so a watcher on any replica charts
-- every host. Live, like the rest of the row: lost with it, resent in 10 s.
ALTER TABLE host_live ADD COLUMN usage BYTEA;
