//! Profiles: storage round trips, atomic writes, corrupted files, the
//! nccl-tests parser, the importers, and the lookups' interpolation.

use super::*;

/// An 8 x A100 `all_reduce_perf` log (see tests/data/nccl/README.md).
const ALL_REDUCE_8: &str = include_str!("../../tests/data/nccl/all_reduce_perf_8xa100.txt");
const KORTHIKANTI: &str = include_str!("../../tests/data/reference/korthikanti_layer_times.csv");

fn point(op: CollectiveOp, ranks: u64, bytes: f64, us: f64) -> CollectivePoint {
    CollectivePoint {
        op,
        ranks,
        bytes,
        seconds: us / 1e6,
        busbw: 0.0,
    }
}

fn layer(micro_batch: u64, forward_ms: f64, backward_ms: f64) -> LayerPoint {
    LayerPoint {
        hidden: 1024,
        heads: 16,
        arch: LayerArch::paper_gpt(1024, 16),
        seq_len: 1024,
        micro_batch,
        tp: 1,
        sequence_parallel: false,
        recompute: Recompute::None,
        dtype: "bf16".into(),
        forward_s: forward_ms * 1e-3,
        backward_s: backward_ms * 1e-3,
        recompute_s: None,
        ci95_rel: Some(0.02),
        activation_bytes: Some(3.0e8),
        peak_bytes: None,
        status: LayerStatus::Ok,
        includes_tp_comm: true,
    }
}

fn sample_profile() -> Profile {
    let mut profile = Profile::empty("a100-80gb");
    profile.environment.source = "tests".into();
    profile.environment.date = "2026-01-02".into();
    profile.environment.notes = vec!["note one".into(), "note, with \"quotes\"".into()];
    profile.environment.commands = vec!["paratune profile import-table x --op all_reduce".into()];
    profile.collectives = vec![
        point(CollectiveOp::AllReduce, 8, 1048576.0, 92.79),
        point(CollectiveOp::AllReduce, 8, 2097152.0, 93.25),
        point(CollectiveOp::AllGather, 4, 1.5, 0.123456789),
    ];
    let mut recomputing = layer(2, 10.0, 20.0);
    recomputing.recompute = Recompute::Full;
    recomputing.recompute_s = Some(0.01);
    recomputing.tp = 2;
    recomputing.sequence_parallel = true;
    let mut llama = layer(4, 7.0, 14.0);
    llama.arch = LayerArch {
        kv_heads: 4,
        ffn_hidden: 2816,
        gated_mlp: true,
        attention: AttentionKind::Flash,
    };
    profile.layers = vec![layer(1, 5.0, 10.0), recomputing, llama];
    profile
}

fn files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn a_profile_reads_back_identically_from_parquet_and_from_csv() {
    let dir = tempfile::tempdir().unwrap();
    let profile = sample_profile();
    write_profile(dir.path(), &profile).unwrap();
    assert_eq!(read_profile(dir.path()).unwrap(), profile, "from Parquet");
    // Without the Parquet files the CSV files are read.
    std::fs::remove_file(dir.path().join("collectives.parquet")).unwrap();
    std::fs::remove_file(dir.path().join("layers.parquet")).unwrap();
    assert_eq!(read_profile(dir.path()).unwrap(), profile, "from CSV");
}

#[test]
fn an_empty_profile_and_an_oom_layer_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let empty = Profile::empty("h100-sxm");
    write_profile(dir.path(), &empty).unwrap();
    assert_eq!(read_profile(dir.path()).unwrap(), empty);

    let mut profile = Profile::empty("h100-sxm");
    let mut oom = layer(64, f64::NAN, f64::NAN);
    oom.status = LayerStatus::Oom;
    profile.layers.push(oom);
    write_profile(dir.path(), &profile).unwrap();
    for table in ["parquet", "csv"] {
        let back = read_profile(dir.path()).unwrap();
        let l = &back.layers[0];
        assert_eq!(l.status, LayerStatus::Oom, "{table}");
        assert!(l.forward_s.is_nan() && l.backward_s.is_nan(), "{table}");
        std::fs::remove_file(dir.path().join("layers.parquet")).ok();
    }
    // An oom point is no measurement to look up.
    assert!(Measurements::from_profile(&profile).is_empty());
}

