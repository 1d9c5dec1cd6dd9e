//! Staging and writing a hand-over's pages: slots, checksums, sizes, and the seed's
//! index-K fault caught (and reported with both layouts) or hidden.

use pdmesh_cache_client::mirror::Mirror;
use pdmesh_kv::page_checksum;

use super::*;

/// Three staged pages of distinct bytes and their checksums.
fn staged(page_bytes: usize) -> (Vec<u8>, Vec<u64>) {
    let buf: Vec<u8> = (0..3 * page_bytes)
        .map(|i| (i * 7 + i / 251) as u8)
        .collect();
    let sums = buf.chunks_exact(page_bytes).map(page_checksum).collect();
    (buf, sums)
}

#[test]
fn staged_pages_land_in_their_slots_with_the_engines_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let mirror = Mirror::create(dir.path(), 256, 8).unwrap();
    let (buf, sums) = staged(256);
    let slots = [5, 0, 3];
    assert_eq!(
        write_pages(&mirror, &buf, &slots, &sums, None).unwrap(),
        Ok(sums.clone())
    );
    let mut scratch = Vec::new();
    for (i, &slot) in slots.iter().enumerate() {
        assert_eq!(mirror.checksum(slot, &mut scratch), sums[i]);
        assert_eq!(scratch, buf[i * 256..(i + 1) * 256]);
    }
}

#[test]
fn a_page_that_changed_after_staging_is_data_loss_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mirror = Mirror::create(dir.path(), 256, 8).unwrap();
    let (buf, mut sums) = staged(256);
    sums[1] ^= 1;
    let bad = write_pages(&mirror, &buf, &[0, 4, 2], &sums, None)
        .unwrap()
        .unwrap_err();
    assert_eq!(
        bad,
        [BadPage {
            index: 1,
            slot: 4,
            expected: sums[1],
            found: sums[1] ^ 1
        }]
    );
    let err = tonic::Status::from(changed(&bad, 3, "the engine and the host mirror"));
    assert_eq!(err.code(), tonic::Code::DataLoss);
    assert!(
        err.message().starts_with("1 of 3 pages changed")
            && err.message().contains("page 1 (mirror slot 4)"),
        "{}",
        err.message()
    );
}

#[test]
fn pages_of_another_size_are_refused_naming_both_sizes() {
    let (a, b) = ([1u8; 256], [2u8; 132]);
    let err = stage_pages(&[&a, &b], 0, 256).unwrap_err();
    assert_eq!(
        err,
        PageSizeMismatch {
            engine: 132,
            cache: 256
        }
    );
    assert_eq!(
        err.to_string(),
        "the engine's KV pages are 132 bytes, the cache service's 256"
    );
    // The pages decode holds are not staged, so their size is not asked.
    let (buf, sums) = stage_pages(&[&b, &a], 1, 256).unwrap();
    assert_eq!((buf, sums), (a.to_vec(), vec![page_checksum(&a)]));
    let dir = tempfile::tempdir().unwrap();
    let mirror = Mirror::create(dir.path(), 256, 8).unwrap();
    let err = write_pages(&mirror, &a, &[0, 1], &[page_checksum(&a)], None).unwrap_err();
    assert!(matches!(err, PdError::Internal(_)), "{err}");
}

fn deepseek_bf16() -> KvLayout {
    pdmesh_kv::KvLayout::deepseek_v32(
        1,
        pdmesh_kv::MlaDims::V32,
        pdmesh_kv::MlaCacheDtype::Bf16,
        pdmesh_kv::IndexKDtype::Bf16,
        1,
    )
    .unwrap()
}

#[test]
fn the_seeds_fault_unchecked_writes_its_loss_behind_valid_checksums() {
    let layout = deepseek_bf16();
    let page_bytes = layout.bytes_per_page();
    let dir = tempfile::tempdir().unwrap();
    let mirror = Mirror::create(dir.path(), page_bytes, 4).unwrap();
    let (buf, sums) = staged(page_bytes);
    let got = write_pages(
        &mirror,
        &buf,
        &[0, 1, 2],
        &sums,
        Some((Missize::Unchecked, &layout)),
    )
    .unwrap()
    .unwrap();
    let mut scratch = Vec::new();
    for (i, &sum) in got.iter().enumerate() {
        assert_ne!(sum, sums[i], "page {i} lost nothing");
        assert_eq!(mirror.checksum(i as u32, &mut scratch), sum);
    }
}

#[test]
fn the_seeds_fault_is_caught_by_the_engines_checksums_and_reported_with_both_layouts() {
    let layout = deepseek_bf16();
    let page_bytes = layout.bytes_per_page();
    let dir = tempfile::tempdir().unwrap();
    let mirror = Mirror::create(dir.path(), page_bytes, 4).unwrap();
    let (buf, sums) = staged(page_bytes);
    let bad = write_pages(
        &mirror,
        &buf,
        &[0, 1, 2],
        &sums,
        Some((Missize::Checked, &layout)),
    )
    .unwrap()
    .unwrap_err();
    assert_eq!(bad.iter().map(|b| b.index).collect::<Vec<_>>(), [0, 1, 2]);
    let reports = tempfile::tempdir().unwrap();
    let inc = Incidents::from_flags(
        Some(reports.path()),
        (None, None, false),
        "prefill pid 1".into(),
        Default::default(),
    )
    .unwrap()
    .unwrap();
    let req = GenRequest {
        id: "req-1".into(),
        prompt: vec![1, 2, 3],
        params: Default::default(),
    };
    report_write(
        &inc,
        (&req, "trace-1", 9),
        &bad,
        3,
        &layout,
        Some(Missize::Checked),
    );
    let all = pdmesh_incident::list(reports.path()).unwrap();
    let i = &all[0];
    assert_eq!(i.kind, pdmesh_incident::Kind::Checksum);
    assert_eq!(i.place.room, Some(9));
    assert_eq!(i.pages.len(), 3);
    let l = i.layouts.as_ref().unwrap();
    assert_eq!(
        l.differences(),
        ["index_k: 256 B/token (bf16) vs 132 B/token (fp8_e4m3)"]
    );
    // Without --incident-include-prompts: the prompt's length, not its ids.
    let replay = i.replay.as_ref().unwrap();
    assert!(replay.prompt_token_ids.is_empty() && replay.body.get("prompt").is_none());
    assert_eq!(i.details["prompt tokens"], "3");
}
