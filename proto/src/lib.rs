//! pdmesh-proto: the generated prost/tonic types for every pdmesh gRPC package. Only each
//! service's ingress module uses these; the rest of the code works on domain types.

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