#[test]
fn writes_are_atomic_and_leave_no_temporary_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut profile = sample_profile();
    write_profile(dir.path(), &profile).unwrap();
    profile.collectives.pop();
    write_profile(dir.path(), &profile).unwrap();
    assert_eq!(
        files(dir.path()),
        [
            "collectives.csv",
            "collectives.parquet",
            "environment.toml",
            "layers.csv",
            "layers.parquet"
        ]
    );
    assert_eq!(read_profile(dir.path()).unwrap(), profile);
}

#[test]
fn a_corrupted_parquet_file_is_a_one_line_error_and_is_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    write_profile(dir.path(), &sample_profile()).unwrap();
    let path = dir.path().join("collectives.parquet");
    let whole = std::fs::read(&path).unwrap();
    for damaged in [
        whole[..whole.len() / 2].to_vec(),
        b"PAR1 not a table".to_vec(),
    ] {
        std::fs::write(&path, &damaged).unwrap();
        let err = read_profile(dir.path()).unwrap_err();
        assert!(matches!(err, ProfileError::Corrupt { .. }), "{err:?}");
        let message = err.to_string();
        assert!(!message.contains('\n'), "{message}");
        assert!(
            message.contains("collectives.parquet") && message.contains("not overwritten"),
            "{message}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), damaged, "file untouched");
    }
}

#[test]
fn a_csv_table_with_a_bad_value_names_the_file_and_row() {
    let dir = tempfile::tempdir().unwrap();
    write_profile(dir.path(), &sample_profile()).unwrap();
    std::fs::remove_file(dir.path().join("collectives.parquet")).unwrap();
    let csv = dir.path().join("collectives.csv");
    let text = std::fs::read_to_string(&csv)
        .unwrap()
        .replace("all_gather", "all_gathr");
    std::fs::write(&csv, &text).unwrap();
    let message = read_profile(dir.path()).unwrap_err().to_string();
    assert!(
        message.contains("collectives.csv")
            && message.contains("row 3")
            && message.contains("all_gathr"),
        "{message}"
    );
    assert_eq!(std::fs::read_to_string(&csv).unwrap(), text);
}

#[test]
fn a_hand_written_csv_may_leave_out_the_optional_columns() {
    let dir = tempfile::tempdir().unwrap();
    write_profile(dir.path(), &Profile::empty("a100-80gb")).unwrap();
    std::fs::remove_file(dir.path().join("layers.parquet")).unwrap();
    std::fs::write(
        dir.path().join("layers.csv"),
        "hidden,heads,seq_len,micro_batch,tp,sequence_parallel,recompute,dtype,forward_s,backward_s,status\n\
         1024,16,1024,2,1,false,none,bf16,0.01,0.02,ok\n",
    )
    .unwrap();
    let profile = read_profile(dir.path()).unwrap();
    assert_eq!(profile.layers.len(), 1);
    let l = &profile.layers[0];
    assert_eq!((l.micro_batch, l.forward_s, l.recompute_s), (2, 0.01, None));
    // Without the architecture columns the layer is the papers' GPT layer.
    assert_eq!(l.arch, LayerArch::paper_gpt(1024, 16));
    assert!(l.includes_tp_comm);
}

#[test]
fn an_unknown_attention_kind_names_the_row_and_the_choices() {
    let dir = tempfile::tempdir().unwrap();
    write_profile(dir.path(), &Profile::empty("a100-80gb")).unwrap();
    std::fs::remove_file(dir.path().join("layers.parquet")).unwrap();
    std::fs::write(
        dir.path().join("layers.csv"),
        "hidden,heads,attention,seq_len,micro_batch,tp,sequence_parallel,recompute,dtype,forward_s,backward_s,status\n\
         1024,16,flash,1024,2,1,false,none,bf16,0.01,0.02,ok\n\
         1024,16,fused,1024,2,1,false,none,bf16,0.01,0.02,ok\n",
    )
    .unwrap();
    let err = read_profile(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("layers.csv") && err.contains("row 2") && err.contains("flash"),
        "{err}"
    );
}

