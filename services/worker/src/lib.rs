//! Worker service: the engine in an actix actor behind pdmesh.worker.v1.
