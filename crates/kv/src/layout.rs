//! `KvLayout`: per-layer KV components, their dtypes and scale placement, and every
//! derived size (bytes per token, per page, per pool) plus a stable fingerprint.

use std::fmt;
use std::ops::Range;

/// Element type of a KV component or of its scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    Bf16,
    Fp8E4m3,
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Fp8E4m3 | DType::U8 => 1,
        }
    }

    /// Stable lowercase name, used in descriptions and the fingerprint.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::Fp8E4m3 => "fp8_e4m3",
            DType::U8 => "u8",
        }
    }
}

/// Where a component's scales live inside a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScalePlacement {
    /// Each token's scales follow that token's values.
    BesideToken,
    /// All values of the page first, then all the page's scales (SGLang's fp8 index-K).
    PageTail,
}

/// Quantization scales of a component: one scale of `dtype` per `block` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScaleSpec {
    pub dtype: DType,
    pub block: usize,
    pub placement: ScalePlacement,
}

/// One KV component of a layer (e.g. `k`, `v`, `mla_latent`, `index_k`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Component {
    pub name: String,
    pub dtype: DType,
    pub elems_per_token: usize,
    pub scale: Option<ScaleSpec>,
}

impl Component {
    /// A component without scales.
    pub fn plain(name: &str, dtype: DType, elems_per_token: usize) -> Self {
        Self {
            name: name.to_owned(),
            dtype,
            elems_per_token,
            scale: None,
        }
    }

    /// A quantized component with one scale per `block` values.
    pub fn scaled(
        name: &str,
        dtype: DType,
        elems_per_token: usize,
        scale_dtype: DType,
        block: usize,
        placement: ScalePlacement,
    ) -> Self {
        Self {
            name: name.to_owned(),
            dtype,
            elems_per_token,
            scale: Some(ScaleSpec {
                dtype: scale_dtype,
                block,
                placement,
            }),
        }
    }

    /// DeepSeek V3.2's indexer key in fp8: `elems_per_token` e4m3 values, one f32 scale
    /// per [`FP8_SCALE_BLOCK`] of them, the scales at the page's tail.
    pub fn fp8_index_k(elems_per_token: usize) -> Self {
        Self::scaled(
            "index_k",
            DType::Fp8E4m3,
            elems_per_token,
            DType::F32,
            FP8_SCALE_BLOCK,
            ScalePlacement::PageTail,
        )
    }

    /// Bytes of values (without scales) for one token.
    pub fn value_bytes_per_token(&self) -> usize {
        self.elems_per_token * self.dtype.size_bytes()
    }

    /// Bytes of scales for one token.
    pub fn scale_bytes_per_token(&self) -> usize {
        match self.scale {
            None => 0,
            Some(s) => self.elems_per_token.div_ceil(s.block) * s.dtype.size_bytes(),
        }
    }

    /// Values plus scales for one token.
    pub fn bytes_per_token(&self) -> usize {
        self.value_bytes_per_token() + self.scale_bytes_per_token()
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "{}:{}x{}",
            self.name,
            self.dtype.name(),
            self.elems_per_token
        );
        if let Some(sc) = self.scale {
            let at = match sc.placement {
                ScalePlacement::BesideToken => "token",
                ScalePlacement::PageTail => "tail",
            };
            s.push_str(&format!("+{}/{}@{}", sc.dtype.name(), sc.block, at));
        }
        s
    }
}

/// `--kv-cache-dtype`: how a DeepSeek MLA latent is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MlaCacheDtype {
    /// The whole latent (compressed KV and rope part) in bf16.
    Bf16,
    /// FlashMLA's fp8 record: the compressed KV in fp8 e4m3 with one f32 scale per 128
    /// values beside it, then the rope part in bf16.
    Fp8,
}

/// `--index-k-dtype`: how the DSA indexer's key is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IndexKDtype {
    /// fp8 e4m3 with one f32 scale per 128 values, the page's scales after all its values
    /// (SGLang's layout).
    Fp8,
    /// bf16, no scale.
    Bf16,
}

/// The per-layer cache dimensions of a DeepSeek V3.2 model (MLA + DSA indexer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaDims {
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
    pub index_head_dim: usize,
}

impl MlaDims {
    /// DeepSeek-V3.2's own: 512 + 64 latent values, 128 index-K values.
    pub const V32: MlaDims = MlaDims {
        kv_lora_rank: 512,
        rope_dim: 64,
        index_head_dim: 128,
    };
}

/// How a group of layers attends, which decides which of a sequence's KV pages the
/// group's layers still read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Attention {
    /// Every earlier position.
    Full,
    /// The last `window` positions, the token's own included (Gemma 3's local layers:
    /// 512).
    SlidingWindow { window: usize },
}

impl Attention {
    /// The first position a token at `pos` reads.
    pub fn first_visible(self, pos: usize) -> usize {
        match self {
            Attention::Full => 0,
            Attention::SlidingWindow { window } => (pos + 1).saturating_sub(window),
        }
    }

