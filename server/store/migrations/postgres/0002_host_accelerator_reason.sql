-- Why the host runs guests under its accelerator, as its agent last said.
ALTER TABLE hosts ADD COLUMN accelerator_reason TEXT COLLATE "C" NOT NULL DEFAULT '';
