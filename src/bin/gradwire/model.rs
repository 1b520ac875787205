//! `gradwire model`: the cost model's predictions for a job's shape and links, and its
//! parameters fitted from `gradwire bench --csv` runs, with each run's predicted time
//! beside the measured one.

use gradwire::cost::fit::{fit, samples_from_csv, Sample};
use gradwire::cost::{choose_over_links, choose_over_links_sharing, job_time, Algorithm, DasoStep, Job, Link};

/// One measured run: `ALGO:RANKS:FILE` (a `gradwire bench allreduce --csv` file).
pub fn run_arg(s: &str) -> Result<(Algorithm, usize, String), String> {
    let mut parts = s.splitn(3, ':');
    let (algo, ranks, file) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next().ok_or_else(|| format!("{s:?}: expected ALGO:RANKS:FILE"))?);
    let algo = Algorithm::OVER_LINKS.into_iter().find(|a| a.name() == algo).ok_or_else(|| format!("{s:?}: algorithm {algo:?} is not one of ring, rd, hd"))?;
    let ranks = ranks.parse::<usize>().ok().filter(|&r| r >= 2).ok_or_else(|| format!("{s:?}: ranks {ranks:?} must be a number of at least 2"))?;
    Ok((algo, ranks, file.to_string()))
}

/// The samples of `runs`, whose ranks shared `cores` cores (None: each had one of its own).
fn samples(runs: &[(Algorithm, usize, String)], cores: Option<usize>) -> Result<Vec<Sample>, String> {
    let mut all = vec![];
    for (algo, ranks, file) in runs {
        let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
        let ranks_per_core = cores.map_or(1.0, |c| *ranks as f64 / c as f64);
        all.extend(samples_from_csv(&text, *algo, *ranks).map_err(|e| format!("{file}: {e}"))?.into_iter().map(|s| Sample { ranks_per_core, ..s }));
    }
    Ok(all)
}

/// Fits a link to `runs` and prints it, then every sample of `runs` and `checks` as CSV:
/// measured and predicted time, whether the fit saw it, and the faster of ring and
/// recursive doubling by the fitted model (on the runs' host: `cores` shared by the ranks).
pub fn fit_runs(runs: &[(Algorithm, usize, String)], checks: &[(Algorithm, usize, String)], cores: Option<usize>) -> Result<(), String> {
    if cores == Some(0) {
        return Err("--cores 0: the ranks' host has at least one core".into());
    }
    let (seen, held) = (samples(runs, cores)?, samples(checks, cores)?);
    let link = fit(&seen)?;
    println!(
        "# fitted on {} calls: alpha {:.2} us, beta {:.4} ns/B ({:.3} Gbit/s), gamma {:.4} ns/B, sigma {:.2} us per step per rank beyond one on a core",
        seen.len(),
        link.alpha * 1e6,
        link.beta * 1e9,
        8.0 / link.beta / 1e9,
        link.gamma * 1e9,
        link.sigma * 1e6
    );
    println!("algo,ranks,bytes,measured_us,predicted_us,in_fit,chosen");
    for (sample, in_fit) in seen.iter().map(|s| (s, 1)).chain(held.iter().map(|s| (s, 0))) {
        let predicted = sample.terms().time(&link);
        let chosen = choose_over_links_sharing(sample.bytes, sample.ranks, sample.ranks_per_core, &link).0;
        println!("{},{},{},{:.3},{:.3},{in_fit},{chosen}", sample.algo, sample.ranks, sample.bytes, sample.seconds * 1e6, predicted * 1e6);
    }
    Ok(())
}

/// Prints the predicted allreduce time of every algorithm for each size, and the pick; with
/// `daso`, also the communication a DASO rank waits for per batch (its cycling phase) for
/// a model of that many bytes.
pub fn predict(job: &Job, sizes: &[usize], daso: Option<DasoStep>) {
    let hierarchical = job.per_node > 1;
    let algos: Vec<Algorithm> = if hierarchical {
        vec![Algorithm::Ring, Algorithm::RecursiveDoubling, Algorithm::HalvingDoubling, Algorithm::Sharded, Algorithm::Leader]
    } else {
        Algorithm::OVER_LINKS.to_vec()
    };
    println!(
        "# {} nodes x {} ranks; network: alpha {:.2} us, {:.3} Gbit/s, gamma {:.3} ns/B; node: alpha {:.2} us, {:.3} Gbit/s",
        job.nodes,
        job.per_node,
        job.network.alpha * 1e6,
        8.0 / job.network.beta / 1e9,
        job.network.gamma * 1e9,
        job.node.alpha * 1e6,
        8.0 / job.node.beta / 1e9
    );
    let names: Vec<String> = algos.iter().map(|a| format!("{a}_us")).collect();
    let daso_cols = if daso.is_some() { ",daso_wait_per_batch_us" } else { "" };
    println!("bytes,{},auto_over_links,fastest{daso_cols}", names.join(","));
    for &s in sizes {
        let b = s as f64;
        let times: Vec<f64> = algos.iter().map(|&a| job_time(a, b, job)).collect();
        let fastest = algos.iter().zip(&times).min_by(|x, y| x.1.total_cmp(y.1)).map(|(a, _)| *a).expect("an algorithm");
        let auto = choose_over_links(b, job.nodes * job.per_node, &job.network).0;
        let cells: Vec<String> = times.iter().map(|t| format!("{:.3}", t * 1e6)).collect();
        let daso_cell = daso.map(|d| format!(",{:.3}", d.wait_per_batch(b, job) * 1e6)).unwrap_or_default();
        println!("{s},{},{auto},{fastest}{daso_cell}", cells.join(","));
    }
}

/// A link from the command line's numbers.
pub fn link(gbit: f64, alpha_us: f64, gamma_ns: f64) -> Result<Link, String> {
    let (rate_ok, others_ok) = (gbit > 0.0 && gbit.is_finite(), [alpha_us, gamma_ns].iter().all(|v| *v >= 0.0 && v.is_finite()));
    if !rate_ok || !others_ok {
        return Err(format!("link rate {gbit} Gbit/s, alpha {alpha_us} us, gamma {gamma_ns} ns/B: the rate must be positive, the others not negative"));
    }
    Ok(Link::of_rate(gbit, alpha_us * 1e-6, gamma_ns * 1e-9))
}
