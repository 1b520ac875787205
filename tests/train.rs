//! The training drivers end to end: every strategy trains the built-in model (the UCI
//! digits) to a stated test accuracy in real processes over real transports, BSP with K = 1
//! is ssgd bit for bit, and `gradwire plot` draws the runs.

mod common;
use common::*;

/// Trains with `args` under `launch` and returns the output; the run must reach `require`.
fn train(n: usize, launch_args: &[&str], args: &[&str], env: &[(&str, &str)]) -> String {
    let mut all = vec!["train", "--require", "0.88"];
    if !args.contains(&"--epochs") {
        all.extend_from_slice(&["--epochs", "12"]);
    }
    all.extend_from_slice(args);
    let out = launch(n, launch_args, &all, env);
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "{t}");
    assert!(t.contains("/12  train loss") || t.contains("/25  train loss"), "{t}");
    t
}

const SHM: &[(&str, &str)] = &[("GRADWIRE_TRANSPORT", "shm")];
const TCP: &[(&str, &str)] = &[("GRADWIRE_TRANSPORT", "tcp")];

#[test]
fn ssgd_reaches_accuracy() {
    train(4, &[], &["--strategy", "ssgd"], SHM);
}

#[test]
fn daso_reaches_accuracy_across_two_nodes() {
    // Two namespace "nodes" of two ranks: real node-local and cross-node groups over tcp.
    if can_netns("train daso across namespaces") {
        let t = train(4, &["--netns", "--ranks-per-node", "2"], &["--strategy", "daso"], &[]);
        assert!(t.contains("[gs="), "the cycling phase never ran:\n{t}");
    } else {
        train(4, &[], &["--strategy", "daso"], SHM);
    }
}

#[test]
fn bsp_and_top_k_reach_accuracy() {
    train(4, &[], &["--strategy", "bsp", "--interval", "4"], SHM);
    train(3, &[], &["--strategy", "bsp", "--interval", "2", "--topk", "0.1"], TCP);
}

#[test]
fn ddcgu_reaches_accuracy_with_a_straggler() {
    // Two workers for two cores: with more ranks than cores the token waits for the
    // scheduler to run its holder, and these epochs last a few milliseconds.
    // How often the token comes round depends on the scheduler, and these epochs last
    // milliseconds: a wider model (longer steps) and more epochs keep the number of pushes,
    // hence the accuracy reached, well clear of the bar on a loaded machine.
    let longer = ["--hidden", "256,256", "--epochs", "25"];
    train(2, &[], &[&["--strategy", "ddcgu", "--lr", "0.2", "--slow", "1:3"][..], &longer].concat(), SHM);
    train(2, &[], &[&["--strategy", "ddcgu", "--lr", "0.2", "--rule", "staleness"][..], &longer].concat(), TCP);
}

#[test]
fn cyclic_reaches_accuracy() {
    train(3, &[], &["--strategy", "cyclic", "--lr", "0.2"], TCP);
}

#[test]
fn downpour_reaches_accuracy() {
    // Asynchronous pushes make the last epochs wander: at η = 0.05 and 12 epochs one run in
    // about twenty ended at 86.7 % after 94.2 % the epoch before. η = 0.03 over 25 epochs
    // ended at 94.7–96.9 % with both cores busy elsewhere, and the wander is 1–3 points.
    train(4, &[], &["--strategy", "downpour", "--lr", "0.03", "--push", "2", "--fetch", "2", "--epochs", "25"], SHM);
}

#[test]
fn eamsgd_reaches_accuracy() {
    train(4, &[], &["--strategy", "eamsgd", "--lr", "0.01", "--tau", "4"], TCP);
}

/// BSP with K = 1 performs exactly ssgd's operations: the final parameters are identical.
#[test]
fn bsp_with_interval_one_is_ssgd_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("gradwire-bsp1-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (dir.join("ssgd.f32"), dir.join("bsp.f32"));
    for (strategy, path) in [("ssgd", &a), ("bsp", &b)] {
        let out =
            launch(3, &[], &["train", "--strategy", strategy, "--interval", "1", "--epochs", "3", "--seed", "7", "--save-params", path.to_str().unwrap()], SHM);
        assert!(out.status.success(), "{}", text(&out));
    }
    let (pa, pb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert!(!pa.is_empty() && pa.len() % 4 == 0);
    let differ = pa.chunks(4).zip(pb.chunks(4)).filter(|(x, y)| x != y).count();
    assert_eq!(differ, 0, "{differ} of {} parameters differ", pa.len() / 4);
    // And training moved them: not a comparison of two untouched initialisations.
    let out = launch(3, &[], &["train", "--strategy", "ssgd", "--epochs", "1", "--seed", "7", "--save-params", a.to_str().unwrap()], SHM);
    assert!(out.status.success());
    assert_ne!(std::fs::read(&a).unwrap(), pb);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn csv_and_plot() {
    let dir = std::env::temp_dir().join(format!("gradwire-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("run.csv");
    let svg = dir.join("run.svg");
    let out = launch(2, &[], &["train", "--strategy", "bsp", "--epochs", "3", "--csv", csv.to_str().unwrap(), "--plot", svg.to_str().unwrap()], SHM);
    assert!(out.status.success(), "{}", text(&out));
    let rows = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(rows.lines().count(), 4, "{rows}");
    assert!(rows.starts_with("label,strategy,ranks,epoch,wall_s,train_loss,test_loss,test_acc"));
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(drawn.starts_with("<svg") && drawn.matches("<polyline").count() == 2, "{drawn}");
    let out = std::process::Command::new(bin()).args(["plot", "-o", svg.to_str().unwrap(), csv.to_str().unwrap(), csv.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_arguments_are_refused_clearly() {
    for (args, want) in [
        (vec!["train", "--strategy", "sgdx"], "unknown strategy 'sgdx'"),
        (vec!["train", "--slow", "9:2"], "--slow 9:2"),
        (vec!["train", "--data", "mnist"], "unknown data set 'mnist'"),
        (vec!["train", "--strategy", "bsp", "--interval", "0"], "at least 1"),
    ] {
        let out = launch(2, &[], &args, SHM);
        let t = text(&out);
        assert!(!out.status.success() && t.contains(want), "{args:?}: {t}");
        assert!(!t.contains("panicked"), "{t}");
    }
}