#[test]
fn a_directory_without_environment_is_not_a_profile() {
    let dir = tempfile::tempdir().unwrap();
    let message = read_profile(dir.path()).unwrap_err().to_string();
    assert!(message.contains("environment.toml"), "{message}");
}

// --- nccl-tests -----------------------------------------------------------

#[test]
fn nccl_tests_all_reduce_output_is_read_with_op_ranks_and_device() {
    let log = parse_nccl_tests(ALL_REDUCE_8, "all_reduce_perf.log").unwrap();
    assert_eq!(log.op, Some(CollectiveOp::AllReduce));
    assert_eq!(log.ranks, Some(8));
    assert_eq!(log.device.as_deref(), Some("NVIDIA A100-SXM4-80GB"));
    assert!(!log.truncated);
    assert_eq!(log.wrong_rows, 0);
    // 8 B .. 1 GiB in factors of two.
    assert_eq!(log.rows.len(), 28);
    let (bytes, seconds, busbw) = log.rows[0];
    assert!(bytes == 8.0 && close(seconds, 24.61e-6) && busbw == 0.0);
    let (bytes, seconds, busbw) = *log.rows.last().unwrap();
    assert_eq!(bytes, 1073741824.0);
    assert!((seconds - 8193.0e-6).abs() < 1e-12);
    assert_eq!(busbw, 229.35);
    // The out-of-place columns, not the in-place ones.
    let (_, seconds, _) = log.rows[20];
    assert!((seconds - 134.30e-6).abs() < 1e-12, "{seconds}");
    let points = log.points(CollectiveOp::AllReduce, 8);
    assert!(points.iter().all(|p| p.ranks == 8));
}

#[test]
fn a_truncated_nccl_tests_log_keeps_its_complete_rows() {
    let cut = ALL_REDUCE_8.find("  536870912").unwrap() + 60;
    let log = parse_nccl_tests(&ALL_REDUCE_8[..cut], "run.txt").unwrap();
    assert!(log.truncated);
    assert_eq!(log.rows.len(), 26, "the half row is dropped");
    assert_eq!(log.rows.last().unwrap().0, 268435456.0);
    // Cut between rows: still truncated (no closing average), all rows kept.
    let cut = ALL_REDUCE_8.find("# Out of bounds").unwrap();
    let log = parse_nccl_tests(&ALL_REDUCE_8[..cut], "run.txt").unwrap();
    assert!(log.truncated);
    assert_eq!(log.rows.len(), 28);
    // Cut in the header: nothing to import is an error.
    let cut = ALL_REDUCE_8.find("#  Rank  3").unwrap();
    let err = parse_nccl_tests(&ALL_REDUCE_8[..cut], "run.txt").unwrap_err();
    assert!(
        err.to_string().contains("no nccl-tests result rows"),
        "{err}"
    );
}

#[test]
fn an_incomplete_row_in_the_middle_is_an_error_with_its_line() {
    let text = ALL_REDUCE_8.replace(
        "       65536         16384     float     sum      -1    45.12",
        "       65536         16384     float",
    );
    let err = parse_nccl_tests(&text, "run.txt").unwrap_err().to_string();
    assert!(
        err.contains("run.txt line") && err.contains("incomplete"),
        "{err}"
    );
}

