//! `gradwire model` against the runs kept in benches/results/cost_model/ (measured over
//! network namespaces by benches/cost_model.sh): fitted on the 2- and 4-node runs of each
//! kind of link, it predicts every run, the 8-node ones unseen, within 25 % (median), and
//! picks the faster of ring and recursive doubling where the repeats tell them apart; and
//! its arguments are checked.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

fn model(args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(bin());
    cmd.arg("model").args(args);
    run_with_limit(cmd, Duration::from_secs(60))
}

/// Every repeat's time of each size of one kept run (its `.rN.csv` files beside `csv`).
fn repeat_times(csv: &str) -> std::collections::BTreeMap<u64, Vec<f64>> {
    let mut times: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    let stem = csv.strip_suffix(".csv").expect("a .csv file");
    for r in 1.. {
        let Ok(text) = std::fs::read_to_string(format!("{stem}.r{r}.csv")) else { break };
        for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
            let f: Vec<&str> = line.split(',').collect();
            times.entry(f[0].parse().unwrap()).or_default().push(f[4].parse().unwrap());
        }
    }
    times
}

#[test]
fn the_model_predicts_the_kept_runs() {
    let kept = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/results/cost_model");
    // runs.tsv: rate_gbit (or "native"), nodes, algo, csv, command.
    let runs_tsv = std::fs::read_to_string(format!("{kept}/runs.tsv")).unwrap();
    let runs: Vec<Vec<&str>> = runs_tsv.lines().skip(1).map(|l| l.split('\t').collect()).filter(|f: &Vec<&str>| f[2] != "auto").collect();
    let mut links: Vec<&str> = runs.iter().map(|f| f[0]).collect();
    links.dedup();
    assert!(links.contains(&"native") && links.len() >= 3, "two shaped rates and the unshaped links: {links:?}");
    // The runs' ranks shared the recording host's cores (network namespaces).
    let meta = std::fs::read_to_string(format!("{kept}/meta.tsv")).unwrap();
    let cores = meta.lines().find_map(|l| l.strip_prefix("cpus\t")).expect("meta.tsv names the cores").to_string();
    // Cases decided by the repeats (every repeat of the faster of ring and recursive
    // doubling beat every repeat of the slower), and whether the model picked the faster.
    let (mut cases, mut decided_right) = (0, vec![]);
    for link in &links {
        let of = |fit: bool| -> String {
            let v: Vec<String> = runs.iter().filter(|f| f[0] == *link && (f[1] == "8") != fit).map(|f| format!("{}:{}:{kept}/{}", f[2], f[1], f[3])).collect();
            v.join(",")
        };
        let out = model(&["--fit", &of(true), "--check", &of(false), "--cores", &cores]);
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        // algo,ranks,bytes,measured_us,predicted_us,in_fit,chosen
        let rows: Vec<Vec<&str>> = t.lines().filter(|l| !l.starts_with('#') && !l.starts_with("algo,")).map(|l| l.split(',').collect()).collect();
        assert_eq!(rows.len(), 3 * 3 * 7, "every run of every size:\n{t}");
        let mut errors: Vec<f64> = rows.iter().map(|f| (f[4].parse::<f64>().unwrap() / f[3].parse::<f64>().unwrap() - 1.0).abs()).collect();
        errors.sort_by(f64::total_cmp);
        let median = errors[errors.len() / 2];
        assert!(median < 0.25, "{link}: median error {median:.3}:\n{t}");
        if *link != "native" {
            // The fitted rate is the shaped link's.
            let fitted: f64 =
                t.split(" Gbit/s)").next().and_then(|s| s.rsplit('(').next()).and_then(|g| g.parse().ok()).unwrap_or_else(|| panic!("no fitted rate in:\n{t}"));
            let shaped: f64 = link.parse().unwrap();
            assert!((fitted / shaped - 1.0).abs() < 0.1, "fitted {fitted} Gbit/s for links shaped to {shaped}");
        }
        for nodes in ["2", "4", "8"] {
            let csv_of = |algo: &str| runs.iter().find(|f| f[0] == *link && f[1] == nodes && f[2] == algo).map(|f| format!("{kept}/{}", f[3])).unwrap();
            let (ring, rd) = (repeat_times(&csv_of("ring")), repeat_times(&csv_of("rd")));
            for (bytes, ring_times) in &ring {
                let rd_times = &rd[bytes];
                assert!(ring_times.len() >= 3 && ring_times.len() == rd_times.len(), "{link} {nodes} nodes {bytes} B: repeats {ring_times:?} {rd_times:?}");
                cases += 1;
                let lo = |v: &Vec<f64>| v.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = |v: &Vec<f64>| v.iter().copied().fold(0.0, f64::max);
                let faster = if hi(ring_times) < lo(rd_times) {
                    "ring"
                } else if hi(rd_times) < lo(ring_times) {
                    "rd"
                } else {
                    continue; // a tie within the noise
                };
                let pick = rows.iter().find(|f| f[0] == "ring" && f[1] == nodes && f[2].parse::<f64>().unwrap() == *bytes as f64).map(|f| f[6]).unwrap();
                decided_right.push((link.to_string(), nodes, *bytes, pick == faster));
            }
        }
    }
    assert_eq!(cases, links.len() * 3 * 7);
    // The model picks the faster of ring and recursive doubling in 90 % of the cases the
    // repeats decide, and they decide at least a third of them.
    let right = decided_right.iter().filter(|c| c.3).count();
    assert!(decided_right.len() * 3 >= cases, "the repeats decide {} of {cases} cases", decided_right.len());
    assert!(right * 10 >= decided_right.len() * 9, "the model picks the faster in {right} of {} decided cases: {decided_right:?}", decided_right.len());
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
