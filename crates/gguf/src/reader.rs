//! The GGUF container: header, typed metadata, tensor index; tensor bytes are borrowed
//! from a read-only memory map so weights stay quantized and paged in on demand.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open model file {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0} is not a GGUF file (bad magic)")]
    BadMagic(PathBuf),
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    #[error("GGUF file is truncated or corrupt: {0}")]
    Corrupt(String),
    #[error("tensor {name} has unsupported GGML type id {id}")]
    UnsupportedType { name: String, id: u32 },
    #[error("tensor {0} is missing")]
    MissingTensor(String),
    #[error("metadata key {0} is missing or has the wrong type")]
    MissingKey(String),
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        Some(match *self {
            Self::U8(v) => v as u64,
            Self::U16(v) => v as u64,
            Self::U32(v) => v as u64,
            Self::U64(v) => v,
            Self::I8(v) if v >= 0 => v as u64,
            Self::I16(v) if v >= 0 => v as u64,
            Self::I32(v) if v >= 0 => v as u64,
            Self::I64(v) if v >= 0 => v as u64,
            _ => return None,
        })
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v as f64),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry in the index.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: dims[0] is the fastest-varying (row length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.ty.row_bytes(self.elems() as usize)
    }
    /// Elements per row (dims[0]).
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }
    /// Number of rows (product of the other dims).
    pub fn rows(&self) -> usize {
        (self.elems() / self.dims[0]) as usize
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: BTreeMap<String, TensorInfo>,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .field("metadata", &self.metadata.len())
            .finish()
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| {
            GgufError::Corrupt(format!("read of {n} bytes past the end at {}", self.pos))
        })?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, GgufError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn len(&mut self) -> Result<usize, GgufError> {
        let n = self.u64()?;
        // No count can exceed the bytes left: stops absurd allocations on corrupt input.
        if n > (self.b.len() - self.pos) as u64 {
            return Err(GgufError::Corrupt(format!(
                "length {n} exceeds file size at {}",
                self.pos
            )));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let n = self.len()?;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec())
            .map_err(|_| GgufError::Corrupt(format!("invalid UTF-8 string at {}", self.pos)))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8()?),
            1 => MetaValue::I8(self.u8()? as i8),
            2 => MetaValue::U16(self.u16()?),
            3 => MetaValue::I16(self.u16()? as i16),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(self.u32()? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32()?)),
            7 => MetaValue::Bool(self.u8()? != 0),
            8 => MetaValue::String(self.string()?),
            9 if depth < 4 => {
                let et = self.u32()?;
                let n = self.len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(et, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(self.u64()? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64()?)),
            t => return Err(GgufError::Corrupt(format!("unknown metadata type {t}"))),
        })
    }
}

impl GgufFile {
    /// Open and index a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|source| GgufError::Open {
            path: path.clone(),
            source,
        })?;
        // The one unsafe call (the map) lives in map_readonly, with its reasoning.
        let map = map_readonly(&file).map_err(|source| GgufError::Open {
            path: path.clone(),
            source,
        })?;
        let len = map.len();
        Self::parse(path, map, len)
    }

    /// Indexes a GGUF image held in memory (copied into an anonymous map): what
    /// [`Self::open`] does for a file, for readers that have the bytes already (and the
    /// fuzz target).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, GgufError> {
        let path = PathBuf::from("<memory>");
        let open = |source| GgufError::Open {
            path: path.clone(),
            source,
        };
        let mut map = memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(open)?;
        map[..bytes.len()].copy_from_slice(bytes);
        let map = map.make_read_only().map_err(open)?;
        Self::parse(path, map, bytes.len())
    }

    fn parse(path: PathBuf, map: memmap2::Mmap, len: usize) -> Result<Self, GgufError> {
        let mut c = Cursor {
            b: &map[..len],
            pos: 0,
        };
        if c.take(4).map_err(|_| GgufError::BadMagic(path.clone()))? != b"GGUF" {
            return Err(GgufError::BadMagic(path));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let k = c.string()?;
            let t = c.u32()?;
            let v = c.value(t, 0)?;
            metadata.insert(k, v);
        }
        let mut tensors = BTreeMap::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()? as usize;
            if nd == 0 || nd > 4 {
                return Err(GgufError::Corrupt(format!("tensor {name} has {nd} dims")));
            }
            let dims = (0..nd).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
            let tid = c.u32()?;
            let ty = GgmlType::from_id(tid).ok_or(GgufError::UnsupportedType {
                name: name.clone(),
                id: tid,
            })?;
            let offset = c.u64()?;
            if dims[0] % ty.block_elems() as u64 != 0 {
                return Err(GgufError::Corrupt(format!(
                    "tensor {name} row is not whole {ty:?} blocks"
                )));
            }
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    dims,
                    ty,
                    offset,
                },
            );
        }
        let align = metadata
            .get("general.alignment")
            .and_then(MetaValue::as_u64)
            .unwrap_or(32) as usize;
        if align == 0 {
            return Err(GgufError::Corrupt("alignment 0".into()));
        }
        let data_start = c.pos.div_ceil(align) * align;
        for t in tensors.values() {
            // Every size checked, so a hostile header cannot overflow one (later sizes
            // are then within the file's length).
            let end = t
                .dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .and_then(|n| {
                    (n / t.ty.block_elems() as u64).checked_mul(t.ty.block_bytes() as u64)
                })
                .and_then(|b| b.checked_add(t.offset))
                .and_then(|b| b.checked_add(data_start as u64));
            if end.is_none_or(|end| end > len as u64) {
                return Err(GgufError::Corrupt(format!(
                    "tensor {} extends past the end of the file",
                    t.name
                )));
            }
        }
        Ok(Self {
            path,
            map,
            version,
            metadata,
            tensors,
            data_start,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of the mapped file in bytes.
    pub fn file_len(&self) -> usize {
        self.map.len()
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get(key)
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.get(key)
            .and_then(MetaValue::as_f64)
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get(key)
            .and_then(MetaValue::as_str)
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    /// String array metadata (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let a = self
            .get(key)
            .and_then(MetaValue::as_array)
            .ok_or_else(|| GgufError::MissingKey(key.into()))?;
        a.iter()
            .map(|v| v.as_str().ok_or_else(|| GgufError::MissingKey(key.into())))
            .collect()
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.into()))
    }

    /// The raw (quantized) bytes of a tensor, borrowed from the map.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let t = self.tensor(name)?;
        let start = self.data_start + t.offset as usize;
        Ok(&self.map[start..start + t.bytes()])
    }

    /// Byte range of a tensor within [`GgufFile::bytes`].
    pub fn tensor_range(&self, name: &str) -> Result<std::ops::Range<usize>, GgufError> {
        let t = self.tensor(name)?;
        let start = self.data_start + t.offset as usize;
        Ok(start..start + t.bytes())
    }

    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// A tensor dequantized to f32 (for small tensors: norms, biases, tests).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let t = self.tensor(name)?;
        let mut out = vec![0f32; t.elems() as usize];
        crate::dequantize(t.ty, self.tensor_data(name)?, &mut out);
        Ok(out)
    }
}

#[allow(unsafe_code)]
fn map_readonly(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the mapping is read-only and model files are not modified while served;
    // a concurrent truncation would fault, which is the documented memmap2 caveat.
    unsafe { memmap2::Mmap::map(file) }
}