    fn describe(self) -> String {
        match self {
            Attention::Full => "full".into(),
            Attention::SlidingWindow { window } => format!("window {window}"),
        }
    }
}

/// Layers that attend alike. A layout's groups cover every layer once.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LayerGroup {
    pub attention: Attention,
    /// Ascending layer indices.
    pub layers: Vec<usize>,
}

impl LayerGroup {
    /// `1-4,6,8-9`: the layers as runs.
    fn describe_layers(&self) -> String {
        let mut runs: Vec<String> = Vec::new();
        let mut i = 0;
        while i < self.layers.len() {
            let mut j = i;
            while j + 1 < self.layers.len() && self.layers[j + 1] == self.layers[j] + 1 {
                j += 1;
            }
            runs.push(if i == j {
                self.layers[i].to_string()
            } else {
                format!("{}-{}", self.layers[i], self.layers[j])
            });
            i = j + 1;
        }
        runs.join(",")
    }
}

/// Values per fp8 scale in DeepSeek's caches.
pub const FP8_SCALE_BLOCK: usize = 128;

/// Invalid layout description.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("a KV layout needs at least one layer, one component and a page size > 0")]
    Empty,
    #[error("component {0:?} has no elements or a zero scale block")]
    BadComponent(String),
    #[error("component name {0:?} appears twice")]
    DuplicateName(String),
    #[error("a page of this layout would exceed {max} bytes")]
    TooLarge { max: usize },
    #[error("layer groups must cover each of the {layers} layers exactly once, with windows > 0")]
    BadGroups { layers: usize },
}

/// The largest page any layout may have. Every size derives from the layout, so bounding
/// the page bounds them all: no size computation can overflow, whoever sent the layout.
pub const MAX_PAGE_BYTES: usize = 1 << 30;

/// The complete KV layout of a model: `layers` layers, each holding the same
/// `components`, stored in pages of `page_size` tokens.
///
/// A page holds `page_size` tokens of every component of every layer: layer-major, then
/// component, then (values, scales) as the component's placement says.
///
/// Layers fall into [`LayerGroup`]s by how they attend (one full-attention group unless
/// [`KvLayout::with_groups`] says otherwise). The grouping decides which pages each
/// layer still reads, so it is part of the fingerprint: a worker that believes every
/// layer is global does not share a layout with one that knows some slide.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct KvLayout {
    name: String,
    layers: usize,
    page_size: usize,
    components: Vec<Component>,
    /// Empty for a dense layout (every layer full attention), so that making a layout,
    /// whoever describes it, costs nothing per layer.
    groups: Vec<LayerGroup>,
}

impl KvLayout {
    pub fn new(
        name: &str,
        layers: usize,
        page_size: usize,
        components: Vec<Component>,
    ) -> Result<Self, LayoutError> {
        if layers == 0 || page_size == 0 || components.is_empty() {
            return Err(LayoutError::Empty);
        }
        for (i, c) in components.iter().enumerate() {
            if c.elems_per_token == 0 || c.scale.is_some_and(|s| s.block == 0) {
                return Err(LayoutError::BadComponent(c.name.clone()));
            }
            if components[..i].iter().any(|o| o.name == c.name) {
                return Err(LayoutError::DuplicateName(c.name.clone()));
            }
        }
        // The page size with checked arithmetic (values, then scales, per component).
        let too_large = LayoutError::TooLarge {
            max: MAX_PAGE_BYTES,
        };
        let mut per_token = 0usize;
        for c in &components {
            let values = c.elems_per_token.checked_mul(c.dtype.size_bytes());
            let scales = match c.scale {
                None => Some(0),
                Some(s) => c
                    .elems_per_token
                    .div_ceil(s.block)
                    .checked_mul(s.dtype.size_bytes()),
            };
            per_token = values
                .zip(scales)
                .and_then(|(v, s)| v.checked_add(s))
                .and_then(|b| per_token.checked_add(b))
                .ok_or(too_large.clone())?;
        }
        let page = per_token
            .checked_mul(page_size)
            .and_then(|b| b.checked_mul(layers))
            .filter(|&b| b <= MAX_PAGE_BYTES);
        if page.is_none() {
            return Err(too_large);
        }
        Ok(Self {
            name: name.to_owned(),
            layers,
            page_size,
            components,
            groups: Vec::new(),
        })
    }

