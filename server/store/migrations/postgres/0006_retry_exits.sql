-- retry rises with every RetryVM; the host resets the VM's budgets when it
-- sees a higher one. exits_seen is how many unexpected guest exits the
-- host had reported when the last one was recorded as an event, so a
-- report resent after a reconnect records nothing twice.
ALTER TABLE vms ADD COLUMN retry BIGINT NOT NULL DEFAULT 0;
ALTER TABLE vms ADD COLUMN exits_seen BIGINT NOT NULL DEFAULT 0;
