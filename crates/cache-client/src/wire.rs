//! `KvLayout` to and from its `pdmesh.cache.v1` form. The receiving side rebuilds the
//! layout through `KvLayout::new` (so every size is derived again, never trusted from the
//! wire) and refuses it if the fingerprint the sender computed differs.

use pdmesh_kv::{
    Attention, Component, DType, KvLayout, LayerGroup, LayoutError, ScalePlacement, ScaleSpec,
};
use pdmesh_proto::cache::v1 as pb;

/// Why a layout from the wire was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireLayoutError {
    #[error("{component}: unknown dtype {value}")]
    UnknownDtype { component: String, value: i32 },
    #[error("{component}: unknown scale placement {value}")]
    UnknownPlacement { component: String, value: i32 },
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(
        "the sender's fingerprint {sent} does not match {computed} computed from the fields ({layout})"
    )]
    Fingerprint {
        sent: String,
        computed: String,
        layout: String,
    },
}

fn dtype_to_pb(d: DType) -> pb::Dtype {
    match d {
        DType::F32 => pb::Dtype::F32,
        DType::F16 => pb::Dtype::F16,
        DType::Bf16 => pb::Dtype::Bf16,
        DType::Fp8E4m3 => pb::Dtype::Fp8E4m3,
        DType::U8 => pb::Dtype::U8,
    }
}

fn dtype_from_pb(v: i32, what: &str) -> Result<DType, WireLayoutError> {
    match pb::Dtype::try_from(v) {
        Ok(pb::Dtype::F32) => Ok(DType::F32),
        Ok(pb::Dtype::F16) => Ok(DType::F16),
        Ok(pb::Dtype::Bf16) => Ok(DType::Bf16),
        Ok(pb::Dtype::Fp8E4m3) => Ok(DType::Fp8E4m3),
        Ok(pb::Dtype::U8) => Ok(DType::U8),
        _ => Err(WireLayoutError::UnknownDtype {
            component: what.to_owned(),
            value: v,
        }),
    }
}

pub fn layout_to_pb(l: &KvLayout) -> pb::KvLayout {
    pb::KvLayout {
        name: l.name().to_owned(),
        layers: l.layers() as u32,
        page_size: l.page_size() as u32,
        components: l
            .components()
            .iter()
            .map(|c| pb::Component {
                name: c.name.clone(),
                dtype: dtype_to_pb(c.dtype).into(),
                elems_per_token: c.elems_per_token as u32,
                scale: c.scale.map(|s| pb::Scale {
                    dtype: dtype_to_pb(s.dtype).into(),
                    block: s.block as u32,
                    placement: match s.placement {
                        ScalePlacement::BesideToken => pb::ScalePlacement::BesideToken,
                        ScalePlacement::PageTail => pb::ScalePlacement::PageTail,
                    }
                    .into(),
                }),
            })
            .collect(),
        fingerprint: l.fingerprint_hex(),
        groups: if l.is_hybrid() {
            l.groups()
                .iter()
                .map(|g| pb::LayerGroup {
                    window: match g.attention {
                        Attention::Full => 0,
                        Attention::SlidingWindow { window } => window as u32,
                    },
                    layers: g.layers.iter().map(|&l| l as u32).collect(),
                })
                .collect()
        } else {
            Vec::new()
        },
    }
}

pub fn layout_from_pb(p: &pb::KvLayout) -> Result<KvLayout, WireLayoutError> {
    let mut comps = Vec::with_capacity(p.components.len());
    for c in &p.components {
        let dtype = dtype_from_pb(c.dtype, &c.name)?;
        let scale = match &c.scale {
            None => None,
            Some(s) => Some(ScaleSpec {
                dtype: dtype_from_pb(s.dtype, &format!("{} scales", c.name))?,
                block: s.block as usize,
                placement: match pb::ScalePlacement::try_from(s.placement) {
                    Ok(pb::ScalePlacement::BesideToken) => ScalePlacement::BesideToken,
                    Ok(pb::ScalePlacement::PageTail) => ScalePlacement::PageTail,
                    _ => {
                        return Err(WireLayoutError::UnknownPlacement {
                            component: c.name.clone(),
                            value: s.placement,
                        });
                    }
                },
            }),
        };
        comps.push(Component {
            name: c.name.clone(),
            dtype,
            elems_per_token: c.elems_per_token as usize,
            scale,
        });
    }
    let mut layout = KvLayout::new(&p.name, p.layers as usize, p.page_size as usize, comps)?;
    if !p.groups.is_empty() {
        let groups = p
            .groups
            .iter()
            .map(|g| LayerGroup {
                attention: match g.window {
                    0 => Attention::Full,
                    w => Attention::SlidingWindow { window: w as usize },
                },
                layers: g.layers.iter().map(|&l| l as usize).collect(),
            })
            .collect();
        layout = layout.with_groups(groups)?;
    }
    if layout.fingerprint_hex() != p.fingerprint {
        return Err(WireLayoutError::Fingerprint {
            sent: p.fingerprint.clone(),
            computed: layout.fingerprint_hex(),
            layout: layout.to_string(),
        });
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_round_trip_and_a_forged_fingerprint_is_refused() {
        let l = KvLayout::new(
            "dsa",
            3,
            64,
            vec![
                Component::plain("latent", DType::Bf16, 576),
                Component::fp8_index_k(128),
            ],
        )
        .unwrap();
        let p = layout_to_pb(&l);
        assert_eq!(layout_from_pb(&p).unwrap(), l);
        let mut forged = p.clone();
        forged.components[1].dtype = pb::Dtype::Bf16.into();
        let err = layout_from_pb(&forged).unwrap_err();
        assert!(matches!(err, WireLayoutError::Fingerprint { .. }), "{err}");
        let mut bad = p;
        bad.components[0].dtype = 99;
        assert_eq!(
            layout_from_pb(&bad).unwrap_err(),
            WireLayoutError::UnknownDtype {
                component: "latent".into(),
                value: 99
            }
        );
    }

    /// A hybrid layout's groups travel, and a sender that dropped them (every layer
    /// global) has another fingerprint: its layout arrives whole, and differs.
    #[test]
    fn groups_round_trip_and_are_covered_by_the_fingerprint() {
        let dense = KvLayout::llama(6, 1, 256, DType::F16, 16);
        let hybrid = dense
            .clone()
            .with_groups(vec![
                LayerGroup {
                    attention: Attention::Full,
                    layers: vec![5],
                },
                LayerGroup {
                    attention: Attention::SlidingWindow { window: 512 },
                    layers: vec![0, 1, 2, 3, 4],
                },
            ])
            .unwrap();
        let p = layout_to_pb(&hybrid);
        assert_eq!(p.groups.len(), 2);
        assert_eq!(layout_from_pb(&p).unwrap(), hybrid);
        assert!(layout_to_pb(&dense).groups.is_empty());
        // Groups stripped in flight: the fields no longer give the sender's fingerprint.
        let mut stripped = p.clone();
        stripped.groups.clear();
        let err = layout_from_pb(&stripped).unwrap_err();
        assert!(matches!(err, WireLayoutError::Fingerprint { .. }), "{err}");
        // A group that leaves a layer out is refused by the layout itself.
        let mut holed = p;
        holed.groups[1].layers.pop();
        assert!(matches!(
            layout_from_pb(&holed).unwrap_err(),
            WireLayoutError::Layout(LayoutError::BadGroups { layers: 6 })
        ));
    }
}
