//! A small GGUF writer, used by tests (and tools) to make real GGUF files on the fly.

use std::io::Write;

use crate::{GgmlType, MetaValue};

/// Builds a GGUF v3 file in memory.
#[derive(Default, Debug)]
pub struct GgufWriter {
    kv: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (a key set again keeps its place and takes the new value).
    pub fn meta(&mut self, key: &str, v: MetaValue) -> &mut Self {
        match self.meta_mut(key) {
            Some(old) => *old = v,
            None => self.kv.push((key.into(), v)),
        }
        self
    }

    /// The value set for `key`, to edit in place.
    pub fn meta_mut(&mut self, key: &str) -> Option<&mut MetaValue> {
        self.kv.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Add a tensor; `data` must already be in `ty`'s block format.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        let elems: u64 = dims.iter().product();
        assert_eq!(
            ty.row_bytes(elems as usize),
            data.len(),
            "tensor {name} data size"
        );
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        const ALIGN: usize = 32;
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut b, k);
            put_value(&mut b, v, true);
        }
        let mut off = 0u64;
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.id().to_le_bytes());
            b.extend(off.to_le_bytes());
            off += data.len().div_ceil(ALIGN) as u64 * ALIGN as u64;
        }
        b.resize(b.len().div_ceil(ALIGN) * ALIGN, 0);
        for (_, _, _, data) in &self.tensors {
            b.extend(data);
            b.resize(b.len().div_ceil(ALIGN) * ALIGN, 0);
        }
        b
    }

    pub fn write_to(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::fs::File::create(path)?.write_all(&self.to_bytes())
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(b: &mut Vec<u8>, v: &MetaValue, with_type: bool) {
    if with_type {
        b.extend(type_id(v).to_le_bytes());
    }
    match v {
        MetaValue::U8(x) => b.push(*x),
        MetaValue::I8(x) => b.push(*x as u8),
        MetaValue::U16(x) => b.extend(x.to_le_bytes()),
        MetaValue::I16(x) => b.extend(x.to_le_bytes()),
        MetaValue::U32(x) => b.extend(x.to_le_bytes()),
        MetaValue::I32(x) => b.extend(x.to_le_bytes()),
        MetaValue::F32(x) => b.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => b.push(*x as u8),
        MetaValue::String(s) => put_str(b, s),
        MetaValue::U64(x) => b.extend(x.to_le_bytes()),
        MetaValue::I64(x) => b.extend(x.to_le_bytes()),
        MetaValue::F64(x) => b.extend(x.to_le_bytes()),
        MetaValue::Array(a) => {
            let et = a.first().map(type_id).unwrap_or(0);
            b.extend(et.to_le_bytes());
            b.extend((a.len() as u64).to_le_bytes());
            for x in a {
                put_value(b, x, false);
            }
        }
    }
}