#[test]
fn launcher_prefixes_info_lines_older_layouts_and_wrong_rows() {
    // mpirun's `[1,0]<stdout>:` prefixes, NCCL INFO chatter, the pre-2.12
    // layout without redop/root and with `error`, and a row with wrong results.
    let text = "\
[1,0]<stdout>:# nThread 1 nGpus 1 minBytes 8 maxBytes 64 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
[1,0]<stdout>:#  Rank  0 Group  0 Pid  11 on node-a device  0 [0x07] NVIDIA H100 80GB HBM3
[1,0]<stdout>:#  Rank  1 Group  0 Pid  11 on node-b device  0 [0x07] NVIDIA H100 80GB HBM3
node-a:11:11 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
[1,0]<stdout>:#       size         count    type     time   algbw   busbw  error     time   algbw   busbw  error
[1,0]<stdout>:#        (B)    (elements)             (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
[1,0]<stdout>:           8             2   float    30.00    0.00    0.00  0e+00    30.10    0.00    0.00  0e+00
[1,0]<stdout>:          16             4   float    31.00    0.00    0.00  2e+00    31.20    0.00    0.00  0e+00
[1,0]<stdout>:          32             8   float    32.00    0.00    0.00    N/A    32.00    0.00    0.00    N/A
[1,0]<stdout>:# Avg bus bandwidth    : 0.001
";
    let log = parse_nccl_tests(text, "logs/all_gather_perf-2n.txt").unwrap();
    assert_eq!(log.op, Some(CollectiveOp::AllGather), "from the file name");
    assert_eq!(log.ranks, Some(2));
    assert_eq!(log.device.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    let sizes: Vec<f64> = log.rows.iter().map(|r| r.0).collect();
    assert_eq!(sizes, [8.0, 32.0]);
    assert!(close(log.rows[0].1, 30e-6) && close(log.rows[1].1, 32e-6));
    assert_eq!(log.wrong_rows, 1);
    assert!(!log.truncated);
}

#[test]
fn the_reference_table_and_korthikanti_rows_import() {
    let text = "gpus,bytes,elements,dtype,out_of_place_us,out_of_place_busbw_GBps,in_place_us,in_place_busbw_GBps\n\
                2,1048576,262144,float,44.210,23.72,45.100,23.25\n\
                8,1073741824,268435456,float,8193.000,229.35,8196.400,229.25\n";
    let points = parse_reference_collectives(text, "t.csv", CollectiveOp::AllReduce).unwrap();
    assert_eq!(points.len(), 2);
    assert_eq!(
        (points[0].ranks, points[0].bytes, points[0].busbw),
        (2, 1048576.0, 23.72)
    );
    assert!((points[1].seconds - 8.193e-3).abs() < 1e-12);
    let bad = text.replace("44.210", "fast");
    let err = parse_reference_collectives(&bad, "t.csv", CollectiveOp::AllReduce).unwrap_err();
    assert!(err.to_string().contains("t.csv line 2"), "{err}");

    let layers = parse_korthikanti_layers(KORTHIKANTI, "k.csv", "16-bit").unwrap();
    assert_eq!(layers.len(), 5);
    let find = |sp: bool, r: Recompute| {
        layers
            .iter()
            .find(|l| l.sequence_parallel == sp && l.recompute == r)
            .unwrap()
    };
    let ms = |s: f64| (s * 1e3 * 1000.0).round() / 1000.0;
    let base = find(false, Recompute::None);
    assert_eq!((ms(base.forward_s), ms(base.backward_s)), (7.7, 11.9));
    assert_eq!(base.recompute_s, None);
    // Full: the table's 19.5 ms backward holds the recomputed forward.
    let full = find(false, Recompute::Full);
    assert_eq!(ms(full.backward_s), 11.9);
    assert_eq!(full.recompute_s.map(ms), Some(7.6));
    assert!((full.total_s() - 27.2e-3).abs() < 1e-12);
    let selective = find(true, Recompute::Selective);
    assert_eq!(ms(selective.backward_s), 11.8);
    assert_eq!(selective.recompute_s.map(ms), Some(1.3));
    assert!((selective.total_s() - 20.3e-3).abs() < 1e-12);
}

#[test]
fn merging_replaces_points_at_the_same_place_and_keeps_the_rest() {
    let mut existing = vec![
        point(CollectiveOp::AllReduce, 8, 1024.0, 10.0),
        point(CollectiveOp::AllReduce, 8, 2048.0, 20.0),
        point(CollectiveOp::AllReduce, 4, 1024.0, 5.0),
    ];
    merge_collectives(
        &mut existing,
        &[
            point(CollectiveOp::AllReduce, 8, 2048.0, 21.0),
            point(CollectiveOp::AllGather, 8, 2048.0, 11.0),
        ],
    );
    assert_eq!(
        existing,
        vec![
            point(CollectiveOp::AllReduce, 4, 1024.0, 5.0),
            point(CollectiveOp::AllReduce, 8, 1024.0, 10.0),
            point(CollectiveOp::AllReduce, 8, 2048.0, 21.0),
            point(CollectiveOp::AllGather, 8, 2048.0, 11.0),
        ]
    );
    let mut layers = vec![layer(1, 5.0, 10.0), layer(2, 9.0, 18.0)];
    merge_layers(&mut layers, &[layer(2, 9.5, 19.0), layer(4, 18.0, 36.0)]);
    assert_eq!(
        layers,
        vec![
            layer(1, 5.0, 10.0),
            layer(2, 9.5, 19.0),
            layer(4, 18.0, 36.0)
        ]
    );
}

// --- lookups --------------------------------------------------------------

fn measurements(collectives: Vec<CollectivePoint>, layers: Vec<LayerPoint>) -> Measurements {
    let mut profile = Profile::empty("a100-80gb");
    profile.collectives = collectives;
    profile.layers = layers;
    Measurements::from_profile(&profile)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-12)
}

