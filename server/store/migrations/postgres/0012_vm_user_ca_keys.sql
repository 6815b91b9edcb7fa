-- The SSH user CA keys each guest's seed was handed (newline-separated
-- authorized_keys lines), so a VM still trusting only a rotated-out CA can
-- be shown; empty for VMs created before they were recorded.
ALTER TABLE vms ADD COLUMN user_ca_keys TEXT NOT NULL DEFAULT '';
