//! What loading and running a walk program answer when the kernel refuses,
//! fails or stops, with a scripted kernel ([`ScriptedKernel`]) in place of
//! the real one: the error a caller gets, and the message a person reads.

use super::*;
use crate::fake::{self, Call, Loaded, Run, ScriptedKernel};

/// The descriptor the walked map is named by (the script does not read it).
const TARGET_FD: RawFd = 7;

/// `ENOTSUPP`, the kernel-internal errno the BPF syscall leaks.
const ENOTSUPP: i32 = crate::ENOTSUPP;

/// Loads `plan` over a map like `meta`'s.
fn load_on<'k>(
    kernel: &'k ScriptedKernel,
    meta: &MapMeta,
    plan: &WalkPlan,
) -> Result<WalkProgram<&'k ScriptedKernel>, LoadError> {
    WalkProgram::load_with(kernel, Target::new(TARGET_FD, meta), plan)
}

/// The scripted hash map of u32 keys and values the programs walk.
fn target() -> Target<'static> {
    static META: std::sync::LazyLock<MapMeta> = std::sync::LazyLock::new(fake::meta);
    Target::new(TARGET_FD, &META)
}

/// Loads `plan` over the scripted hash map of u32 keys and values.
fn load<'k>(
    kernel: &'k ScriptedKernel,
    plan: &WalkPlan,
) -> Result<WalkProgram<&'k ScriptedKernel>, LoadError> {
    load_on(kernel, &fake::meta(), plan)
}

/// The loads the script saw: names, and whether it accepted them.
fn loads(kernel: &ScriptedKernel) -> Vec<(&'static str, bool)> {
    kernel
        .loads()
        .iter()
        .map(|l| (l.name, l.accepted))
        .collect()
}

/// The value (u32) as a program reads it.
fn value() -> IntRead {
    let member = IntSpec {
        side: Side::Value,
        bit_offset: 0,
        bits: 32,
        signed: false,
        big_endian: false,
    };
    IntRead::new(member, 4).unwrap()
}

/// Entries whose value is above 10, grouped by their key (a hash map of
/// groups): their count and the sum of their values (at most 4 groups).
fn grouping() -> WalkPlan {
    WalkPlan {
        output: Output::Groups,
        filter: Cond::Cmp(value(), CmpOp::Gt, 10),
        group: vec![GroupPart::Bytes {
            side: Side::Key,
            offset: 0,
            len: 4,
            out: 0,
        }],
        key_len: 4,
        aggs: vec![AggOp::Count, AggOp::Sum(value())],
        max_groups: 4,
    }
}

/// The same grouped by the key's first byte: a dense table of 256 groups.
fn dense_grouping() -> WalkPlan {
    WalkPlan {
        group: vec![GroupPart::Bytes {
            side: Side::Key,
            offset: 0,
            len: 1,
            out: 0,
        }],
        key_len: 1,
        ..grouping()
    }
}

/// A group as the program leaves it in its output map: a 4-byte key (the
/// first byte the group's; for a dense table, the slot's index), its
/// count, and two words per aggregate.
fn group(first: u8, count: u64, sum: u64) -> (Vec<u8>, Vec<u8>) {
    let mut value = Vec::new();
    for word in [count, 0, 0, sum, 0] {
        value.extend(word.to_ne_bytes());
    }
    (vec![first, 0, 0, 0], value)
}

fn ran(output: Vec<(Vec<u8>, Vec<u8>)>) -> Run {
    Run {
        output,
        ..Run::visiting(100)
    }
}

