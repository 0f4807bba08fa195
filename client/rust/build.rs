// Compiles abi/sf_ring.c (the primitives every language shares) and
// layout_check.c (the layout abi.rs was generated for, as C static asserts
// against the real header): a header change abi.rs missed fails here.
use std::{env, path::PathBuf, process::Command};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let abi = manifest.join("../../abi");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let cc = env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut objs = Vec::new();
    for src in [abi.join("sf_ring.c"), manifest.join("layout_check.c")] {
        let obj = out.join(src.file_stem().unwrap()).with_extension("o");
        let ok = Command::new(&cc)
            .args(["-std=c11", "-O2", "-fPIC", "-Wall", "-Werror", "-c", "-I"])
            .arg(&abi)
            .arg(&src)
            .arg("-o")
            .arg(&obj)
            .status()
            .expect("superfluid: a C compiler (cc, or $CC) is needed to build sf_ring.c")
            .success();
        assert!(ok, "superfluid: {} did not compile; if the layout asserts failed, abi.rs is older than \
                     abi/superfluid.h: run `python -m superfluid.abi.gen_bindings`", src.display());
        objs.push(obj);
    }
    let lib = out.join("libsuperfluid_ring.a");
    let _ = std::fs::remove_file(&lib);
    assert!(Command::new("ar").arg("crs").arg(&lib).args(&objs).status().expect("ar").success());
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=superfluid_ring");
    for f in ["sf_ring.c", "superfluid.h"] {
        println!("cargo:rerun-if-changed={}", abi.join(f).display());
    }
    println!("cargo:rerun-if-changed=layout_check.c");
}
