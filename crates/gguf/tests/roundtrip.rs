//! GGUF files written by the tests are read back exactly; corrupt files are clear errors.

use pdmesh_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetaValue};

fn sample() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("llama".into()))
        .meta("llama.block_count", MetaValue::U32(2))
        .meta("llama.rope.freq_base", MetaValue::F32(10000.0))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(vec![
                MetaValue::String("a".into()),
                MetaValue::String("é".into()),
            ]),
        );
    let f32s: Vec<u8> = [1.0f32, -2.0, 3.5, 0.25]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    w.tensor("norm.weight", &[4], GgmlType::F32, f32s);
    let mut q8 = half::f16::from_f32(0.5).to_le_bytes().to_vec();
    q8.extend((0..32).map(|i| i as u8));
    q8.extend(half::f16::from_f32(-1.0).to_le_bytes());
    q8.extend((0..32).map(|i| (-(i as i8)) as u8));
    w.tensor("w", &[32, 2], GgmlType::Q8_0, q8);
    w.to_bytes()
}

#[test]
fn reads_back_what_was_written() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, sample()).unwrap();
    let g = GgufFile::open(&p).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u64("llama.block_count").unwrap(), 2);
    assert_eq!(g.get_f64("llama.rope.freq_base").unwrap(), 10000.0);
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap(),
        vec!["a", "é"]
    );
    assert_eq!(
        g.tensor_f32("norm.weight").unwrap(),
        vec![1.0, -2.0, 3.5, 0.25]
    );
    let w = g.tensor("w").unwrap();
    assert_eq!((w.row_len(), w.rows(), w.ty), (32, 2, GgmlType::Q8_0));
    let v = g.tensor_f32("w").unwrap();
    assert_eq!(v[3], 1.5);
    assert_eq!(v[32 + 4], 4.0);
    assert!(matches!(
        g.get_u64("missing"),
        Err(GgufError::MissingKey(_))
    ));
    assert!(matches!(g.tensor("nope"), Err(GgufError::MissingTensor(_))));
}

#[test]
fn corrupt_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, b"NOPE1234").unwrap();
    assert!(matches!(GgufFile::open(&p), Err(GgufError::BadMagic(_))));
    let full = sample();
    std::fs::write(&p, &full[..full.len() - 40]).unwrap();
    let e = GgufFile::open(&p).unwrap_err();
    assert!(matches!(e, GgufError::Corrupt(_)), "{e}");
    std::fs::write(&p, &full[..60]).unwrap();
    assert!(matches!(GgufFile::open(&p), Err(GgufError::Corrupt(_))));
    let e = GgufFile::open(dir.path().join("absent.gguf")).unwrap_err();
    assert!(e.to_string().contains("absent.gguf"), "{e}");
}

#[test]
fn an_image_in_memory_reads_as_its_file_does() {
    let g = GgufFile::from_bytes(&sample()).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(
        g.tensor_f32("norm.weight").unwrap(),
        vec![1.0, -2.0, 3.5, 0.25]
    );
    assert!(matches!(
        GgufFile::from_bytes(b""),
        Err(GgufError::BadMagic(_))
    ));
}

#[test]
fn tensor_sizes_that_overflow_are_corrupt_not_a_panic() {
    // A one-tensor file whose dims multiply past u64, then one whose offset does.
    let head = |dims: &[u64], offset: u64| {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes()); // tensors
        b.extend(0u64.to_le_bytes()); // metadata
        b.extend(1u64.to_le_bytes());
        b.push(b't');
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(GgmlType::F32.id().to_le_bytes());
        b.extend(offset.to_le_bytes());
        b.resize(128, 0);
        b
    };
    for bytes in [
        head(&[1 << 40, 1 << 40], 0),
        head(&[u64::MAX, 2], 0),
        head(&[4], u64::MAX - 8),
    ] {
        let e = GgufFile::from_bytes(&bytes).unwrap_err();
        assert!(matches!(e, GgufError::Corrupt(_)), "{e}");
    }
}
