-- The control plane's durable identity and counters, one row (made by the
-- store on open, since its identity is random). generation counts every
-- desired-state snapshot and every change to a VM's desired state; epoch
-- rises when the control plane finds it lost writes an agent had seen.
CREATE TABLE control_plane (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    identity   TEXT COLLATE "C" NOT NULL,
    epoch      BIGINT NOT NULL,
    generation BIGINT NOT NULL
);

-- The generation at which the VM's desired state last changed; 0 for rows
-- from before fencing.
ALTER TABLE vms ADD COLUMN desired_gen BIGINT NOT NULL DEFAULT 0;
