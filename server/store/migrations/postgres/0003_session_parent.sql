-- A console session belongs to the token that opened it and is deleted with
-- it. Sessions from before this column have no such token: they end here,
-- and their users log in again.
DELETE FROM tokens WHERE kind = 'session';
ALTER TABLE tokens ADD COLUMN parent_id TEXT COLLATE "C" REFERENCES tokens (id) ON DELETE CASCADE;
CREATE INDEX tokens_parent ON tokens (parent_id);
