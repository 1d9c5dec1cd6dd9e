//! The inference engine: model forward pass over the paged KV pool, sampling, continuous batching.