    /// This layout with its layers grouped by how they attend; every layer in exactly one
    /// group, groups in the order given, each group's layers ascending, windows above 0.
    /// Groups of one attention kind may not repeat (they would be one group). One
    /// full-attention group is the dense layout.
    pub fn with_groups(mut self, groups: Vec<LayerGroup>) -> Result<Self, LayoutError> {
        let bad = LayoutError::BadGroups {
            layers: self.layers,
        };
        // Only as many layers as listed are checked one by one (a description from the
        // wire cannot make this allocate for layers it does not list).
        if groups.iter().map(|g| g.layers.len()).sum::<usize>() != self.layers {
            return Err(bad);
        }
        let mut seen = vec![false; self.layers];
        for (i, g) in groups.iter().enumerate() {
            if g.layers.is_empty()
                || g.attention == (Attention::SlidingWindow { window: 0 })
                || groups[..i].iter().any(|o| o.attention == g.attention)
                || g.layers.windows(2).any(|w| w[0] >= w[1])
            {
                return Err(bad);
            }
            for &l in &g.layers {
                if l >= self.layers || std::mem::replace(&mut seen[l], true) {
                    return Err(bad);
                }
            }
        }
        if seen.contains(&false) {
            return Err(bad);
        }
        self.groups = if groups.iter().all(|g| g.attention == Attention::Full) {
            Vec::new()
        } else {
            groups
        };
        Ok(self)
    }

    /// This layout with the layers `global` attending over the whole context and every
    /// other one over a sliding window of `window` positions (Gemma 3: every sixth layer
    /// global, 512).
    pub fn with_window(self, window: usize, global: &[usize]) -> Result<Self, LayoutError> {
        let local: Vec<usize> = (0..self.layers).filter(|l| !global.contains(l)).collect();
        let groups = [
            (Attention::Full, global.to_vec()),
            (Attention::SlidingWindow { window }, local),
        ];
        self.with_groups(
            groups
                .into_iter()
                .filter(|(_, layers)| !layers.is_empty())
                .map(|(attention, layers)| LayerGroup { attention, layers })
                .collect(),
        )
    }

    /// The layer groups, in order; none for a dense layout (every layer full attention).
    pub fn groups(&self) -> &[LayerGroup] {
        &self.groups
    }

    /// Whether some layers attend otherwise than over the whole context.
    pub fn is_hybrid(&self) -> bool {
        !self.groups.is_empty()
    }

    /// How layer `layer` attends.
    pub fn attention(&self, layer: usize) -> Attention {
        self.groups
            .iter()
            .find(|g| g.layers.contains(&layer))
            .map_or(Attention::Full, |g| g.attention)
    }

    /// Bytes of a page holding group `group`'s layers.
    pub fn group_bytes_per_page(&self, group: usize) -> usize {
        self.groups[group].layers.len() * self.layer_bytes_per_page()
    }

    /// The pages (by index in the sequence) of group `group` that the token at position
    /// `tokens` reads from earlier positions: all of them for full attention; for a
    /// window, those holding its last `window - 1` positions.
    pub fn pages_read(&self, group: usize, tokens: usize) -> Range<usize> {
        let first = self.groups[group].attention.first_visible(tokens);
        let end = tokens.div_ceil(self.page_size);
        (first / self.page_size).min(end)..end
    }

    /// Bytes of KV a sequence of `tokens` positions must hand over so the next token can
    /// be computed: per group, [`Self::pages_read`] pages of its layers. A dense layout's
    /// is every page whole.
    pub fn handover_bytes(&self, tokens: usize) -> usize {
        if !self.is_hybrid() {
            return tokens.div_ceil(self.page_size) * self.bytes_per_page();
        }
        (0..self.groups.len())
            .map(|g| self.pages_read(g, tokens).len() * self.group_bytes_per_page(g))
            .sum()
    }

    /// Llama-family K and V caches: `kv_heads × head_dim` values each, per layer.
    pub fn llama(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        page_size: usize,
    ) -> Self {
        Self::new(
            "llama-kv",
            layers,
            page_size,
            vec![
                Component::plain("k", dtype, kv_heads * head_dim),
                Component::plain("v", dtype, kv_heads * head_dim),
            ],
        )
        .expect("llama layout is well formed")
    }

