//! Property tests (proptest, a bounded number of generated cases per run) of the parsers
//! that take input from outside: the frame header decoder, the rank environment and the
//! settings. Nothing may panic, whatever arrives; what is accepted must satisfy the
//! invariants the rest of gradwire relies on. (The rendezvous store's protocol and the
//! one-sided service's requests are fuzzed over real connections beside their private
//! parts, in `bootstrap::store` and `transport::onesided`.)

use gradwire::bootstrap::RankEnv;
use gradwire::transport::frame::{FrameHeader, HEADER_LEN};
use proptest::prelude::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any 40 bytes decode to a header that encodes back to them, or to an error.
    #[test]
    fn frame_headers_decode_or_fail_cleanly(bytes in proptest::array::uniform32(any::<u8>()), tail in proptest::array::uniform8(any::<u8>()), magic in any::<bool>()) {
        let mut b = [0u8; HEADER_LEN];
        b[..32].copy_from_slice(&bytes);
        b[32..].copy_from_slice(&tail);
        if magic {
            b[..4].copy_from_slice(b"GWF1");
        }
        if let Ok(h) = FrameHeader::decode(&b) {
            prop_assert_eq!(h.encode(), b);
        }
    }
}

const RANK_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "GRADWIRE_RANK",
    "GRADWIRE_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GRADWIRE_MASTER_ADDR",
    "GRADWIRE_MASTER_PORT",
    "GRADWIRE_JOB_SECRET",
];

/// Values a launcher or a user might set: numbers at and past every boundary, and junk.
fn env_value() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..10).prop_map(|v| v.to_string()),
        prop_oneof![Just(u64::MAX), Just(1 << 20), Just((1 << 20) + 1), Just(65535), Just(65536), Just(u32::MAX as u64 + 1)].prop_map(|v| v.to_string()),
        Just("-1".to_string()),
        Just(" 3 ".to_string()),
        Just("0123456789abcdef".to_string()),
        ".{0,24}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Whatever the environment says, parsing it is an answer or a clear error, and an
    /// answer is a job gradwire can run.
    #[test]
    fn rank_environments_parse_or_fail_cleanly(vars in proptest::collection::hash_map(proptest::sample::select(RANK_VARS), env_value(), 0..10)) {
        let m: HashMap<String, String> = vars.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        match RankEnv::from_lookup(&|k| m.get(k).cloned()) {
            Ok(e) => {
                prop_assert!(e.world >= 1 && e.world <= gradwire::bootstrap::env::MAX_WORLD && e.rank < e.world);
                if e.world > 1 {
                    prop_assert!(e.master_port != 0 && e.secret.len() >= 8 && !e.master_addr.is_empty());
                }
            }
            Err(err) => prop_assert!(!err.to_string().is_empty()),
        }
    }
}

const SETTINGS: &[&str] = &[
    "GRADWIRE_TIMEOUT_MS",
    "GRADWIRE_TRANSPORT",
    "GRADWIRE_ALGO",
    "GRADWIRE_SMALL_BYTES",
    "GRADWIRE_RING_CHUNK_BYTES",
    "GRADWIRE_SHM_RING_BYTES",
    "GRADWIRE_SHM_STAGE_BYTES",
    "GRADWIRE_SHM_STORES",
    "GRADWIRE_SHM_CMA",
    "GRADWIRE_SPIN_US",
    "GRADWIRE_HUGEPAGES",
    "GRADWIRE_IB_RING_BYTES",
    "GRADWIRE_IB_ZONE_BYTES",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Every setting, set to anything: a configuration whose durations are bounded (a
    /// deadline can always be computed), or an error naming the variable.
    #[test]
    fn settings_parse_or_fail_cleanly(vars in proptest::collection::hash_map(proptest::sample::select(SETTINGS), env_value(), 0..6)) {
        // This test binary's only test that touches the environment; nextest runs each
        // test in a process of its own.
        for s in SETTINGS {
            std::env::remove_var(s);
        }
        // An environment cannot hold NUL.
        let vars: HashMap<&str, String> = vars.into_iter().map(|(k, v)| (k, v.replace('\0', ""))).collect();
        for (k, v) in &vars {
            std::env::set_var(k, v);
        }
        match gradwire::Config::from_env() {
            Ok(c) => {
                prop_assert!(c.timeout >= Duration::from_millis(1) && c.timeout.as_millis() <= u128::from(gradwire::config::MAX_TIMEOUT_MS));
                prop_assert!(c.spin.as_micros() <= u128::from(gradwire::config::MAX_SPIN_US));
                prop_assert!(Instant::now().checked_add(c.timeout).is_some());
            }
            Err(e) => {
                let named = vars.keys().any(|k| e.to_string().contains(k));
                prop_assert!(named, "{} names none of {:?}", e, vars);
            }
        }
    }
}