#[test]
fn a_run_reads_its_figures_and_drains_its_groups() {
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &grouping()).unwrap();
    assert_eq!(
        kernel.loads(),
        [Loaded {
            name: "bpfmapd_scan",
            license: "Apache-2.0".into(),
            insns: kernel.loads()[0].insns,
            accepted: true,
        }]
    );
    assert!(!p.counts_without_walking());
    kernel.push_run(ran(vec![group(2, 20, 400), group(1, 10, 150)]));
    let out = p.run(target()).unwrap();
    assert_eq!((out.visited, out.matched, out.overflowed), (100, 30, false));
    // COUNT keeps no words of its own; SUM its 128 bits, low word first.
    assert_eq!(
        out.groups,
        [
            WalkGroup {
                key: vec![1, 0, 0, 0],
                count: 10,
                words: vec![(0, 0), (150, 0)],
            },
            WalkGroup {
                key: vec![2, 0, 0, 0],
                count: 20,
                words: vec![(0, 0), (400, 0)],
            },
        ]
    );
    // The groups map was drained: the next run finds only its own.
    kernel.push_run(ran(Vec::new()));
    assert_eq!(p.run(target()).unwrap().groups, []);
    assert_eq!(kernel.unused(), 0);
}

#[test]
fn a_program_holds_its_map_only_while_it_runs() {
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &grouping()).unwrap();
    assert!(kernel.slots_empty(), "loading puts no map in the slot");
    kernel.push_run(ran(Vec::new()));
    p.run(target()).unwrap();
    // A failed run empties the slot too.
    kernel.push_run(Run {
        result: Err(libc::EINTR),
        ..ran(Vec::new())
    });
    p.run(target()).unwrap_err();
    assert_eq!(kernel.walked(), [Some(TARGET_FD), Some(TARGET_FD)]);
    assert!(kernel.slots_empty(), "no map is held between runs");
    // Another map of the same shape runs the same program.
    let other = fake::meta();
    kernel.push_run(ran(Vec::new()));
    p.run(Target::new(TARGET_FD + 1, &other)).unwrap();
    assert_eq!(kernel.walked()[2], Some(TARGET_FD + 1));
    // A map of another shape does not: nothing runs.
    let wider = MapMeta {
        value_size: 8,
        ..fake::meta()
    };
    let e = p.run(Target::new(TARGET_FD + 2, &wider)).unwrap_err();
    assert!(matches!(e, RunError::OtherShape { .. }), "{e:?}");
    assert_eq!(kernel.walked().len(), 3);
    assert_eq!(kernel.unused(), 0);
}

#[test]
fn a_held_run_leaves_its_map_in_the_slot_until_it_is_released() {
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &grouping()).unwrap();
    kernel.push_run(ran(Vec::new()));
    p.run_held(target()).unwrap();
    assert!(!kernel.slots_empty(), "the map stays until the release");
    p.release().unwrap();
    assert!(kernel.slots_empty(), "released");
    // A failed held run leaves it too; the next run replaces it.
    kernel.push_run(Run {
        result: Err(libc::EINTR),
        ..ran(Vec::new())
    });
    p.run_held(target()).unwrap_err();
    assert!(!kernel.slots_empty());
    let other = fake::meta();
    kernel.push_run(ran(Vec::new()));
    p.run_held(Target::new(TARGET_FD + 1, &other)).unwrap();
    assert_eq!(
        kernel.walked(),
        [Some(TARGET_FD), Some(TARGET_FD), Some(TARGET_FD + 1)]
    );
    p.release().unwrap();
    // Releasing an empty slot is no error.
    p.release().unwrap();
    assert!(kernel.slots_empty());
    assert_eq!(kernel.unused(), 0);
}

#[test]
fn a_program_the_verifier_refuses_comes_with_its_log() {
    let kernel = ScriptedKernel::new();
    let log = "0: (b7) r0 = 0\nR1 invalid mem access 'scalar'\nprocessed 12 insns\n";
    kernel.refuse(libc::EACCES, log);
    let e = load(&kernel, &grouping()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "the kernel's verifier refused the scan program: BPF_PROG_LOAD failed: Permission denied (os error 13)"
    );
    let LoadError::Refused { error, log: kept } = e else {
        panic!("a refusal: {e:?}")
    };
    assert_eq!(
        (error.call, error.errno(), kept.as_str()),
        ("BPF_PROG_LOAD", Some(libc::EACCES), log)
    );
    assert_eq!(loads(&kernel), [("bpfmapd_scan", false)]);
}

