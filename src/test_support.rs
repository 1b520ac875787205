//! Helpers for the library's own tests: panics counted on any thread, skipping where a
//! dependency is missing, and hand-written C layouts checked against the system's header.

use std::sync::atomic::{AtomicUsize, Ordering};

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Panics so far on any thread of this process (a server's connection thread too, where a
/// panic would not fail the test by itself); counting starts at the first call.
pub fn panics_so_far() -> usize {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
    PANICS.load(Ordering::SeqCst)
}

/// A unit test that cannot run here (a header or the C compiler missing) says why and
/// passes, except where `GRADWIRE_TEST_REQUIRE=all` asks every test to run (`.ci/run`):
/// there it fails.
pub(crate) fn skip_test(test: &str, why: &str) {
    if std::env::var("GRADWIRE_TEST_REQUIRE").is_ok_and(|v| v == "all") {
        panic!("{test} cannot run here: {why} (GRADWIRE_TEST_REQUIRE=all: every test must run; .ci/run installs what they need)");
    }
    println!("skipped {test}: {why}");
}

/// Compiles and runs a C program that includes `header` (with `-I include` where given)
/// and prints every C expression of `declared`, and asserts that each equals the value
/// given beside it (`ours` names the Rust file that declares them). Skips (see
/// [`skip_test`]) where no C compiler runs.
pub(crate) fn assert_c_values(test: &str, include: Option<&str>, header: &str, declared: &[(String, u64)], ours: &str) {
    let dir = std::env::temp_dir().join(format!("gradwire-abi-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = format!("#include <stddef.h>\n#include <stdio.h>\n#include <string.h>\n#include <{header}>\nint main(void) {{\n");
    for (expr, _) in declared {
        c += &format!("    printf(\"%llu\\n\", (unsigned long long)({expr}));\n");
    }
    c += "    return 0;\n}\n";
    std::fs::write(dir.join("abi.c"), c).unwrap();
    let mut cc = std::process::Command::new("cc");
    if let Some(dir) = include {
        cc.arg(format!("-I{dir}"));
    }
    let compiled = match cc.arg("-o").arg(dir.join("abi")).arg(dir.join("abi.c")).output() {
        Ok(o) => o,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            skip_test(test, &format!("no C compiler `cc` ({e})"));
            return;
        }
    };
    assert!(compiled.status.success(), "compiling the layout probe failed:\n{}", String::from_utf8_lossy(&compiled.stderr));
    let out = std::process::Command::new(dir.join("abi")).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let got: Vec<u64> = String::from_utf8_lossy(&out.stdout).lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(got.len(), declared.len());
    let wrong: Vec<String> =
        declared.iter().zip(&got).filter(|((_, here), c)| here != *c).map(|((e, here), c)| format!("{e}: {header} {c}, here {here}")).collect();
    assert!(wrong.is_empty(), "{header} disagrees with {ours}:\n{}", wrong.join("\n"));
}
