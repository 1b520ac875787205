// Nothing to generate yet: the C header under ffi/ is hand-written and checked by tests.
// Rebuild only when the header changes.
fn main() {
    println!("cargo:rerun-if-changed=ffi/gradwire.h");
}
