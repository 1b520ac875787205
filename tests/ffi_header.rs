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

/// The header's functions (name to signature) and constants (name to value).
fn functions_and_constants(header: &syn::File) -> (BTreeMap<String, Sig>, BTreeMap<String, i64>) {
    let (mut declared, mut consts) = (BTreeMap::new(), BTreeMap::new());
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
    (declared, consts)
}

#[test]
fn header_matches_rust_exports() {
    let header = header_bindings();
    let (declared, consts) = functions_and_constants(&header);
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
    for (code, (name, _)) in gradwire::ffi::GRADWIRE_CALLS.iter().enumerate() {
        assert_eq!(consts[*name], code as i64, "{name}");
    }
    use gradwire::ffi::{GRADWIRE_LAYOUT_APART, GRADWIRE_LAYOUT_BLOCK, GRADWIRE_LAYOUT_IN_PLACE, GRADWIRE_LAYOUT_OVERLAPPING};
    for (name, v) in [
        ("GRADWIRE_LAYOUT_APART", GRADWIRE_LAYOUT_APART),
        ("GRADWIRE_LAYOUT_IN_PLACE", GRADWIRE_LAYOUT_IN_PLACE),
        ("GRADWIRE_LAYOUT_BLOCK", GRADWIRE_LAYOUT_BLOCK),
        ("GRADWIRE_LAYOUT_OVERLAPPING", GRADWIRE_LAYOUT_OVERLAPPING),
    ] {
        assert_eq!(consts[name], v as i64, "{name}");
    }
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

/// A header type as ctypes names the type the Python binding must declare for it:
/// typedefs resolved, a pointer to `void`, `float` or an opaque handle a `c_void_p`, `char *` a
/// `c_char_p`, any other pointer `*` and its target; `size_t` and `uint64_t` are both
/// `c_ulong` to ctypes on this platform, as `int64_t` is `c_long`.
fn ctypes_name(t: &str, aliases: &BTreeMap<String, String>, opaque: &[String]) -> String {
    let resolve = |t: &str| {
        let mut t = t.to_string();
        while let Some(a) = aliases.get(&t) {
            t = a.clone();
        }
        t
    };
    if let Some(target) = t.strip_prefix("*mut").or_else(|| t.strip_prefix("*const")) {
        let target = resolve(target);
        return match target.as_str() {
            // A buffer: `void *` data, or a float array of the model (passed by address).
            "c_void" | "f32" => "c_void_p".into(),
            "c_char" => "c_char_p".into(),
            o if opaque.iter().any(|x| x == o) => "c_void_p".into(),
            _ => format!("*{}", ctypes_name(&target, aliases, opaque)),
        };
    }
    match resolve(t).as_str() {
        "c_int" | "i32" => "c_int".into(),
        "c_uint" | "u32" => "c_uint".into(),
        "usize" | "u64" | "c_ulong" => "c_ulong".into(),
        "i64" | "c_long" => "c_long".into(),
        "f64" | "c_double" => "c_double".into(),
        other => other.into(),
    }
}

/// The Python binding's hand-written ctypes declarations and code tables
/// (python/gradwire/__init__.py) against the header: every C call it declares, with the
/// header's parameter types; the dtype, op, collective and layout codes; the error classes
/// by code; the batch entry's fields.
#[test]
fn python_tables_match_the_header() {
    let header = header_bindings();
    let (declared, consts) = functions_and_constants(&header);
    let (mut aliases, mut opaque, mut structs) = (BTreeMap::new(), vec![], BTreeMap::new());
    for item in &header.items {
        match item {
            syn::Item::Type(t) => {
                aliases.insert(t.ident.to_string(), norm(&t.ty));
            }
            syn::Item::Struct(s) => {
                let fields: Vec<(String, String)> =
                    s.fields.iter().map(|f| (f.ident.as_ref().map(|i| i.to_string()).unwrap_or_default(), norm(&f.ty))).collect();
                if fields.iter().any(|(n, _)| n == "_unused") {
                    opaque.push(s.ident.to_string());
                } else {
                    structs.insert(s.ident.to_string(), fields);
                }
            }
            _ => {}
        }
    }
    let script = r#"
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
import gradwire as g
structs = {g._P2pOp: "gradwire_p2p_op_t", g._UniqueId: "gradwire_unique_id_t"}
def name(t):
    if t in structs:
        return structs[t]
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return "*" + name(t._type_)
    return t.__name__
sigs, gpu = g._signatures()
print(json.dumps({
    "sigs": {k: [name(a) for a in v] for k, v in {**sigs, **gpu}.items()},
    "codes": {"dtype": g._DTYPES, "op": g._OPS, "call": g._CALLS, "layout": g._LAYOUTS},
    "errors": {str(k): v.__name__ for k, v in g._ERRORS.items()},
    "p2p": [[n, name(t)] for n, t in g._P2pOp._fields_],
    "unique_id_bytes": ctypes.sizeof(g._UniqueId),
}))
"#;
    let pydir = concat!(env!("CARGO_MANIFEST_DIR"), "/python");
    let out = std::process::Command::new("python3").args(["-c", script, pydir]).output().expect("python3 runs");
    assert!(out.status.success(), "python3: {}", String::from_utf8_lossy(&out.stderr));
    let py: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    // Every call of the header, declared by the binding with the header's parameters.
    let sigs = py["sigs"].as_object().unwrap();
    for (fname, params) in sigs {
        let (cargs, cret) = declared.get(fname).unwrap_or_else(|| panic!("python declares {fname}, which gradwire.h does not"));
        let want: Vec<String> = cargs.iter().map(|a| ctypes_name(a, &aliases, &opaque)).collect();
        let have: Vec<String> = params.as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
        assert_eq!(have, want, "{fname}: python's argtypes differ from gradwire.h's parameters");
        assert_eq!(ctypes_name(cret, &aliases, &opaque), "c_int", "{fname}: python declares an int result");
    }
    // gradwire_last_error is declared apart (it returns the error text).
    for fname in declared.keys().filter(|f| *f != "gradwire_last_error") {
        assert!(sigs.contains_key(fname), "gradwire.h declares {fname}, which the python binding does not declare");
    }

    // The code tables: name -> code as the header's constant GRADWIRE_<PREFIX><NAME>.
    for (table, prefix) in [("dtype", ""), ("op", ""), ("call", "CALL_"), ("layout", "LAYOUT_")] {
        let codes = py["codes"][table].as_object().unwrap();
        let header_names: Vec<&String> = consts.keys().filter(|k| k.starts_with(&format!("GRADWIRE_{prefix}"))).collect();
        for (n, code) in codes {
            let c = format!("GRADWIRE_{prefix}{}", n.to_uppercase());
            assert_eq!(consts.get(&c), Some(&code.as_i64().unwrap()), "python's {table} {n} = {code}, gradwire.h's {c}");
        }
        if !prefix.is_empty() {
            assert_eq!(codes.len(), header_names.len(), "python's {table} table against gradwire.h's {header_names:?}");
        }
    }
    assert_eq!(py["codes"]["dtype"].as_object().unwrap().len(), gradwire::DType::ALL.len());
    assert_eq!(py["codes"]["op"].as_object().unwrap().len(), gradwire::ReduceOp::ALL.len());

    // Errors: each header code raises its own class, or the base class where none is named.
    let classes = [
        ("GRADWIRE_ERR_CONFIG", "ConfigError"),
        ("GRADWIRE_ERR_INVALID_ARGUMENT", "InvalidArgumentError"),
        ("GRADWIRE_ERR_TIMEOUT", "DeadlineError"),
        ("GRADWIRE_ERR_PEER_LOST", "PeerLostError"),
        ("GRADWIRE_ERR_MISMATCH", "MismatchError"),
        ("GRADWIRE_ERR_ABORTED", "AbortedError"),
        ("GRADWIRE_ERR_AUTH", "AuthError"),
        ("GRADWIRE_ERR_UNSUPPORTED", "UnsupportedError"),
        ("GRADWIRE_ERR_IN_PROGRESS", "InProgressError"),
    ];
    let errors = py["errors"].as_object().unwrap();
    for (c, code) in consts.iter().filter(|(k, _)| k.starts_with("GRADWIRE_ERR_")) {
        let want = classes.iter().find(|(n, _)| n == c).map(|(_, cls)| *cls);
        assert_eq!(errors.get(&code.to_string()).and_then(|v| v.as_str()), want, "{c} = {code}");
    }
    assert_eq!(errors.len(), classes.len());

    // The batch entry, field by field, and the unique id's size.
    let p2p: Vec<(String, String)> = structs["gradwire_p2p_op_t"].iter().map(|(n, t)| (n.clone(), ctypes_name(t, &aliases, &opaque))).collect();
    let py_p2p: Vec<(String, String)> = py["p2p"].as_array().unwrap().iter().map(|f| (f[0].as_str().unwrap().into(), f[1].as_str().unwrap().into())).collect();
    assert_eq!(py_p2p, p2p, "python's _P2pOp against gradwire_p2p_op_t");
    assert_eq!(py["unique_id_bytes"].as_i64(), Some(consts["GRADWIRE_UNIQUE_ID_BYTES"]));
}