    /// DeepSeek V3.2's cache: per layer the MLA latent (`mla_latent`, or `mla_nope` +
    /// `mla_rope` in the fp8 form) and the DSA indexer's key (`index_k`). With V3.2's
    /// dimensions a token takes 1152 (bf16) or 656 (fp8) bytes of latent and 132 (fp8) or
    /// 256 (bf16) bytes of index-K per layer.
    pub fn deepseek_v32(
        layers: usize,
        dims: MlaDims,
        mla: MlaCacheDtype,
        index_k: IndexKDtype,
        page_size: usize,
    ) -> Result<Self, LayoutError> {
        let mut components = match mla {
            MlaCacheDtype::Bf16 => vec![Component::plain(
                "mla_latent",
                DType::Bf16,
                dims.kv_lora_rank + dims.rope_dim,
            )],
            MlaCacheDtype::Fp8 => vec![
                Component::scaled(
                    "mla_nope",
                    DType::Fp8E4m3,
                    dims.kv_lora_rank,
                    DType::F32,
                    FP8_SCALE_BLOCK,
                    ScalePlacement::BesideToken,
                ),
                Component::plain("mla_rope", DType::Bf16, dims.rope_dim),
            ],
        };
        components.push(match index_k {
            IndexKDtype::Fp8 => Component::fp8_index_k(dims.index_head_dim),
            IndexKDtype::Bf16 => Component::plain("index_k", DType::Bf16, dims.index_head_dim),
        });
        let name = format!(
            "deepseek-v32-mla-{}-index-k-{}",
            match mla {
                MlaCacheDtype::Bf16 => "bf16",
                MlaCacheDtype::Fp8 => "fp8",
            },
            match index_k {
                IndexKDtype::Fp8 => "fp8",
                IndexKDtype::Bf16 => "bf16",
            }
        );
        Self::new(&name, layers, page_size, components)
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn layers(&self) -> usize {
        self.layers
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn components(&self) -> &[Component] {
        &self.components
    }

    /// Index of the component called `name`.
    pub fn component_index(&self, name: &str) -> Option<usize> {
        self.components.iter().position(|c| c.name == name)
    }

    /// Bytes one token occupies in one layer (all components, scales included).
    pub fn bytes_per_token_per_layer(&self) -> usize {
        self.components.iter().map(Component::bytes_per_token).sum()
    }

    /// Bytes one token occupies across all layers.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token_per_layer() * self.layers
    }

    /// Bytes of one component of one layer within a page.
    pub fn component_bytes_per_page(&self, comp: usize) -> usize {
        self.components[comp].bytes_per_token() * self.page_size
    }

    /// Bytes of one layer within a page.
    pub fn layer_bytes_per_page(&self) -> usize {
        self.bytes_per_token_per_layer() * self.page_size
    }

    /// Bytes of one whole page (every layer, every component).
    pub fn bytes_per_page(&self) -> usize {
        self.layer_bytes_per_page() * self.layers
    }

    /// Bytes of a pool of `pages` pages.
    pub fn bytes_per_pool(&self, pages: usize) -> usize {
        self.bytes_per_page() * pages
    }

    /// Offset within a page of the region holding `comp` of `layer`.
    pub fn region_offset(&self, layer: usize, comp: usize) -> usize {
        let before: usize = (0..comp).map(|c| self.component_bytes_per_page(c)).sum();
        layer * self.layer_bytes_per_page() + before
    }

    /// Offset within a page of the values of token `slot` (0-based within the page).
    pub fn value_offset(&self, layer: usize, comp: usize, slot: usize) -> usize {
        self.region_offset(layer, comp) + slot * self.token_stride(comp)
    }

    /// Offset within a page of the scales of token `slot`, if the component has scales.
    pub fn scale_offset(&self, layer: usize, comp: usize, slot: usize) -> Option<usize> {
        let c = &self.components[comp];
        let s = c.scale?;
        let base = self.region_offset(layer, comp);
        let stride = self.scale_stride(comp)?;
        Some(match s.placement {
            ScalePlacement::BesideToken => base + slot * stride + c.value_bytes_per_token(),
            ScalePlacement::PageTail => {
                base + self.page_size * c.value_bytes_per_token() + slot * stride
            }
        })
    }

    /// Bytes from one token's values of `comp` to the next token's, within a page: the
    /// values alone, or values and scales when the scales sit beside each token.
    pub fn token_stride(&self, comp: usize) -> usize {
        let c = &self.components[comp];
        match c.scale.map(|s| s.placement) {
            Some(ScalePlacement::BesideToken) => c.bytes_per_token(),
            _ => c.value_bytes_per_token(),
        }
    }

    /// Bytes from one token's scales of `comp` to the next token's, if it has scales.
    pub fn scale_stride(&self, comp: usize) -> Option<usize> {
        let c = &self.components[comp];
        Some(match c.scale?.placement {
            ScalePlacement::BesideToken => c.bytes_per_token(),
            ScalePlacement::PageTail => c.scale_bytes_per_token(),
        })
    }

    /// The bytes, within one token's values of `comp`, holding its values `elems` (say
    /// one rank's heads of a K row). Panics past the component's values.
    pub fn value_bytes(&self, comp: usize, elems: Range<usize>) -> Range<usize> {
        let c = &self.components[comp];
        assert!(
            elems.start <= elems.end && elems.end <= c.elems_per_token,
            "values {elems:?} of component {:?}, which has {} per token",
            c.name,
            c.elems_per_token
        );
        let size = c.dtype.size_bytes();
        elems.start * size..elems.end * size
    }

    /// Where page `page` starts in a pool (or any run of whole pages) of this layout.
    pub fn page_offset(&self, page: usize) -> usize {
        page * self.bytes_per_page()
    }

    /// The page a byte offset of a pool falls in, and the offset within that page.
    pub fn locate(&self, at: usize) -> (usize, usize) {
        let bpp = self.bytes_per_page();
        (at / bpp, at % bpp)
    }

    /// The bytes of a page that hold layer `layer` (every component).
    pub fn layer_range(&self, layer: usize) -> Range<usize> {
        let start = self.region_offset(layer, 0);
        start..start + self.layer_bytes_per_page()
    }

    /// Where token `slot` of page `page` sits in a pool, as an offset every component's
    /// slot-0 offset adds to: `slot_offset(page, slot) + value_offset(layer, comp, 0)` is
    /// `page_offset(page) + value_offset(layer, comp, slot)` for every layer and component.
    /// `None` when the components' token strides differ, so that no one offset fits all
    /// (DeepSeek's cache).
    pub fn slot_offset(&self, page: usize, slot: usize) -> Option<usize> {
        let stride = self.token_stride(0);
        (1..self.components.len())
            .all(|c| self.token_stride(c) == stride)
            .then(|| self.page_offset(page) + slot * stride)
    }

    /// Human-readable description, used in error messages naming both sides; a hybrid
    /// layout's ends with its groups (`layers 5,11,17 full; 0-4,6-10,12-16 window 512`).
    pub fn describe(&self) -> String {
        let comps: Vec<String> = self.components.iter().map(Component::describe).collect();
        let mut s = format!(
            "{} [{}] x{} layers, page {} tokens, {} B/token/layer",
            self.name,
            comps.join(", "),
            self.layers,
            self.page_size,
            self.bytes_per_token_per_layer()
        );
        if self.is_hybrid() {
            s.push_str(&format!("; layers {}", self.describe_groups()));
        }
        s
    }

    fn describe_groups(&self) -> String {
        let groups: Vec<String> = self
            .groups
            .iter()
            .map(|g| format!("{} {}", g.describe_layers(), g.attention.describe()))
            .collect();
        groups.join("; ")
    }

    /// Stable 64-bit fingerprint of everything that decides where a byte goes and which
    /// bytes a layer reads. The name is excluded: two layouts that place bytes identically
    /// are compatible. A dense layout's is what it was before groups existed.
    pub fn fingerprint(&self) -> u64 {
        let comps: Vec<String> = self.components.iter().map(Component::describe).collect();
        let mut canon = format!("v1|{}|{}|{}", self.layers, self.page_size, comps.join(","));
        if self.is_hybrid() {
            canon.push_str(&format!("|groups:{}", self.describe_groups()));
        }
        xxhash_rust::xxh3::xxh3_64(canon.as_bytes())
    }

    /// Fingerprint as the fixed-width hex string carried on the wire and in logs.
    pub fn fingerprint_hex(&self) -> String {
        format!("{:016x}", self.fingerprint())
    }
}

impl fmt::Debug for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KvLayout({} #{})",
            self.describe(),
            self.fingerprint_hex()
        )
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (#{})", self.describe(), self.fingerprint_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3 270M's cache: 18 layers of one f16 KV head of 256, layers 5, 11 and 17
    /// global, the rest a window of 512.
    fn gemma3(page: usize) -> KvLayout {
        KvLayout::llama(18, 1, 256, DType::F16, page)
            .with_window(512, &[5, 11, 17])
            .unwrap()
    }

    #[test]
    fn a_hybrid_layout_names_its_groups_and_fingerprints_them() {
        let (hybrid, dense) = (gemma3(16), KvLayout::llama(18, 1, 256, DType::F16, 16));
        assert!(hybrid.is_hybrid() && !dense.is_hybrid());
        assert_ne!(hybrid.fingerprint(), dense.fingerprint());
        // A dense layout's fingerprint is the one it had before groups existed.
        let canon = "v1|18|16|k:f16x256,v:f16x256";
        assert_eq!(
            dense.fingerprint(),
            xxhash_rust::xxh3::xxh3_64(canon.as_bytes())
        );
        assert!(
            hybrid
                .describe()
                .ends_with("; layers 5,11,17 full; 0-4,6-10,12-16 window 512"),
            "{}",
            hybrid.describe()
        );
        // Another window is another layout.
        let mut other = hybrid.groups().to_vec();
        other[1].attention = Attention::SlidingWindow { window: 1024 };
        let wider = dense.clone().with_groups(other).unwrap();
        assert_ne!(wider.fingerprint(), hybrid.fingerprint());
        // Bytes do not move: the grouping decides what is read, not where it sits.
        assert_eq!(hybrid.bytes_per_page(), dense.bytes_per_page());
        assert_eq!(hybrid.region_offset(7, 1), dense.region_offset(7, 1));
        assert_eq!(hybrid.attention(5), Attention::Full);
        assert_eq!(
            hybrid.attention(6),
            Attention::SlidingWindow { window: 512 }
        );
    }

    #[test]
    fn groups_must_cover_every_layer_once() {
        let dense = || KvLayout::llama(4, 1, 64, DType::F16, 16);
        let g = |attention, layers: &[usize]| LayerGroup {
            attention,
            layers: layers.to_vec(),
        };
        let w = |window| Attention::SlidingWindow { window };
        let bad = Err(LayoutError::BadGroups { layers: 4 });
        let full = Attention::Full;
        assert_eq!(dense().with_groups(vec![g(full, &[0, 1, 2])]), bad);
        assert_eq!(dense().with_groups(vec![g(full, &[0, 1, 2, 3, 4])]), bad);
        assert_eq!(
            dense().with_groups(vec![g(full, &[0, 1]), g(w(8), &[1, 2, 3])]),
            bad
        );
        assert_eq!(
            dense().with_groups(vec![g(full, &[0, 1]), g(w(0), &[2, 3])]),
            bad
        );
        assert_eq!(
            dense().with_groups(vec![g(full, &[1, 0]), g(w(8), &[2, 3])]),
            bad
        );
        assert_eq!(
            dense().with_groups(vec![g(full, &[0, 1]), g(full, &[2, 3])]),
            bad
        );
        assert_eq!(
            dense().with_groups(vec![g(full, &[0]), g(w(8), &[]), g(w(9), &[1, 2, 3])]),
            bad
        );
        assert!(
            dense()
                .with_groups(vec![g(w(8), &[1, 3]), g(full, &[0, 2])])
                .is_ok()
        );
    }

    /// What decode reads after a prompt: the global layers' pages of the whole prompt, the
    /// window's last 511 positions for the local layers. At 8k tokens that is about a sixth
    /// of a dense layout's bytes (3 of 18 layers whole, 15 over 32 of 512 pages).
    #[test]
    fn the_pages_a_hybrid_hands_over_are_those_the_next_token_reads() {
        let (hybrid, dense) = (gemma3(16), KvLayout::llama(18, 1, 256, DType::F16, 16));
        // Below the window every page is read by every group.
        assert_eq!(hybrid.pages_read(1, 500), 0..32);
        assert_eq!(hybrid.handover_bytes(500), dense.handover_bytes(500));
        // 1500 tokens: the next token (1500) sees 989..=1500 in the local layers: pages
        // 61..94 of 94.
        assert_eq!(hybrid.pages_read(0, 1500), 0..94);
        assert_eq!(hybrid.pages_read(1, 1500), 61..94);
        let layer_page = hybrid.layer_bytes_per_page();
        assert_eq!(layer_page, 16 * 1024);
        assert_eq!(hybrid.handover_bytes(1500), (3 * 94 + 15 * 33) * layer_page);
        assert_eq!(dense.handover_bytes(1500), 18 * 94 * layer_page);
        let (h, d) = (hybrid.handover_bytes(8192), dense.handover_bytes(8192));
        assert_eq!(h, (3 * 512 + 15 * 32) * layer_page);
        assert!(h * 4 < d, "{h} vs {d}");
        assert_eq!(hybrid.handover_bytes(0), 0);
    }

    fn dsa_index_k_fp8(page: usize) -> KvLayout {
        KvLayout::new(
            "dsa-index-k-fp8",
            1,
            page,
            vec![Component::fp8_index_k(128)],
        )
        .unwrap()
    }

    fn dsa_index_k_bf16(page: usize) -> KvLayout {
        KvLayout::new(
            "dsa-index-k-bf16",
            1,
            page,
            vec![Component::plain("index_k", DType::Bf16, 128)],
        )
        .unwrap()
    }

    #[test]
    fn architecture_table_sizes_are_exact() {
        // DSA index-K, fp8 + one f32 scale at the page tail.
        let fp8 = dsa_index_k_fp8(64);
        assert_eq!(fp8.bytes_per_token_per_layer(), 132);
        assert_eq!(fp8.layer_bytes_per_page(), 8448);
        // scales of the page sit after all 64 x 128 B of values
        assert_eq!(fp8.scale_offset(0, 0, 0), Some(64 * 128));
        assert_eq!(fp8.scale_offset(0, 0, 63), Some(64 * 128 + 63 * 4));
        assert_eq!(fp8.value_offset(0, 0, 1), 128);
        // DSA index-K, bf16, no scale.
        let bf16 = dsa_index_k_bf16(64);
        assert_eq!(bf16.bytes_per_token_per_layer(), 256);
        assert_eq!(bf16.layer_bytes_per_page(), 16384);
        assert_eq!(bf16.scale_offset(0, 0, 0), None);
        // MLA latent bf16: 512 + 64 rope.
        let v32 = |mla, ik| KvLayout::deepseek_v32(61, MlaDims::V32, mla, ik, 64).unwrap();
        let mla_bf16 = v32(MlaCacheDtype::Bf16, IndexKDtype::Bf16);
        assert_eq!(mla_bf16.components()[0].bytes_per_token(), 1152);
        // MLA fp8 record: 512 fp8 + 4 f32 scales beside the token + 64 bf16 rope.
        let mla_fp8 = v32(MlaCacheDtype::Fp8, IndexKDtype::Fp8);
        let (nope, rope) = (&mla_fp8.components()[0], &mla_fp8.components()[1]);
        assert_eq!(nope.bytes_per_token() + rope.bytes_per_token(), 656);
        assert_eq!(mla_fp8.scale_offset(0, 0, 1), Some(528 + 512));
        // SmolLM2 K + V f16, 3 KV heads x 64.
        let smol = KvLayout::llama(30, 3, 64, DType::F16, 16);
        assert_eq!(smol.components()[0].bytes_per_token(), 384);
        assert_eq!(smol.components()[1].bytes_per_token(), 384);
        assert_eq!(smol.bytes_per_token_per_layer(), 2 * 384);
        assert_eq!(smol.bytes_per_token(), 30 * 768);
        assert_eq!(smol.bytes_per_page(), 30 * 768 * 16);
        assert_eq!(smol.bytes_per_pool(10), 10 * 30 * 768 * 16);
        // DeepSeek-V3.2 per-token totals from the reference, and the other two forms.
        for (mla, ik, per_layer, total) in [
            (MlaCacheDtype::Fp8, IndexKDtype::Fp8, 656 + 132, 48_068),
            (MlaCacheDtype::Bf16, IndexKDtype::Fp8, 1152 + 132, 78_324),
            (MlaCacheDtype::Fp8, IndexKDtype::Bf16, 656 + 256, 61 * 912),
            (
                MlaCacheDtype::Bf16,
                IndexKDtype::Bf16,
                1152 + 256,
                61 * 1408,
            ),
        ] {
            let l = v32(mla, ik);
            assert_eq!(l.bytes_per_token_per_layer(), per_layer, "{l}");
            assert_eq!(l.bytes_per_token(), total, "{l}");
            // fp8 index-K keeps the page's scales after all its values (SGLang's form).
            let k = l.component_index("index_k").unwrap();
            let tail = (ik == IndexKDtype::Fp8).then(|| l.region_offset(3, k) + 64 * 128);
            assert_eq!(l.scale_offset(3, k, 0), tail, "{l}");
        }
        // The four are four layouts: none can be mistaken for another.
        let mut prints: Vec<u64> = [MlaCacheDtype::Fp8, MlaCacheDtype::Bf16]
            .into_iter()
            .flat_map(|m| [IndexKDtype::Fp8, IndexKDtype::Bf16].map(|i| v32(m, i).fingerprint()))
            .collect();
        prints.sort_unstable();
        prints.dedup();
        assert_eq!(prints.len(), 4);
    }

    /// The strides, page and layer ranges and pool offsets that backends ask for agree
    /// with the per-slot offsets, for every layout the models use.
    #[test]
    fn strides_and_pool_offsets_agree_with_the_slot_offsets() {
        let v32 = |mla, ik| KvLayout::deepseek_v32(3, MlaDims::V32, mla, ik, 64).unwrap();
        let smol = KvLayout::llama(3, 3, 64, DType::F16, 16);
        let fp8 = v32(MlaCacheDtype::Fp8, IndexKDtype::Fp8);
        let layouts = [
            smol.clone(),
            fp8.clone(),
            v32(MlaCacheDtype::Bf16, IndexKDtype::Bf16),
            v32(MlaCacheDtype::Fp8, IndexKDtype::Bf16),
            dsa_index_k_fp8(64),
        ];
        for l in &layouts {
            let last = l.page_size() - 1;
            for layer in 0..l.layers() {
                let r = l.layer_range(layer);
                assert_eq!(r.len(), l.layer_bytes_per_page(), "{l}");
                assert_eq!(r.start, l.region_offset(layer, 0), "{l}");
                for comp in 0..l.components().len() {
                    let c = &l.components()[comp];
                    for slot in [0, 1, last - 1] {
                        let step = l.value_offset(layer, comp, slot + 1);
                        assert_eq!(
                            step - l.value_offset(layer, comp, slot),
                            l.token_stride(comp)
                        );
                        let sc = l
                            .scale_offset(layer, comp, slot + 1)
                            .zip(l.scale_offset(layer, comp, slot))
                            .map(|(b, a)| b - a);
                        assert_eq!(sc, l.scale_stride(comp), "{l} {}", c.name);
                    }
                    let end = l.value_offset(layer, comp, last) + c.value_bytes_per_token();
                    assert!(r.contains(&l.value_offset(layer, comp, 0)) && end <= r.end);
                    if let Some(s) = l.scale_offset(layer, comp, last) {
                        assert!(s + c.scale_bytes_per_token() <= r.end, "{l}");
                    }
                }
            }
            for (page, at) in [(0, 0), (5, 17), (7, l.bytes_per_page() - 1)] {
                assert_eq!(l.page_offset(page), page * l.bytes_per_page());
                assert_eq!(l.locate(l.page_offset(page) + at), (page, at));
            }
        }
        // K and V share a token stride: one offset per token serves both, in every layer.
        assert_eq!(smol.token_stride(0), 3 * 64 * 2);
        for (page, slot) in [(0, 0), (4, 9)] {
            let at = smol.slot_offset(page, slot).unwrap();
            for (layer, comp) in [(0, 0), (2, 1)] {
                assert_eq!(
                    at + smol.value_offset(layer, comp, 0),
                    smol.page_offset(page) + smol.value_offset(layer, comp, slot)
                );
            }
        }
        // DeepSeek's components differ: no such offset. One component always has one.
        assert_eq!(fp8.slot_offset(1, 2), None);
        assert_eq!(dsa_index_k_fp8(64).slot_offset(1, 2), Some(8448 + 2 * 128));
        // fp8 record: 512 fp8 values and their 4 f32 scales per token; index-K's scales
        // sit at the page tail, 4 bytes apart.
        let (nope, ik) = (0, fp8.component_index("index_k").unwrap());
        assert_eq!(
            (fp8.token_stride(nope), fp8.scale_stride(nope)),
            (528, Some(528))
        );
        assert_eq!((fp8.token_stride(ik), fp8.scale_stride(ik)), (128, Some(4)));
        assert_eq!(fp8.scale_stride(1), None, "mla_rope has no scales");
        // A rank's heads 1..3 of a K row: bytes 128..384 of the f16 row.
        assert_eq!(smol.value_bytes(0, 64..192), 128..384);
        assert_eq!(smol.value_bytes(1, 0..192), 0..smol.token_stride(1));
        assert!(std::panic::catch_unwind(|| smol.value_bytes(0, 0..193)).is_err());
    }

    #[test]
    fn fingerprint_is_stable_and_separates_layouts() {
        let a = dsa_index_k_fp8(64);
        assert_eq!(a.fingerprint(), dsa_index_k_fp8(64).fingerprint());
        assert_ne!(a.fingerprint(), dsa_index_k_bf16(64).fingerprint());
        assert_ne!(a.fingerprint(), dsa_index_k_fp8(32).fingerprint());
        let tail = a.clone();
        let beside = KvLayout::new(
            "x",
            1,
            64,
            vec![Component::scaled(
                "index_k",
                DType::Fp8E4m3,
                128,
                DType::F32,
                128,
                ScalePlacement::BesideToken,
            )],
        )
        .unwrap();
        assert_eq!(tail.bytes_per_page(), beside.bytes_per_page());
        assert_ne!(
            tail.fingerprint(),
            beside.fingerprint(),
            "placement changes where bytes go"
        );
        // Pinned value: changing the canonical form is a wire-protocol change.
        assert_eq!(
            KvLayout::llama(30, 3, 64, DType::F16, 16)
                .fingerprint_hex()
                .len(),
            16
        );
        assert_eq!(
            KvLayout::llama(30, 3, 64, DType::F16, 16).fingerprint(),
            KvLayout::llama(30, 3, 64, DType::F16, 16).fingerprint()
        );
    }

    #[test]
    fn malformed_layouts_are_refused() {
        assert_eq!(
            KvLayout::new("x", 0, 16, vec![Component::plain("k", DType::F16, 1)]),
            Err(LayoutError::Empty)
        );
        assert_eq!(KvLayout::new("x", 1, 16, vec![]), Err(LayoutError::Empty));
        assert_eq!(
            KvLayout::new("x", 1, 16, vec![Component::plain("k", DType::F16, 0)]),
            Err(LayoutError::BadComponent("k".into()))
        );
        assert_eq!(
            KvLayout::new(
                "x",
                1,
                16,
                vec![
                    Component::plain("k", DType::F16, 4),
                    Component::plain("k", DType::F16, 4)
                ]
            ),
            Err(LayoutError::DuplicateName("k".into()))
        );
        // Sizes that would overflow, or pages beyond the cap, are refused up front: a
        // layout from the wire can never make a size computation wrap.
        let huge = |layers, page, elems| {
            KvLayout::new(
                "x",
                layers,
                page,
                vec![Component::plain("k", DType::F32, elems)],
            )
        };
        let too_large = Err(LayoutError::TooLarge {
            max: MAX_PAGE_BYTES,
        });
        assert_eq!(huge(1, 1, usize::MAX / 2), too_large);
        assert_eq!(huge(usize::MAX / 4, 4, 4), too_large);
        assert_eq!(huge(1 << 20, 1 << 20, 1 << 20), too_large);
        assert_eq!(
            huge(1, 1, MAX_PAGE_BYTES / 4).unwrap().bytes_per_page(),
            MAX_PAGE_BYTES
        );
        assert_eq!(huge(1, 1, MAX_PAGE_BYTES / 4 + 1), too_large);
    }
}
