//! Rules written once: a grep over the sources (src/ and the Python package with its C++
//! backend) that fails when the buffer-overlap rule or the dtype table is written a second
//! time. The Python binding's own code tables are checked against the header instead
//! (tests/ffi_header.rs, python_tables_match_the_header). And figures written once: the
//! report's GPU section comes from its committed run.

use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs" || e == "py" || e == "cpp") {
            out.push(path);
        }
    }
}

fn all_sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![];
    sources(&root.join("src"), &mut files);
    sources(&root.join("python/gradwire"), &mut files);
    assert!(files.len() > 50, "found only {} source files", files.len());
    files.into_iter().map(|p| (p.strip_prefix(root).unwrap().display().to_string(), std::fs::read_to_string(&p).unwrap())).collect()
}

/// Whether a line tests two address ranges for a shared byte: two comparisons `a < b + n`
/// (or `b.saturating_add(n)`, ...) joined by `&&` or `and`.
fn interval_overlap(line: &str) -> bool {
    let bounded = |clause: &str| {
        clause.split_once('<').is_some_and(|(_, right)| !right.starts_with('<') && !right.starts_with('=') && (right.contains('+') || right.contains("_add(")))
    };
    line.split("&&").flat_map(|c| c.split(" and ")).filter(|c| bounded(c)).count() >= 2
}

#[test]
fn the_overlap_rule_is_written_once() {
    let mut found = vec![];
    for (path, text) in all_sources() {
        for (n, line) in text.lines().enumerate() {
            if interval_overlap(line) {
                found.push(format!("{path}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert_eq!(found.len(), 1, "the overlap of two buffers is tested in one place, src/collective/layout.rs (Span::overlaps); found: {found:#?}");
    assert!(found[0].starts_with("src/collective/layout.rs:"), "{found:?}");
    // The check itself finds the forms the rule was written in before.
    for old in [
        "s < r.saturating_add(rb) && r < s.saturating_add(sb)",
        "return an > 0 and bn > 0 and a0 < b0 + bn and b0 < a0 + an",
        "bool overlap = wn > 0 && pn > 0 && w < p + pn && p < w + wn;",
    ] {
        assert!(interval_overlap(old), "{old}");
    }
    assert!(!interval_overlap("if a < b && c <= d + 1 {"));
}

#[test]
fn the_dtype_table_is_written_once() {
    let names = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool"];
    let mut found = vec![];
    for (path, text) in all_sources().into_iter().filter(|(p, _)| p.ends_with(".rs")) {
        let quoted = names.iter().filter(|n| text.contains(&format!("\"{n}\""))).count();
        let listed = text.contains("float32,float64");
        if quoted >= 5 || listed {
            found.push(path);
        }
    }
    assert_eq!(found, ["src/dtype.rs"], "gradwire's element types are named and numbered in src/dtype.rs alone");
}

/// The report's GPU section is what benches/gpu_report.py makes of the newest committed GPU
/// run (benches/results/gpu/), not figures typed or left behind by hand.
#[test]
fn the_gpu_report_section_is_its_committed_run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut runs: Vec<PathBuf> = std::fs::read_dir(root.join("benches/results/gpu")).unwrap().map(|e| e.unwrap().path()).collect();
    runs.sort();
    let newest = runs.last().expect("a committed GPU run").strip_prefix(root).unwrap().display().to_string();
    let out = std::process::Command::new("python3").current_dir(root).args(["benches/gpu_report.py", &newest]).output().expect("run python3");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let section = String::from_utf8(out.stdout).unwrap();
    let report = std::fs::read_to_string(root.join("docs/benchmarks.md")).unwrap();
    assert!(report.contains(section.trim()), "docs/benchmarks.md's GPU section is not benches/gpu_report.py {newest}: run it with --record");
}