#[test]
fn enomem_and_e2big_at_load_are_refusals_of_the_program() {
    for (errno, text) in [
        (libc::ENOMEM, "Cannot allocate memory (os error 12)"),
        (libc::E2BIG, "Argument list too long (os error 7)"),
    ] {
        let kernel = ScriptedKernel::new();
        kernel.refuse(errno, "");
        let e = load(&kernel, &grouping()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("the kernel's verifier refused the scan program: BPF_PROG_LOAD failed: {text}")
        );
        assert!(
            matches!(&e, LoadError::Refused { error, .. } if error.errno() == Some(errno)),
            "{e:?}"
        );
    }
}

#[test]
fn a_kernel_without_the_helper_refuses_every_program_and_says_what_they_need() {
    for (errno, text) in [
        (libc::EINVAL, "Invalid argument (os error 22)"),
        (ENOTSUPP, "Unknown error 524 (os error 524)"),
    ] {
        let kernel = ScriptedKernel::new();
        let log = "6: (85) call unknown#164\ninvalid func unknown#164\n";
        kernel.refuse(errno, log);
        let e = supported_with(&kernel).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "this kernel refuses scan programs (BPF_PROG_LOAD failed: {text}): they need Linux 5.13 and CAP_BPF"
            )
        );
        assert!(
            matches!(&e, Unsupported::Refused { error, log: kept } if error.errno() == Some(errno) && kept == log),
            "{e:?}"
        );
        // The same refusal of a program for a map.
        kernel.refuse(errno, log);
        let e = load(&kernel, &grouping()).unwrap_err();
        assert!(matches!(e, LoadError::Refused { .. }), "{e:?}");
    }
}

#[test]
fn a_kernel_that_runs_the_probe_supports_walk_programs() {
    let kernel = ScriptedKernel::new();
    kernel.push_run(Run::visiting(1));
    supported_with(&kernel).unwrap();
    // The probe walks its array: no program counts from counters.
    assert_eq!(loads(&kernel), [("bpfmapd_scan", true)]);

    kernel.push_run(Run::visiting(2));
    let e = supported_with(&kernel).unwrap_err();
    assert!(matches!(e, Unsupported::Miscounted(2)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "a scan program counted 2 entries of a map of 1"
    );
}

#[test]
fn without_the_kfunc_a_hash_map_is_counted_by_walking_it() {
    // A kernel before 6.6: no bpf_map_sum_elem_count in its BTF.
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &WalkPlan::count()).unwrap();
    assert!(!p.counts_without_walking());
    assert_eq!(loads(&kernel), [("bpfmapd_scan", true)]);
    kernel.push_run(Run::visiting(64));
    let out = p.run(target()).unwrap();
    assert_eq!((out.visited, out.matched), (64, 64));

    // A kernel that has the function but refuses the program calling it
    // (EINVAL, or ENOTSUPP where kernel functions are not supported).
    for errno in [libc::EINVAL, ENOTSUPP] {
        let kernel = ScriptedKernel::new().with_sum_elem_count(77);
        kernel.refuse(
            errno,
            "calling kernel function bpf_map_sum_elem_count is not allowed\n",
        );
        let p = load(&kernel, &WalkPlan::count()).unwrap();
        assert!(!p.counts_without_walking());
        assert_eq!(
            loads(&kernel),
            [("bpfmapd_count", false), ("bpfmapd_scan", true)]
        );
    }
}

