//! The header is the ABI's source of truth: bindgen parses `ffi/gradwire.h`, syn parses the
//! exports in `src/ffi/`, and every function must exist on both sides with the same
//! parameter and return types; the enum values must equal the Rust ones.

use quote::ToTokens;
use std::collections::BTreeMap;

/// Type text with paths and spacing normalised (`::std::os::raw::c_int` → `c_int`).
fn norm(t: &syn::Type) -> String {
    let s = t.to_token_stream().to_string().replace(' ', "");
    ["::std::os::raw::", "std::os::raw::", "::core::ffi::", "core::ffi::", "std::ffi::", "::std::ffi::"].iter().fold(s, |acc, p| acc.replace(p, ""))
}

type Sig = (Vec<String>, String);

fn ret(o: &syn::ReturnType) -> String {
    match o {
        syn::ReturnType::Default => "()".into(),
        syn::ReturnType::Type(_, t) => norm(t),
    }
}

fn args<'a>(inputs: impl Iterator<Item = &'a syn::FnArg>) -> Vec<String> {
    inputs
        .map(|a| match a {
            syn::FnArg::Typed(p) => norm(&p.ty),
            syn::FnArg::Receiver(_) => "self".into(),
        })
        .collect()
}

fn header_bindings() -> syn::File {
    let root = env!("CARGO_MANIFEST_DIR");
    let bindings = bindgen::Builder::default()
        .header(format!("{root}/ffi/gradwire.h"))
        .allowlist_function("gradwire_.*")
        .allowlist_type("gradwire_.*")
        .allowlist_var("GRADWIRE_.*")
        .prepend_enum_name(false)
        .generate()
        .unwrap_or_else(|e| panic!("bindgen could not parse ffi/gradwire.h ({e}); it needs libclang (apt-get install libclang-dev; .ci/run does this)"));
    syn::parse_file(&bindings.to_string()).expect("bindgen output parses")
}

