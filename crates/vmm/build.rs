//! Build script of forkbox-vmm: compiles the guest vDSO (guest/vdso) with the
//! system C compiler into `$OUT_DIR/vdso.so`, which `src/vdso.rs` embeds.
//!
//! The compiler is `$FORKBOX_VDSO_CC` if set, else `cc`. It must target
//! x86_64 Linux (gcc or clang). A missing compiler is a build error with a
//! message saying what to install.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Upper bound on the image: it is copied to 0x1F1000..0x1F4000 in the guest.
/// Keep in sync with `VDSO_MAX_LEN` in src/vdso.rs and guest/vdso/vvar.h.
const VDSO_MAX_LEN: u64 = 3 * 4096;

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let src_dir = manifest_dir.join("../../guest/vdso");
    let src_dir = src_dir
        .canonicalize()
        .unwrap_or_else(|e| panic!("forkbox-vmm build: vDSO sources not found at {}: {e}", src_dir.display()));

    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    if target_arch != "x86_64" {
        panic!("forkbox-vmm build: the guest vDSO is x86_64-only (target arch is {target_arch:?})");
    }

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=FORKBOX_VDSO_CC");
    println!("cargo:rerun-if-changed={}", src_dir.display());

    let mut c_files = Vec::new();
    let entries = std::fs::read_dir(&src_dir)
        .unwrap_or_else(|e| panic!("forkbox-vmm build: cannot list {}: {e}", src_dir.display()));
    for entry in entries {
        let path = entry.expect("read_dir entry").path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("c") => {
                println!("cargo:rerun-if-changed={}", path.display());
                c_files.push(path);
            }
            Some("h") | Some("lds") => println!("cargo:rerun-if-changed={}", path.display()),
            _ => {}
        }
    }
    c_files.sort(); // deterministic link order
    if c_files.is_empty() {
        panic!("forkbox-vmm build: no .c files in {}", src_dir.display());
    }
    let lds = src_dir.join("vdso.lds");
    if !lds.is_file() {
        panic!("forkbox-vmm build: missing linker script {}", lds.display());
    }

    let out = out_dir.join("vdso.so");
    build_vdso(&c_files, &lds, &src_dir, &out);
    check_image(&out);
}

fn build_vdso(c_files: &[PathBuf], lds: &Path, include_dir: &Path, out: &Path) {
    let cc = env::var("FORKBOX_VDSO_CC").unwrap_or_else(|_| "cc".to_string());
    let mut cmd = Command::new(&cc);
    cmd.args([
        // Code generation: position independent, freestanding, no runtime
        // dependencies (no libc, libgcc, stack protector, CET notes, SSE).
        "-m64",
        "-std=gnu11",
        "-O2",
        "-fPIC",
        "-ffreestanding",
        "-fno-builtin",
        "-fno-stack-protector",
        "-fno-stack-clash-protection",
        "-fcf-protection=none",
        "-fno-plt",
        "-fvisibility=hidden",
        "-mgeneral-regs-only",
        "-mcmodel=small",
        "-Wall",
        "-Wextra",
        "-Werror",
        // Link: a shared object laid out by vdso.lds (one R+X PT_LOAD that
        // holds .dynamic), both hash styles, versioned symbols, no undefined
        // references, no symbol table beyond .dynsym.
        "-nostdlib",
        "-shared",
        "-Wl,--hash-style=both",
        "-Wl,-soname=linux-vdso.so.1",
        "-Wl,-Bsymbolic",
        "-Wl,--no-undefined",
        "-Wl,--eh-frame-hdr",
        "-Wl,--build-id=sha1",
        "-Wl,-z,max-page-size=4096",
        "-Wl,-z,noexecstack",
        "-Wl,--strip-all",
    ]);
    cmd.arg("-I").arg(include_dir);
    cmd.arg(format!("-Wl,-T,{}", lds.display()));
    cmd.arg("-o").arg(out);
    cmd.args(c_files);

    let status = match cmd.status() {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "forkbox-vmm build: C compiler `{cc}` not found; it is needed to build the guest vDSO \
             (guest/vdso). Install gcc (Debian: apt-get install gcc) or set FORKBOX_VDSO_CC."
        ),
        Err(e) => panic!("forkbox-vmm build: cannot run C compiler `{cc}`: {e}"),
    };
    if !status.success() {
        panic!("forkbox-vmm build: building the guest vDSO failed ({status}); command: {cmd:?}");
    }
}

fn check_image(out: &Path) {
    let bytes = std::fs::read(out).unwrap_or_else(|e| panic!("forkbox-vmm build: reading {}: {e}", out.display()));
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        panic!("forkbox-vmm build: {} is not an ELF64 file", out.display());
    }
    if bytes.len() as u64 > VDSO_MAX_LEN {
        panic!(
            "forkbox-vmm build: vDSO image is {} bytes, more than the {} bytes reserved for it in the guest",
            bytes.len(),
            VDSO_MAX_LEN
        );
    }
}