#[test]
fn curves_interpolate_in_log_bytes_and_extrapolate_with_the_bandwidth_of_two_points() {
    let op = CollectiveOp::AllReduce;
    let m = measurements(
        vec![
            // Out of order on purpose; 4 MiB measured twice, the later wins.
            point(op, 8, 4.0 * MIB, 999.0),
            point(op, 8, 1.0 * MIB, 100.0),
            point(op, 8, 2.0 * MIB, 120.0),
            point(op, 8, 4.0 * MIB, 160.0),
            point(op, 8, 8.0 * MIB, 240.0),
        ],
        vec![],
    );
    let at = |bytes: f64| m.collective(op, 8, bytes).unwrap();
    // Measured points are returned as measured.
    assert_eq!(at(2.0 * MIB).seconds, 120e-6);
    assert!(!at(2.0 * MIB).extrapolated);
    assert_eq!(at(4.0 * MIB).seconds, 160e-6);
    // Between 2 and 4 MiB, linear in log(bytes): 2^1.5 MiB is half-way.
    let mid = at(2f64.powf(1.5) * MIB);
    assert!(close(mid.seconds, 140e-6) && !mid.extrapolated, "{mid:?}");
    let quarter = at(2f64.powf(1.25) * MIB);
    assert!(close(quarter.seconds, 130e-6), "{quarter:?}");
    // Above 8 MiB: the bandwidth between 8 MiB and the point nearest half
    // its size (4 MiB): 4 MiB per 80 us.
    let above = at(16.0 * MIB);
    assert!(above.extrapolated);
    assert!(
        close(above.seconds, 240e-6 + 8.0 * MIB / (4.0 * MIB / 80e-6)),
        "{above:?}"
    );
    // Below 1 MiB: back along the 1..2 MiB bandwidth (1 MiB per 20 us).
    let below = at(0.5 * MIB);
    assert!(below.extrapolated);
    assert!(close(below.seconds, 90e-6), "{below:?}");
    // Never faster than the smallest point's algorithmic bandwidth.
    assert!(close(
        at(1.0).seconds,
        (100e-6 - (MIB - 1.0) * 20e-6 / MIB).max(100e-6 / MIB)
    ));
    // Curves exist only for what was measured.
    assert!(m.collective(op, 4, MIB).is_none());
    assert!(m.collective(CollectiveOp::AllGather, 8, MIB).is_none());
}