#[test]
fn with_the_kfunc_a_hash_map_is_counted_from_its_counters_and_an_array_walked() {
    let kernel = ScriptedKernel::new().with_sum_elem_count(77);
    let p = load(&kernel, &WalkPlan::count()).unwrap();
    assert!(p.counts_without_walking());
    let count = &kernel.loads()[0];
    assert_eq!(
        (count.name, count.license.as_str(), count.insns),
        ("bpfmapd_count", "Dual MIT/GPL", 19)
    );
    kernel.push_run(Run::visiting(900));
    let out = p.run(target()).unwrap();
    assert_eq!((out.visited, out.matched), (900, 900));

    let array = MapMeta {
        map_type: MapType::ARRAY,
        ..fake::meta()
    };
    let kernel = ScriptedKernel::new().with_sum_elem_count(77);
    let p = load_on(&kernel, &array, &WalkPlan::count()).unwrap();
    assert!(!p.counts_without_walking());
    assert_eq!(loads(&kernel), [("bpfmapd_scan", true)]);
}

#[test]
fn a_failing_test_run_is_an_error_and_its_groups_are_drained_still() {
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &grouping()).unwrap();
    kernel.push_run(Run {
        result: Err(libc::EINVAL),
        ..ran(vec![group(1, 10, 150)])
    });
    let e = p.run(target()).unwrap_err();
    assert!(matches!(e, RunError::Sys(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "BPF_PROG_TEST_RUN failed: Invalid argument (os error 22)"
    );
    kernel.push_run(ran(Vec::new()));
    assert_eq!(
        p.run(target()).unwrap().groups,
        [],
        "drained by the failed run"
    );

    let kernel = ScriptedKernel::new();
    kernel.push_run(Run {
        result: Err(libc::ENOTSUP),
        ..Run::visiting(0)
    });
    let e = supported_with(&kernel).unwrap_err();
    assert!(matches!(e, Unsupported::Run(RunError::Sys(_))), "{e:?}");
    assert_eq!(
        e.to_string(),
        "cannot run a scan program: BPF_PROG_TEST_RUN failed: Operation not supported (os error 95)"
    );
}

#[test]
fn a_program_whose_groups_filled_up_says_it_overflowed() {
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &grouping()).unwrap();
    let full: Vec<_> = (1..=4).map(|k| group(k, 1, 11)).collect();
    kernel.push_run(Run {
        error: -i64::from(libc::E2BIG),
        ..ran(full)
    });
    let out = p.run(target()).unwrap();
    assert!(out.overflowed);
    assert_eq!(out.groups.len(), 4);
}

#[test]
fn another_errno_the_program_wrote_is_an_error() {
    for (errno, text) in [
        (libc::ENOMEM, "Cannot allocate memory (os error 12)"),
        // A group inserted and not found again.
        (libc::ENOENT, "No such file or directory (os error 2)"),
    ] {
        let kernel = ScriptedKernel::new();
        let p = load(&kernel, &grouping()).unwrap();
        kernel.push_run(Run {
            error: -i64::from(errno),
            ..ran(vec![group(1, 10, 150)])
        });
        let e = p.run(target()).unwrap_err();
        assert!(
            matches!(e, RunError::Program { errno: e } if e == errno),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("bpf_map_update_elem (in the scan program) failed: {text}")
        );
        // The groups were drained all the same.
        kernel.push_run(ran(Vec::new()));
        assert_eq!(p.run(target()).unwrap().groups, []);
    }
}

#[test]
fn a_failure_while_draining_the_output_is_an_error() {
    let cases = [
        (
            libc::ENOMEM,
            "BPF_MAP_LOOKUP_AND_DELETE_BATCH failed: BPF_MAP_LOOKUP_AND_DELETE_BATCH failed: Cannot allocate memory (os error 12)",
        ),
        (
            libc::EINVAL,
            "BPF_MAP_LOOKUP_AND_DELETE_BATCH failed: maps of type hash cannot be drained: the kernel refused lookup-and-delete for it",
        ),
    ];
    for (errno, text) in cases {
        let kernel = ScriptedKernel::new();
        let p = load(&kernel, &grouping()).unwrap();
        kernel.push_run(ran(vec![group(1, 10, 150)]));
        kernel.fail(Call::Drain, errno);
        let e = p.run(target()).unwrap_err();
        assert!(matches!(e, RunError::Drain(_)), "{e:?}");
        assert_eq!(e.to_string(), text);
    }
    // Entries taken ([`Output::Entries`]) are drained the same way.
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &WalkPlan::entries(Cond::Const(true), 8)).unwrap();
    kernel.push_run(ran(vec![(vec![1, 0, 0, 0], vec![9, 0, 0, 0])]));
    kernel.fail(Call::Drain, libc::ENOMEM);
    assert!(matches!(p.run(target()), Err(RunError::Drain(_))));
}

