-- Catalogue watchers on every replica see an image added or removed, not
-- only moved to a new version (0015): both are in the change feed too.
CREATE TRIGGER images_added_removed AFTER INSERT OR DELETE ON images
    FOR EACH ROW EXECUTE FUNCTION eitri_note_image_change('image');