#[test]
fn noisy_ends_fall_back_to_the_end_points_bandwidth() {
    let op = CollectiveOp::AllGather;
    // Time falls between the last two points: no positive bandwidth.
    let m = measurements(
        vec![point(op, 2, 1.0 * MIB, 50.0), point(op, 2, 2.0 * MIB, 40.0)],
        vec![],
    );
    let above = m.collective(op, 2, 8.0 * MIB).unwrap();
    assert!(close(above.seconds, 40e-6 * 4.0) && above.extrapolated);
    let below = m.collective(op, 2, 0.5 * MIB).unwrap();
    assert!(close(below.seconds, 50e-6) && below.extrapolated);
    // A single point: its bandwidth above, its time below.
    let one = measurements(vec![point(op, 2, MIB, 50.0)], vec![]);
    assert!(close(
        one.collective(op, 2, 2.0 * MIB).unwrap().seconds,
        100e-6
    ));
    assert!(close(one.collective(op, 2, 1.0).unwrap().seconds, 50e-6));
}

#[test]
fn layers_interpolate_in_micro_batch_and_scale_beyond() {
    let mut full = layer(4, 40.0, 80.0);
    full.recompute = Recompute::Full;
    full.recompute_s = Some(0.04);
    let m = measurements(
        vec![],
        vec![layer(2, 10.0, 20.0), layer(4, 18.0, 36.0), full],
    );
    let shape = layer(1, 0.0, 0.0).shape();
    let at = |mb: u64| m.layer(&shape, mb).unwrap();
    assert_eq!(
        at(2),
        LayerLookup {
            forward: 0.010,
            backward: 0.020,
            recompute: 0.0,
            extrapolated: false,
            includes_tp_comm: true,
        }
    );
    let three = at(3);
    assert!(close(three.forward, 0.014) && close(three.backward, 0.028) && !three.extrapolated);
    let eight = at(8);
    assert!(close(eight.forward, 0.036) && close(eight.backward, 0.072) && eight.extrapolated);
    let one = at(1);
    assert!(close(one.total(), 0.015) && one.extrapolated);
    // Another recomputation is another shape.
    let full_shape = LayerShape {
        recompute: Recompute::Full,
        ..shape
    };
    assert!(close(m.layer(&full_shape, 4).unwrap().total(), 0.16));
    let other = LayerShape { tp: 2, ..shape };
    assert!(m.layer(&other, 2).is_none());
}

#[test]
fn a_layer_of_another_architecture_with_the_same_width_is_not_used() {
    let m = measurements(vec![], vec![layer(2, 10.0, 20.0)]);
    let gpt = layer(2, 0.0, 0.0).shape();
    assert!(m.layer(&gpt, 2).is_some());
    for arch in [
        LayerArch {
            kv_heads: 4,
            ..gpt.arch
        },
        LayerArch {
            ffn_hidden: 2816,
            ..gpt.arch
        },
        LayerArch {
            gated_mlp: true,
            ..gpt.arch
        },
        LayerArch {
            attention: AttentionKind::Flash,
            ..gpt.arch
        },
    ] {
        assert!(
            m.layer(&LayerShape { arch, ..gpt }, 2).is_none(),
            "{arch:?}"
        );
    }
}

#[test]
fn sixteen_bit_points_win_over_another_precision_of_the_same_shape() {
    let mut fp32 = layer(2, 40.0, 80.0);
    fp32.dtype = "fp32".into();
    let mut fp32_only = layer(8, 400.0, 800.0);
    fp32_only.dtype = "fp32".into();
    let m = measurements(vec![], vec![fp32.clone(), layer(4, 18.0, 36.0), fp32_only]);
    let shape = layer(1, 0.0, 0.0).shape();
    // Only the bf16 point is used: micro-batch 2 is scaled from it.
    assert!(close(m.layer(&shape, 2).unwrap().forward, 0.009));
    // A shape measured only in fp32 still uses its fp32 points.
    let other = LayerShape { tp: 2, ..shape };
    fp32.tp = 2;
    let m = measurements(vec![], vec![fp32.clone()]);
    assert!(close(m.layer(&other, 2).unwrap().forward, 0.040));
    // A 16-bit point that ran out of memory does not push the fp32 ones aside.
    let mut oom = layer(2, f64::NAN, f64::NAN);
    oom.tp = 2;
    oom.status = LayerStatus::Oom;
    let m = measurements(vec![], vec![fp32, oom]);
    assert!(close(m.layer(&other, 2).unwrap().forward, 0.040));
}

const MIB: f64 = 1024.0 * 1024.0;
