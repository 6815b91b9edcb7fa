-- PostgreSQL puts images added and removed in the change feed for other
-- replicas' catalogue watchers; a SQLite control plane is one process. This
-- keeps both engines' schemas at one version.
SELECT 1;