#[test]
fn failures_writing_or_reading_the_scratch_value_are_errors() {
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &grouping()).unwrap();
    kernel.push_run(ran(Vec::new()));
    kernel.fail(Call::MapUpdate, libc::EFAULT);
    let e = p.run(target()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "BPF_MAP_UPDATE_ELEM failed: Bad address (os error 14)"
    );
    assert_eq!(kernel.unused(), 1, "the program did not run");

    kernel.fail(Call::MapLookup, libc::ENOMEM);
    let e = p.run(target()).unwrap_err();
    assert!(matches!(e, RunError::Sys(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "BPF_MAP_LOOKUP_ELEM failed: Cannot allocate memory (os error 12)"
    );
}

#[test]
fn failures_creating_maps_or_loading_btf_are_errors_of_the_call() {
    let kernel = ScriptedKernel::new();
    kernel.fail(Call::MapCreate, libc::ENOMEM);
    let e = load(&kernel, &grouping()).unwrap_err();
    assert!(matches!(e, LoadError::Sys(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "BPF_MAP_CREATE failed: Cannot allocate memory (os error 12)"
    );
    kernel.fail(Call::BtfLoad, libc::EINVAL);
    let e = load(&kernel, &grouping()).unwrap_err();
    assert!(matches!(e, LoadError::Sys(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "BPF_BTF_LOAD failed: Invalid argument (os error 22)"
    );
    assert_eq!(loads(&kernel), [], "no program was loaded");

    // What the probe says of them.
    kernel.fail(Call::MapCreate, libc::EPERM);
    assert_eq!(
        supported_with(&kernel).unwrap_err().to_string(),
        "cannot create a map: BPF_MAP_CREATE failed: Operation not permitted (os error 1)"
    );
    kernel.fail(Call::BtfLoad, libc::EPERM);
    let e = supported_with(&kernel).unwrap_err();
    assert!(matches!(e, Unsupported::Load(LoadError::Sys(_))), "{e:?}");
    assert_eq!(
        e.to_string(),
        "BPF_BTF_LOAD failed: Operation not permitted (os error 1)"
    );
}

#[test]
fn what_a_program_cannot_read_is_refused_before_any_call() {
    let kernel = ScriptedKernel::new();
    // Any fault scripted would be taken by the first call made.
    kernel.fail(Call::MapCreate, libc::EPERM);
    let trie = MapMeta {
        map_type: MapType::LPM_TRIE,
        ..fake::meta()
    };
    let e = load_on(&kernel, &trie, &grouping()).unwrap_err();
    assert!(
        matches!(e, LoadError::NotWalked(MapType::LPM_TRIE)),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "bpf_for_each_map_elem does not walk lpm_trie maps"
    );
    let per_cpu = MapMeta {
        map_type: MapType::PERCPU_HASH,
        ..fake::meta()
    };
    // A value member of a per-CPU map is read summed over its CPUs (or
    // one CPU's): a plan that reads it once does not run there.
    let e = load_on(&kernel, &per_cpu, &grouping()).unwrap_err();
    assert!(matches!(e, LoadError::Plan(PlanError::OtherCpus)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "the plan reads CPUs' values the map does not have"
    );
    let summed = WalkPlan {
        filter: Cond::Cmp(value().summed_over(2), CmpOp::Gt, 10),
        aggs: vec![AggOp::Count, AggOp::Sum(value().summed_over(2))],
        ..grouping()
    };
    let e = load_on(&kernel, &fake::meta(), &summed).unwrap_err();
    assert!(matches!(e, LoadError::Plan(PlanError::OtherCpus)), "{e:?}");
    // Entries of a per-CPU map are not copied out.
    let e = load_on(&kernel, &per_cpu, &WalkPlan::entries(Cond::Const(true), 8)).unwrap_err();
    assert!(
        matches!(e, LoadError::Plan(PlanError::PerCpuEntries)),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "a scan in the kernel does not copy out the entries of a per-CPU map"
    );
    let short_value = MapMeta {
        value_size: 2,
        ..fake::meta()
    };
    let e = load_on(&kernel, &short_value, &grouping()).unwrap_err();
    assert!(
        matches!(e, LoadError::Plan(PlanError::BeyondValue)),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "a member beyond the value");
    assert_eq!(kernel.unused(), 1, "no map was created");
    assert_eq!(loads(&kernel), []);
}

#[test]
fn a_dense_table_is_read_back_by_slot_and_zeroed_for_the_next_run() {
    let kernel = ScriptedKernel::new();
    let plan = dense_grouping();
    assert_eq!(plan.table(), GroupTable::Dense { slots: 256 });
    let p = load(&kernel, &plan).unwrap();
    kernel.push_run(ran(vec![group(2, 20, 400), group(1, 10, 150)]));
    let out = p.run(target()).unwrap();
    assert_eq!((out.visited, out.matched, out.overflowed), (100, 30, false));
    assert_eq!(
        out.groups,
        [
            WalkGroup {
                key: vec![1],
                count: 10,
                words: vec![(0, 0), (150, 0)],
            },
            WalkGroup {
                key: vec![2],
                count: 20,
                words: vec![(0, 0), (400, 0)],
            },
        ]
    );
    // Zeroed after the run: the next finds only its own.
    kernel.push_run(ran(vec![group(7, 1, 11)]));
    let out = p.run(target()).unwrap();
    assert_eq!(out.groups.len(), 1);
    assert_eq!((out.groups[0].key.as_slice(), out.matched), (&[7u8][..], 1));
    assert_eq!(kernel.unused(), 0);
}

#[test]
fn failures_reading_or_zeroing_a_dense_table_are_errors_of_the_run() {
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &dense_grouping()).unwrap();
    // The scratch value is read after the table: the first lookup is the
    // table's.
    kernel.push_run(ran(vec![group(1, 10, 150)]));
    kernel.fail(Call::MapLookup, libc::ENOMEM);
    let e = p.run(target()).unwrap_err();
    assert!(matches!(e, RunError::Sys(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "BPF_MAP_LOOKUP_ELEM failed: Cannot allocate memory (os error 12)"
    );
    assert!(kernel.slots_empty(), "the map left the slot");
    // Zeroing it: the third update of a run (the scratch value, the slot,
    // the table).
    kernel.push_run(ran(vec![group(1, 10, 150)]));
    kernel.fail_after(Call::MapUpdate, 2, libc::EFAULT);
    let e = p.run(target()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "BPF_MAP_UPDATE_ELEM failed: Bad address (os error 14)"
    );
    assert_eq!(kernel.unused(), 0);
}

#[test]
fn a_dense_table_past_max_groups_says_it_overflowed() {
    let kernel = ScriptedKernel::new();
    let p = load(&kernel, &dense_grouping()).unwrap();
    let full: Vec<_> = (1..=4).map(|k| group(k, 1, 11)).collect();
    kernel.push_run(Run {
        error: -i64::from(libc::E2BIG),
        ..ran(full)
    });
    let out = p.run(target()).unwrap();
    assert!(out.overflowed);
    assert_eq!(out.groups.len(), 4);
}
