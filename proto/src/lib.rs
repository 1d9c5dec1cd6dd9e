//! pdmesh-proto: the generated prost/tonic types for every pdmesh gRPC package. Only each
//! service's ingress module uses these; the rest of the code works on domain types.
//!
//! [`sglang`] and [`smg`] are compatibility packages: the SGLang scheduler protocol that
//! other backends' gateways (smg) speak, kept wire-identical to smg-grpc-proto 0.4.28 (see
//! tests/sglang_wire.rs and scripts/proto/sglang_wire_fixtures.py).

#![forbid(unsafe_code)]

pub mod error_kind;

pub mod tokenizer {
    pub mod v1 {
        tonic::include_proto!("pdmesh.tokenizer.v1");
    }
}

pub mod worker {
    pub mod v1 {
        tonic::include_proto!("pdmesh.worker.v1");
    }
}

pub mod cache {
    pub mod v1 {
        tonic::include_proto!("pdmesh.cache.v1");
    }
}

/// Compatibility packages: the SGLang scheduler protocol (with the smg common package it
/// imports) that other backends' gateways speak, so a pdmesh worker can serve behind them.
/// Generated code; the scheduler's types refer to the common ones through
/// `super::super::super::smg::grpc::common`, hence this nesting at the crate root.
pub mod sglang {
    pub mod grpc {
        pub mod scheduler {
            tonic::include_proto!("sglang.grpc.scheduler");
        }
    }
}

/// The smg gateway's shared package (`smg.grpc.common`): tokenizer download, KV cache
/// events and cache flushing, used by [`sglang::grpc::scheduler`].
pub mod smg {
    pub mod grpc {
        pub mod common {
            tonic::include_proto!("smg.grpc.common");
        }
    }
}
