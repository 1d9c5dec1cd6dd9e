//! The GGUF reader on arbitrary bytes: an error or an index whose every tensor's bytes
//! lie inside the image; never a panic, an overflow or a read out of bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdmesh_gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes(data) else {
        return;
    };
    let names: Vec<String> = g.tensors.keys().cloned().collect();
    for name in names {
        let range = g.tensor_range(&name).expect("an indexed tensor");
        assert!(
            range.end <= data.len(),
            "{name}: {range:?} past {}",
            data.len()
        );
        assert_eq!(g.tensor_data(&name).expect("in bounds").len(), range.len());
    }
    for key in g.metadata.keys() {
        let _ = g.get_str_array(key);
        let _ = g.get_u64(key);
    }
});
