//! The CUDA C kernel sources in `kernels/cuda/`, embedded at compile time, for NVRTC to
//! compile at run time (see the `nvrtc` feature). `common.cuh` is prepended to every
//! source: NVRTC runs without an include path, so the sources `#include` nothing.
//!
//! Each kernel's comment in its `.cu` file states its launch geometry (part of the
//! contract with the host code that launches it) and the CPU function it mirrors.

use sha2::{Digest, Sha256};

/// The header every source starts with.
pub const COMMON_HEADER: &str = include_str!("../cuda/common.cuh");

/// One `.cu` file: its module name, its text (without the common header) and the
/// `extern "C"` kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    pub name: &'static str,
    pub code: &'static str,
    pub kernels: &'static [&'static str],
}

impl KernelSource {
    /// The text NVRTC compiles: the common header, then the file.
    pub fn full_source(&self) -> String {
        format!(
            "{COMMON_HEADER}\n// ---- {}.cu ----\n{}",
            self.name, self.code
        )
    }
}

static SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "norm",
        code: include_str!("../cuda/norm.cu"),
        kernels: &["embed_gather", "rms_norm", "rope_pairs"],
    },
    KernelSource {
        name: "matmul",
        code: include_str!("../cuda/matmul.cu"),
        kernels: &["matmul_rows", "matmul_tiles", "swiglu", "add_in_place"],
    },
    KernelSource {
        name: "attention",
        code: include_str!("../cuda/attention.cu"),
        kernels: &["paged_attention_f16"],
    },
    KernelSource {
        name: "kv",
        code: include_str!("../cuda/kv.cu"),
        kernels: &["kv_write_f16", "gather_rows", "scatter_rows"],
    },
    KernelSource {
        name: "fp8",
        code: include_str!("../cuda/fp8.cu"),
        kernels: &["fp8_quantize_blocks", "fp8_dequantize_blocks"],
    },
    KernelSource {
        name: "dsa",
        code: include_str!("../cuda/dsa.cu"),
        kernels: &["dsa_index_scores", "topk_indices", "topk_indices_rows"],
    },
    KernelSource {
        name: "sampling",
        code: include_str!("../cuda/sampling.cu"),
        kernels: &["argmax_rows", "log_softmax_rows"],
    },
    KernelSource {
        name: "checksum",
        code: include_str!("../cuda/checksum.cu"),
        kernels: &["page_checksum_xxh3"],
    },
    KernelSource {
        name: "deepseek",
        // deepseek.cu uses fp8.cu's e4m3 helpers: the module is fp8.cu's text, then its own.
        code: concat!(
            include_str!("../cuda/fp8.cu"),
            "\n// ---- deepseek.cu ----\n",
            include_str!("../cuda/deepseek.cu")
        ),
        kernels: &[
            "ds_rms_norm_inplace",
            "ds_rope_interleaved",
            "ds_index_prep",
            "ds_scale",
            "ds_write_entry",
            "ds_index_scores_paged",
            "ds_mla_attention",
            "ds_moe_combine",
        ],
    },
];

/// Every kernel source, in a fixed order.
pub fn sources() -> &'static [KernelSource] {
    SOURCES
}

/// The source that defines `kernel`, if any.
pub fn source_of(kernel: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.kernels.contains(&kernel))
}

/// SHA-256 (lowercase hex) of the header and every source with its name and kernel list:
/// any change to the text NVRTC would compile, or to what a module is said to hold,
/// changes it. Compiled-PTX caches are keyed by it.
pub fn source_hash() -> String {
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HASH.get_or_init(|| {
        let mut h = Sha256::new();
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(COMMON_HEADER.as_bytes());
        for s in SOURCES {
            field(s.name.as_bytes());
            field(s.code.as_bytes());
            for k in s.kernels {
                field(k.as_bytes());
            }
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels the host launcher is written against.
    const EXPECTED: &[&str] = &[
        "embed_gather",
        "rms_norm",
        "rope_pairs",
        "kv_write_f16",
        "paged_attention_f16",
        "matmul_rows",
        "matmul_tiles",
        "swiglu",
        "add_in_place",
        "argmax_rows",
        "log_softmax_rows",
        "gather_rows",
        "scatter_rows",
        "fp8_quantize_blocks",
        "fp8_dequantize_blocks",
        "dsa_index_scores",
        "topk_indices",
        "topk_indices_rows",
        "page_checksum_xxh3",
        "ds_rms_norm_inplace",
        "ds_rope_interleaved",
        "ds_index_prep",
        "ds_scale",
        "ds_write_entry",
        "ds_index_scores_paged",
        "ds_mla_attention",
        "ds_moe_combine",
    ];

    #[test]
    fn every_kernel_is_listed_exactly_once() {
        let listed: Vec<&str> = sources()
            .iter()
            .flat_map(|s| s.kernels.iter().copied())
            .collect();
        for k in EXPECTED {
            assert_eq!(
                listed.iter().filter(|l| *l == k).count(),
                1,
                "{k} listed {listed:?}"
            );
        }
        assert_eq!(listed.len(), EXPECTED.len(), "{listed:?}");
    }

    #[test]
    fn each_listed_kernel_is_defined_extern_c_in_its_source_and_nothing_is_included() {
        for s in sources() {
            for k in s.kernels {
                let needle = format!("{k}(");
                let at = s.code.match_indices(&needle).find(|(i, _)| {
                    let before = &s.code[..*i];
                    let decl = &before[before.rfind("extern \"C\"").unwrap_or(0)..];
                    before.contains("extern \"C\"") && !decl.contains(';') && !decl.contains('}')
                });
                assert!(
                    at.is_some(),
                    "{k} is not an extern \"C\" kernel in {}.cu",
                    s.name
                );
                assert_eq!(source_of(k).map(|x| x.name), Some(s.name));
            }
            let full = s.full_source();
            assert!(full.starts_with(COMMON_HEADER));
            assert!(
                !full.lines().any(|l| l.trim_start().starts_with("#include")),
                "{}: NVRTC runs without an include path",
                s.name
            );
        }
    }

    #[test]
    fn the_hash_is_stable_hex() {
        let h = source_hash();
        assert_eq!(h.len(), 64);
        assert!(
            h.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(h, source_hash());
    }
}
