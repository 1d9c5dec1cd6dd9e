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

        /// Each value but `TOOL_FORMAT_NONE` names a tool-call format the way
        /// pdmesh-chat's `ToolFormat::name` does, in capitals after the prefix
        /// (`TOOL_FORMAT_DEEPSEEK_V31` is `deepseek_v31`): the services' edges convert
        /// through these two, so no table of formats is written twice.
        impl ToolFormat {
            const PREFIX: &'static str = "TOOL_FORMAT_";

            /// The format's name; `None` for `TOOL_FORMAT_NONE`.
            pub fn format_name(self) -> Option<String> {
                match self {
                    Self::None => None,
                    f => f
                        .as_str_name()
                        .strip_prefix(Self::PREFIX)
                        .map(str::to_ascii_lowercase),
                }
            }

            /// The value that names the format `name`, if the proto has one.
            pub fn from_format_name(name: &str) -> Option<Self> {
                let value = format!("{}{}", Self::PREFIX, name.to_ascii_uppercase());
                Self::from_str_name(&value).filter(|f| *f != Self::None)
            }
        }
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