#[test]
fn header_matches_rust_exports() {
    let header = header_bindings();
    let mut declared: BTreeMap<String, Sig> = BTreeMap::new();
    let mut consts: BTreeMap<String, i64> = BTreeMap::new();
    for item in &header.items {
        match item {
            syn::Item::ForeignMod(m) => {
                for f in &m.items {
                    if let syn::ForeignItem::Fn(f) = f {
                        declared.insert(f.sig.ident.to_string(), (args(f.sig.inputs.iter()), ret(&f.sig.output)));
                    }
                }
            }
            // bindgen's layout assertions are `const _`.
            syn::Item::Const(c) if c.ident != "_" => {
                let v = c.expr.to_token_stream().to_string().replace(' ', "");
                consts.insert(c.ident.to_string(), v.parse().unwrap_or_else(|_| panic!("constant {} = {v}", c.ident)));
            }
            _ => {}
        }
    }
    // The C ABI's Rust side: every file of src/ffi/.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/ffi");
    let mut rust = syn::File { shebang: None, attrs: vec![], items: vec![] };
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let src = std::fs::read_to_string(&path).unwrap();
        rust.items.extend(syn::parse_file(&src).unwrap_or_else(|e| panic!("{} parses: {e}", path.display())).items);
    }
    let mut exported: BTreeMap<String, Sig> = BTreeMap::new();
    for item in &rust.items {
        if let syn::Item::Fn(f) = item {
            let is_c = f.sig.abi.as_ref().and_then(|a| a.name.as_ref()).is_some_and(|n| n.value() == "C");
            let no_mangle = f.attrs.iter().any(|a| a.path().is_ident("no_mangle"));
            if is_c && no_mangle {
                exported.insert(f.sig.ident.to_string(), (args(f.sig.inputs.iter()), ret(&f.sig.output)));
            }
        }
    }
    assert!(declared.len() >= 15, "the header declares only {:?}", declared.keys());
    // Structs passed by pointer: the same fields, in order, of the same types.
    let fields = |file: &syn::File| -> BTreeMap<String, Vec<(String, String)>> {
        file.items
            .iter()
            .filter_map(|i| match i {
                syn::Item::Struct(st) if st.ident.to_string().starts_with("gradwire_") => {
                    Some((st.ident.to_string(), st.fields.iter().map(|f| (f.ident.as_ref().map(|i| i.to_string()).unwrap_or_default(), norm(&f.ty))).collect()))
                }
                _ => None,
            })
            .collect()
    };
    let (c_structs, rust_structs) = (fields(&header), fields(&rust));
    for name in ["gradwire_p2p_op_t", "gradwire_unique_id_t"] {
        let c = c_structs.get(name).unwrap_or_else(|| panic!("{name} missing from gradwire.h"));
        let r = rust_structs.get(name).unwrap_or_else(|| panic!("{name} missing from src/ffi/"));
        // bindgen writes array lengths as numbers.
        let len = format!("{}usize", gradwire::bootstrap::unique_id::UNIQUE_ID_BYTES);
        let r: Vec<(String, String)> = r.iter().map(|(f, t)| (f.clone(), t.replace("UNIQUE_ID_BYTES", &len))).collect();
        assert_eq!(&r, c, "{name}: Rust fields differ from the header's");
    }
    for (name, sig) in &declared {
        let mine = exported.get(name).unwrap_or_else(|| panic!("{name} is declared in gradwire.h but not exported by src/ffi/"));
        assert_eq!(mine, sig, "{name}: Rust signature differs from the header's");
    }
    for name in exported.keys() {
        assert!(declared.contains_key(name), "{name} is exported but missing from gradwire.h");
    }

    // Enum values: the header's against the Rust enums and error codes.
    use gradwire::{DType, Error, ReduceOp};
    for d in DType::ALL {
        let name = format!("GRADWIRE_{}", d.name().to_uppercase());
        assert_eq!(consts[&name], d as i64, "{name}");
    }
    for o in ReduceOp::ALL {
        let name = format!("GRADWIRE_{}", o.name().to_uppercase());
        assert_eq!(consts[&name], o as i64, "{name}");
    }
    assert_eq!(consts["GRADWIRE_P2P_SEND"], gradwire::ffi::GRADWIRE_P2P_SEND as i64);
    assert_eq!(consts["GRADWIRE_P2P_RECV"], gradwire::ffi::GRADWIRE_P2P_RECV as i64);
    assert_eq!(consts["GRADWIRE_UNIQUE_ID_BYTES"], gradwire::bootstrap::unique_id::UNIQUE_ID_BYTES as i64);
    let io = || std::io::Error::other("x");
    let codes: &[(&str, Error)] = &[
        ("GRADWIRE_ERR_CONFIG", Error::Config(String::new())),
        ("GRADWIRE_ERR_INVALID_ARGUMENT", Error::InvalidArgument(String::new())),
        ("GRADWIRE_ERR_TIMEOUT", Error::Timeout { rank: 0, peer: 0, op: String::new(), waited_ms: 0 }),
        ("GRADWIRE_ERR_IN_PROGRESS", Error::StillRunning { waited_ms: 0 }),
        ("GRADWIRE_ERR_PEER_LOST", Error::PeerLost { rank: 0, peer: 0, op: String::new(), cause: String::new() }),
        ("GRADWIRE_ERR_MISMATCH", Error::Mismatch { rank: 0, mine: String::new(), peer: 0, theirs: String::new() }),
        ("GRADWIRE_ERR_ABORTED", Error::Aborted { rank: 0, peer: 0, reason: String::new() }),
        ("GRADWIRE_ERR_AUTH", Error::Auth(String::new())),
        ("GRADWIRE_ERR_PROTOCOL", Error::Protocol(String::new())),
        ("GRADWIRE_ERR_SYSTEM", Error::io("x", io())),
        ("GRADWIRE_ERR_UNSUPPORTED", Error::Unsupported(String::new())),
    ];
    for (name, e) in codes {
        assert_eq!(consts[*name], e.code() as i64, "{name}");
    }
    assert_eq!(consts["GRADWIRE_OK"], gradwire::ffi::GRADWIRE_OK as i64);
    assert_eq!(consts["GRADWIRE_ERR_INTERNAL"], gradwire::ffi::GRADWIRE_ERR_INTERNAL as i64);
}
