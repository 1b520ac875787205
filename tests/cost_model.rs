//! `gradwire model` against the runs kept in benches/results/cost_model/ (measured over
//! network namespaces by benches/cost_model.sh): fitted on the 2- and 4-node runs of each
//! link rate, it predicts every run, the 8-node ones unseen, within 25 % (median); and its
//! arguments are checked.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

fn model(args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(bin());
    cmd.arg("model").args(args);
    run_with_limit(cmd, Duration::from_secs(60))
}

#[test]
fn the_model_predicts_the_kept_runs() {
    let kept = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/results/cost_model");
    // Of each (rate, ranks, bytes): ring's and rd's measured time, and the model's pick.
    let mut cases: std::collections::BTreeMap<(String, String, String), (f64, f64, String)> = Default::default();
    for rate in ["0.2", "1"] {
        let runs = |nodes: &[usize]| -> String {
            let mut v = vec![];
            for n in nodes {
                for algo in ["ring", "rd", "hd"] {
                    v.push(format!("{algo}:{n}:{kept}/allreduce_{rate}g_n{n}_{algo}.csv"));
                }
            }
            v.join(",")
        };
        // The runs' ranks shared the recording host's cores (network namespaces).
        let meta = std::fs::read_to_string(format!("{kept}/meta.tsv")).unwrap();
        let cores = meta.lines().find_map(|l| l.strip_prefix("cpus\t")).expect("meta.tsv names the cores").to_string();
        let out = model(&["--fit", &runs(&[2, 4]), "--check", &runs(&[8]), "--cores", &cores]);
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        // algo,ranks,bytes,measured_us,predicted_us,in_fit,chosen
        let mut errors: Vec<f64> = t
            .lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with("algo,"))
            .map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                let (measured, predicted): (f64, f64) = (f[3].parse().unwrap(), f[4].parse().unwrap());
                (predicted / measured - 1.0).abs()
            })
            .collect();
        assert_eq!(errors.len(), 3 * 3 * 7, "every run of every size:\n{t}");
        for l in t.lines().filter(|l| l.starts_with("ring,") || l.starts_with("rd,")) {
            let f: Vec<&str> = l.split(',').collect();
            let case = cases.entry((rate.to_string(), f[1].to_string(), f[2].to_string())).or_default();
            let measured: f64 = f[3].parse().unwrap();
            if f[0] == "ring" {
                case.0 = measured
            } else {
                case.1 = measured
            }
            case.2 = f[6].to_string();
        }
        errors.sort_by(f64::total_cmp);
        let median = errors[errors.len() / 2];
        assert!(median < 0.25, "{rate} Gbit/s: median error {median:.3}:\n{t}");
        // The fitted rate is the shaped link's.
        let fitted: f64 =
            t.split(" Gbit/s)").next().and_then(|s| s.rsplit('(').next()).and_then(|g| g.parse().ok()).unwrap_or_else(|| panic!("no fitted rate in:\n{t}"));
        let shaped: f64 = rate.parse().unwrap();
        assert!((fitted / shaped - 1.0).abs() < 0.1, "fitted {fitted} Gbit/s for links shaped to {shaped}");
    }
    // The pick of ring or recursive doubling: the faster, or one within 5 % of it (with 2
    // nodes the two move the same bytes and tie within noise), in 90 % of the cases.
    let good = cases.values().filter(|(ring, rd, pick)| if pick == "ring" { *ring <= 1.05 * rd } else { *rd <= 1.05 * ring }).count();
    assert_eq!(cases.len(), 2 * 3 * 7, "{cases:?}");
    assert!(good * 10 >= cases.len() * 9, "the model picks the faster (or within 5 %) in {good} of {} cases: {cases:?}", cases.len());
}

#[test]
fn model_arguments_are_checked() {
    for (args, expect) in [
        (vec!["--nodes", "0"], "must be positive"),
        (vec!["--gbit=-1"], "the rate must be positive"),
        (vec!["--gbit", "NaN"], "the rate must be positive"),
        (vec!["--compute-ms=-5"], "not negative"),
        (vec!["--check", "ring:2:x.csv"], "need --fit"),
        (vec!["--cores", "2"], "need --fit"),
        (vec!["--fit", "ring:2:x.csv", "--cores", "0"], "at least one core"),
        (vec!["--fit", "ring:1:x.csv"], "at least 2"),
        (vec!["--fit", "tree:2:x.csv"], "not one of ring, rd, hd"),
        (vec!["--fit", "ring:2"], "expected ALGO:RANKS:FILE"),
        (vec!["--fit", "ring:2:/nonexistent.csv"], "/nonexistent.csv"),
    ] {
        let out = model(&args);
        let t = text(&out);
        assert!(!out.status.success() && t.contains(expect), "gradwire model {args:?} should fail with {expect:?}:\n{t}");
        assert!(!t.contains("panicked"), "{t}");
    }
    let out = model(&["--nodes", "4", "--ranks-per-node", "2", "-b", "4K", "-e", "64K", "--compute-ms", "10"]);
    let t = text(&out);
    assert!(out.status.success() && t.contains("sharded_us") && t.contains("daso_wait_per_batch_us") && t.lines().count() == 5, "{t}");
}
