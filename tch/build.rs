//! Compiles the C++ shim (every `shim/*.cpp`) against the libtorch tch links, and links it.
//!
//! libtorch is found as torch-sys 0.24 finds it: `LIBTORCH` (or `/usr` when
//! `/usr/lib/libtorch.so` exists), with `LIBTORCH_INCLUDE` / `LIBTORCH_LIB` overriding the
//! include and lib prefixes and `LIBTORCH_CXX11_ABI` (default 1) the C++ ABI; with
//! `LIBTORCH_USE_PYTORCH` set, the installed Python's torch. The lib folder torch-sys settled on
//! (its `DEP_TCH_LIBTORCH_LIB`) must be the same one, or the build stops: a shim compiled
//! against another libtorch's headers would read its structures wrongly.
//!
//! The shim includes CUDA's runtime headers (through c10's CUDA headers). They are looked up
//! in `OOMGUARD_TCH_CUDA_INCLUDE`, beside a PyPI torch (`nvidia/cu*/include`,
//! `nvidia/cuda_runtime/include`), `CUDA_HOME` / `CUDA_PATH`, then `/usr/local/cuda/include`.
//! Against a libtorch without `libtorch_cuda`, or with `OOMGUARD_TCH_CUDA_INCLUDE=none`, the shim
//! is built without CUDA and every call says so at run time; a CUDA libtorch whose headers are
//! not found stops the build with a message naming the variable.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

/// The torch/ folder of the Python torch (`LIBTORCH_USE_PYTORCH`), and its C++ ABI.
fn python_torch() -> (PathBuf, String) {
    let python = if env::var_os("VIRTUAL_ENV").is_some() {
        "python"
    } else {
        "python3"
    };
    let out = Command::new(python)
        .args([
            "-c",
            "import os, torch; print(os.path.dirname(torch.__file__)); \
             print(int(torch._C._GLIBCXX_USE_CXX11_ABI))",
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!("oomguard-tch: LIBTORCH_USE_PYTORCH is set but {python} did not run: {e}")
        });
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    match (lines.next(), lines.next()) {
        (Some(dir), Some(abi)) if out.status.success() => (PathBuf::from(dir), abi.to_string()),
        _ => panic!(
            "oomguard-tch: LIBTORCH_USE_PYTORCH is set but `{python} -c 'import torch'` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

fn cuda_include(libtorch: &Path) -> Option<PathBuf> {
    if let Some(dir) = var("OOMGUARD_TCH_CUDA_INCLUDE") {
        if dir == "none" {
            return None;
        }
        let dir = PathBuf::from(dir);
        assert!(
            complete(&dir),
            "oomguard-tch: OOMGUARD_TCH_CUDA_INCLUDE={} lacks cuda_runtime_api.h or \
             crt/host_defines.h",
            dir.display()
        );
        return Some(dir);
    }
    let mut candidates = Vec::new();
    // A PyPI torch: CUDA's wheels sit beside torch/ (nvidia/cu13/include for CUDA 13,
    // nvidia/cuda_runtime/include for CUDA 12), of the very version torch was built with.
    if let Some(site) = libtorch.parent() {
        if let Ok(entries) = std::fs::read_dir(site.join("nvidia")) {
            let mut dirs: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path().join("include"))
                .collect();
            dirs.sort();
            candidates.extend(dirs);
        }
    }
    for v in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = var(v) {
            candidates.push(PathBuf::from(d).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.into_iter().find(|d| complete(d))
}

/// Whether `dir` holds the CUDA runtime headers the shim compiles with: PyPI's CUDA 13 runtime
/// wheel has cuda_runtime_api.h but not the crt/ it includes (scripts/libtorch.sh adds it).
fn complete(dir: &Path) -> bool {
    dir.join("cuda_runtime_api.h").exists() && dir.join("crt/host_defines.h").exists()
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=shim");

    let (libtorch, abi) = match var("LIBTORCH") {
        Some(dir) => (
            PathBuf::from(dir),
            var("LIBTORCH_CXX11_ABI").unwrap_or_else(|| "1".into()),
        ),
        None if var("LIBTORCH_USE_PYTORCH").is_some() => python_torch(),
        None if Path::new("/usr/lib/libtorch.so").exists() => (
            PathBuf::from("/usr"),
            var("LIBTORCH_CXX11_ABI").unwrap_or_else(|| "1".into()),
        ),
        None => panic!(
            "oomguard-tch: set LIBTORCH to the libtorch tch builds against (from the repository \
             root: eval \"$(scripts/libtorch.sh)\")"
        ),
    };
    let includes = var("LIBTORCH_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| libtorch.clone());
    let lib_dir = var("LIBTORCH_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| libtorch.clone())
        .join("lib");

    // torch-sys (`links = "tch"`) tells its direct dependents the lib folder it linked.
    if let Some(theirs) = var("DEP_TCH_LIBTORCH_LIB") {
        let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => a == b,
        };
        assert!(
            same(Path::new(&theirs), &lib_dir),
            "oomguard-tch: torch-sys links the libtorch in {theirs} but this build script \
             found {}: the shim must be built against the same libtorch",
            lib_dir.display()
        );
    }

    let mut shims: Vec<PathBuf> = std::fs::read_dir("shim")
        .expect("oomguard-tch: no shim/ folder")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    shims.sort();

    let has_cuda = lib_dir.join("libtorch_cuda.so").exists();
    let cuda_inc = if has_cuda {
        let found = cuda_include(&libtorch);
        if found.is_none() && var("OOMGUARD_TCH_CUDA_INCLUDE").as_deref() != Some("none") {
            panic!(
                "oomguard-tch: libtorch in {} has CUDA but CUDA's runtime headers \
                 (cuda_runtime_api.h and crt/host_defines.h) were not found: set OOMGUARD_TCH_CUDA_INCLUDE to their folder (the CUDA \
                 version libtorch was built with), or to `none` to build without reaching \
                 libtorch's CUDA allocator",
                lib_dir.display()
            );
        }
        found
    } else {
        None
    };

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(includes.join("include"))
        .include(includes.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .files(&shims);
    match &cuda_inc {
        Some(dir) => {
            build.include(dir);
        }
        None => {
            build.define("OOMGUARD_TCH_WITHOUT_CUDA", None);
        }
    }
    build.compile("oomguard_tch_shim");

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    if cuda_inc.is_some() {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        // libtorch's CUDA backend registers itself when libtorch_cuda.so is loaded; a binary
        // that calls nothing in it directly (a tch program using only `Device::Cuda`) loses it
        // to the linker's --as-needed, and `tch::Cuda::is_available()` is then false on a GPU.
        // This keeps it in this crate's own tests and examples; a user's binary needs the same
        // two lines in its build.rs (README, "With tch"), as tch's own README says.
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
    }
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!(
        "cargo:rustc-env=OOMGUARD_TCH_SHIM_CUDA={}",
        u8::from(cuda_inc.is_some())
    );
}
