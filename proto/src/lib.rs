//! Every pdmesh .proto compiled once, without a system protoc.
