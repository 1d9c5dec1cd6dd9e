//! The pdmesh command: up, model fetch, and each service.
