//! What an image is made of (`ImageSpec`) and how its id is derived.
//!
//! The id names the image *before* it is built, so that a cached image can be reused
//! without downloading anything: it hashes the recipe (RECIPE_VERSION, which we bump
//! whenever the build steps change meaning), the exact .deb files apt resolved (by sha256),
//! the extra files and the trim rules. Same inputs -> same id -> reuse.

use sha2::{Digest, Sha256};

use super::apt::DebRef;
use super::wheels::{PipSource, WheelRef};
use super::BuildError;

/// Bump when the build procedure changes in a way that changes the resulting tree
/// (unpacking, usrmerge, alternatives, ldconfig, pyc flags, base dirs, format).
pub const RECIPE_VERSION: u32 = 2;

/// Packages every image gets: time zones (`/etc/localtime` is UTC), the CA bundle
/// (`/etc/ssl/certs/ca-certificates.crt`, built as `update-ca-certificates` would),
/// libc-bin, which ships the `C.UTF-8` locale the guest's `LANG` names, and netbase
/// (`/etc/services` and `/etc/protocols`: getservbyname, getaddrinfo with a service name).
pub const BASE_PACKAGES: &[&str] = &["tzdata", "ca-certificates", "libc-bin", "netbase"];

/// The userland every image gets, for `subprocess`, `os.system` and agents that shell
/// out: dash as `/bin/sh`, bash (E2B's SDKs run every command as `/bin/bash -l -c`)
/// and the common tools (`file` brings libmagic's database).
pub const USERLAND_PACKAGES: &[&str] =
    &["dash", "bash", "coreutils", "findutils", "grep", "sed", "gawk", "tar", "gzip", "file", "debianutils"];

/// Packages left out of every image unless asked for by name (see `ImageSpec::omit`):
/// build-time tools and what only maintainer scripts use. python3-pythran is scipy's
/// compile-time transpiler and pulls g++, boost and -dev packages (~500 MB unpacked);
/// debconf/perl/dpkg/usrmerge run maintainer scripts, which the image build never runs;
/// Tk and the JavaScript libraries are for GUIs and notebooks the guest has no use for.
pub const DEFAULT_OMIT: &[&str] = &[
    "python3-pythran",
    "debconf",
    "dpkg",
    "perl-base",
    "perl",
    "usrmerge",
    "python3-tk",
    "python3-pil.imagetk",
    "tk8.6-blt2.5",
    "blt",
    "libjs-jquery",
    "libjs-jquery-ui",
];

/// Which BLAS/LAPACK the image's numpy and scipy link to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Blas {
    /// Netlib's reference libblas3/liblapack3 (single-threaded, slow on big matrices):
    /// forced into the closure and chosen for the libblas.so.3/liblapack.so.3
    /// alternatives whatever else provides them.
    #[default]
    Reference,
    /// OpenBLAS (libopenblas0-pthread): fast, and safe in a guest without threads
    /// because the engine pins its thread count by environment
    /// (`OPENBLAS_NUM_THREADS=1`, `OMP_NUM_THREADS=1`), so it never starts one.
    OpenBlas,
    /// Whatever apt chooses; the alternatives go to the highest priority, as apt's
    /// update-alternatives would.
    Any,
}

impl Blas {
    pub fn name(self) -> &'static str {
        match self {
            Blas::Reference => "reference",
            Blas::OpenBlas => "openblas",
            Blas::Any => "any",
        }
    }

    pub fn parse(s: &str) -> Option<Blas> {
        match s {
            "reference" => Some(Blas::Reference),
            "openblas" => Some(Blas::OpenBlas),
            "any" => Some(Blas::Any),
            _ => None,
        }
    }

    /// Packages this choice adds to the request.
    pub fn packages(self) -> &'static [&'static str] {
        match self {
            Blas::Reference => &["libblas3", "liblapack3"],
            Blas::OpenBlas => &["libopenblas0-pthread"],
            Blas::Any => &[],
        }
    }

    /// Packages whose alternatives win over higher priorities.
    pub fn preferred(self) -> &'static [&'static str] {
        match self {
            Blas::Reference => &["libblas3", "liblapack3"],
            Blas::OpenBlas => &["libopenblas0-pthread"],
            Blas::Any => &[],
        }
    }
}

/// BLAS implementations other than the reference one (threaded or not).
pub const OTHER_BLAS: &[&str] = &[
    "libopenblas0",
    "libopenblas0-pthread",
    "libopenblas0-openmp",
    "libopenblas0-serial",
    "libopenblas-dev",
    "libopenblas-pthread-dev",
    "libopenblas-openmp-dev",
    "libopenblas-serial-dev",
    "libblis4",
    "libblis4-pthread",
    "libblis4-openmp",
    "libblis4-serial",
    "libatlas3-base",
];

/// Paths removed from the tree before packing (guest paths without the leading '/').
/// `*` matches within one component, `**` any number of components (including none).
/// A matching directory is removed with everything under it.
pub const TRIM_RULES: &[&str] = &[
    "usr/share/doc",
    "usr/share/doc-base",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bug",
    "usr/include",
    TEST_PACKAGE_RULE,
    "usr/lib/python3.*/idlelib",
    "usr/lib/python3.*/tkinter",
    "usr/lib/python3.*/ensurepip",
    "usr/lib/python3.*/lib2to3/tests",
    "usr/lib/python3/dist-packages/**/tests",
    "usr/lib/python3/dist-packages/**/*.pyx",
    "usr/lib/python3/dist-packages/**/*.pxd",
    "usr/lib/python3/dist-packages/**/*.pxi",
    "usr/lib/python3/dist-packages/**/*.c",
    "usr/lib/python3/dist-packages/**/*.cpp",
    "usr/lib/python3/dist-packages/**/*.h",
    "usr/lib/python3/dist-packages/numpy/core/include",
    "usr/share/zoneinfo/right",
    "usr/share/zoneinfo/posix",
    "usr/share/icons",
    "usr/share/javascript",
    "usr/share/pixmaps",
    "usr/share/applications",
    "**/*.a",
];

/// The trim rule that removes CPython's `test` package (kept by `ImageSpec::trim_rules`
/// when the test suite is asked for).
const TEST_PACKAGE_RULE: &str = "usr/lib/python3.*/test";

/// Debian's package of CPython's regression tests.
pub const CPYTHON_TESTSUITE: &str = "libpython3.11-testsuite";

/// One file added to the image after the packages are unpacked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtraFile {
    /// Absolute guest path, e.g. "/etc/passwd". Parent directories are created (0755).
    pub guest_path: String,
    pub data: Vec<u8>,
    /// Permission bits, e.g. 0o644.
    pub perm: u32,
}

/// What goes into an image: Debian packages (plus their dependency closure) and files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageSpec {
    pub packages: Vec<String>,
    pub extra_files: Vec<ExtraFile>,
    /// Packages left out even if something depends on them (apt sees them as installed).
    /// `DEFAULT_OMIT` is added unless a name is in `packages`.
    pub omit: Vec<String>,
    pub blas: Blas,
    /// pip requirement specs, installed as binary wheels (see `build::wheels`).
    pub pip: Vec<String>,
    /// Where pip looks for them.
    pub pip_source: PipSource,
}

impl ImageSpec {
    /// The default guest: Debian's python3 and numpy (reference BLAS/LAPACK), plus a
    /// minimal passwd/group so `pwd`, `getpass` and `~` expansion work for root.
    pub fn python_numpy() -> Self {
        ImageSpec {
            packages: ["python3", "python3-numpy"].iter().chain(USERLAND_PACKAGES).map(|p| p.to_string()).collect(),
            omit: Vec::new(),
            blas: Blas::Reference,
            pip: Vec::new(),
            pip_source: PipSource::default(),
            extra_files: vec![
                ExtraFile {
                    guest_path: "/etc/passwd".into(),
                    data:
                        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
                            .to_vec(),
                    perm: 0o644,
                },
                ExtraFile {
                    guest_path: "/etc/group".into(),
                    data: b"root:x:0:\nnogroup:x:65534:\n".to_vec(),
                    perm: 0o644,
                },
            ],
        }
    }

    /// The data-analysis guest: python_numpy plus pandas, scipy, matplotlib (Agg),
    /// Pillow, scikit-learn, statsmodels, seaborn, sympy, networkx, requests,
    /// beautifulsoup4, lxml, openpyxl, PyYAML, tqdm and tabulate, on OpenBLAS.
    pub fn data() -> Self {
        let mut s = ImageSpec::python_numpy();
        s.packages.extend(DATA_PACKAGES.iter().map(|p| p.to_string()));
        s.blas = Blas::OpenBlas;
        s
    }

    /// Python 3.11 and CPython's own regression tests (Debian's `libpython3.11-testsuite`,
    /// the `test` package), to measure compatibility with real programs.
    pub fn cpython_tests() -> Self {
        let mut s = ImageSpec::python_numpy();
        s.packages = vec!["python3".into(), CPYTHON_TESTSUITE.into()];
        s.packages.extend(USERLAND_PACKAGES.iter().map(|p| p.to_string()));
        s.blas = Blas::Any; // no numpy: no BLAS at all
        s
    }

    /// The trim rules for this spec: `TRIM_RULES`, except that a spec asking for
    /// CPython's test suite by name keeps `usr/lib/python3.*/test`.
    pub fn trim_rules(&self) -> Vec<&'static str> {
        let keep_tests = self.packages.iter().any(|p| p.starts_with("libpython3") && p.ends_with("-testsuite"));
        TRIM_RULES.iter().copied().filter(|r| !(keep_tests && *r == TEST_PACKAGE_RULE)).collect()
    }

    /// What apt is asked for: the packages, the base packages and the BLAS choice's.
    pub fn requested(&self) -> Vec<String> {
        let mut v: Vec<String> = self.packages.clone();
        for p in BASE_PACKAGES.iter().chain(self.blas.packages()) {
            if !v.iter().any(|q| q == p) {
                v.push(p.to_string());
            }
        }
        v
    }

    /// What apt is told is already there: `omit` plus `DEFAULT_OMIT`, minus anything
    /// requested by name; with reference BLAS, every other BLAS too.
    pub fn omitted(&self) -> Vec<String> {
        let req = self.requested();
        let mut v: Vec<String> = Vec::new();
        let other: &[&str] = if self.blas == Blas::Reference { OTHER_BLAS } else { &[] };
        for p in self.omit.iter().map(String::as_str).chain(DEFAULT_OMIT.iter().copied()).chain(other.iter().copied()) {
            if !req.iter().any(|q| q == p) && !v.iter().any(|q| q == p) {
                v.push(p.to_string());
            }
        }
        v.sort();
        v
    }

    /// Reject specs that could not be built or that would escape the tree.
    pub(crate) fn validate(&self) -> Result<(), BuildError> {
        let bad = |msg: String| Err(BuildError::Invalid { step: "spec", msg });
        if self.packages.is_empty() {
            return bad("no packages".into());
        }
        for p in self.packages.iter().chain(&self.omit) {
            // Debian package names (optionally with =version or :arch), never options.
            let ok = !p.is_empty()
                && !p.starts_with('-')
                && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"+-.:=~_".contains(&b));
            if !ok {
                return bad(format!("invalid package name {p:?}"));
            }
        }
        for f in &self.extra_files {
            let p = &f.guest_path;
            let ok = p.starts_with('/')
                && p.len() > 1
                && !p.ends_with('/')
                && !p.contains('\0')
                && p.split('/').skip(1).all(|c| !c.is_empty() && c != "." && c != "..");
            if !ok {
                return bad(format!("extra file path {p:?} must be absolute and normalized"));
            }
            if f.perm & !0o7777 != 0 {
                return bad(format!("extra file {p}: bad permission bits {:#o}", f.perm));
            }
        }
        if self.pip.len() > super::wheels::MAX_SPECS {
            return bad(format!("at most {} pip specs", super::wheels::MAX_SPECS));
        }
        for s in &self.pip {
            super::wheels::validate_spec(s).map_err(|msg| BuildError::Invalid { step: "spec", msg })?;
        }
        self.pip_source.validate().map_err(|msg| BuildError::Invalid { step: "spec", msg })?;
        Ok(())
    }
}

/// The Debian packages of `ImageSpec::data()` beyond python3 + numpy.
pub const DATA_PACKAGES: &[&str] = &[
    "python3-pandas",
    "python3-scipy",
    "python3-matplotlib",
    "fonts-dejavu-core",
    "python3-pil",
    "python3-sklearn",
    "python3-statsmodels",
    "python3-seaborn",
    "python3-sympy",
    "python3-networkx",
    "python3-requests",
    "python3-bs4",
    "python3-lxml",
    "python3-openpyxl",
    "python3-yaml",
    "python3-tqdm",
    "python3-tabulate",
];

/// Feed one length-prefixed field into the hash, so that field boundaries are unambiguous.
fn field(h: &mut Sha256, tag: &str, value: &[u8]) {
    h.update((tag.len() as u64).to_le_bytes());
    h.update(tag.as_bytes());
    h.update((value.len() as u64).to_le_bytes());
    h.update(value);
}

/// The image id (hex sha256) for a spec and its resolved packages. Independent of the
/// order apt printed the packages in and of the order of `spec.packages`.
pub fn recipe_id(spec: &ImageSpec, debs: &[DebRef]) -> String {
    recipe_id_with_wheels(spec, debs, &[])
}

/// [`recipe_id`] of an image that also has `wheels` unpacked (by content hash; an
/// image without pip packages has the same id as before they existed).
pub fn recipe_id_with_wheels(spec: &ImageSpec, debs: &[DebRef], wheels: &[WheelRef]) -> String {
    let mut h = Sha256::new();
    field(&mut h, "forkbox-image-recipe", &RECIPE_VERSION.to_le_bytes());
    field(&mut h, "format", &crate::format::VERSION.to_le_bytes());
    let mut pkgs: Vec<&str> = spec.packages.iter().map(String::as_str).collect();
    pkgs.sort_unstable();
    pkgs.dedup();
    for p in pkgs {
        field(&mut h, "package", p.as_bytes());
    }
    for p in spec.omitted() {
        field(&mut h, "omit", p.as_bytes());
    }
    field(&mut h, "blas", spec.blas.name().as_bytes());
    let mut debs: Vec<&DebRef> = debs.iter().collect();
    debs.sort_by(|a, b| a.filename.cmp(&b.filename));
    for d in debs {
        field(&mut h, "deb", d.filename.as_bytes());
        field(&mut h, "sha256", d.sha256.as_bytes());
    }
    for r in spec.trim_rules() {
        field(&mut h, "trim", r.as_bytes());
    }
    // Extra files are applied in order (a later one may overwrite an earlier one).
    for f in &spec.extra_files {
        field(&mut h, "extra", f.guest_path.as_bytes());
        field(&mut h, "perm", &f.perm.to_le_bytes());
        field(&mut h, "data", &f.data);
    }
    if !wheels.is_empty() {
        field(&mut h, "wheel-site", super::wheels::SITE_PACKAGES.as_bytes());
        let mut ws: Vec<&WheelRef> = wheels.iter().collect();
        ws.sort_by(|a, b| a.filename.cmp(&b.filename));
        for w in ws {
            field(&mut h, "wheel", w.filename.as_bytes());
            field(&mut h, "wheel-sha256", w.sha256.as_bytes());
        }
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deb(name: &str, sha: char) -> DebRef {
        DebRef {
            uri: format!("http://x/{name}"),
            filename: name.into(),
            package: name.split('_').next().unwrap_or_default().into(),
            size: 1,
            sha256: sha.to_string().repeat(64),
        }
    }

    #[test]
    fn id_is_stable_and_sensitive() {
        let spec = ImageSpec::python_numpy();
        let debs = vec![deb("a_1_amd64.deb", 'a'), deb("b_1_amd64.deb", 'b')];
        let id = recipe_id(&spec, &debs);
        assert_eq!(id.len(), 64);
        // order of apt's output and of the package list does not matter
        let rev: Vec<DebRef> = debs.iter().rev().cloned().collect();
        assert_eq!(recipe_id(&spec, &rev), id);
        let mut spec2 = spec.clone();
        spec2.packages.reverse();
        assert_eq!(recipe_id(&spec2, &debs), id);

        // any input change changes the id
        let mut d2 = debs.clone();
        d2[1].sha256 = "c".repeat(64);
        assert_ne!(recipe_id(&spec, &d2), id);
        let mut d3 = debs.clone();
        d3[1].filename = "b_2_amd64.deb".into();
        assert_ne!(recipe_id(&spec, &d3), id);
        assert_ne!(recipe_id(&spec, &debs[..1]), id);
        let mut s3 = spec.clone();
        s3.extra_files[0].perm = 0o600;
        assert_ne!(recipe_id(&s3, &debs), id);
        let mut s4 = spec.clone();
        s4.extra_files[0].data.push(b'\n');
        assert_ne!(recipe_id(&s4, &debs), id);
        let mut s5 = spec.clone();
        s5.packages.push("python3-scipy".into());
        assert_ne!(recipe_id(&s5, &debs), id);
        let mut s7 = spec.clone();
        s7.blas = Blas::OpenBlas;
        assert_ne!(recipe_id(&s7, &debs), id);
        let mut s8 = spec.clone();
        s8.omit.push("libfoo".into());
        assert_ne!(recipe_id(&s8, &debs), id);
        // field boundaries are unambiguous
        let mut s6 = spec.clone();
        s6.extra_files[0].guest_path = "/etc/passw".into();
        s6.extra_files[0].data.insert(0, b'd');
        assert_ne!(recipe_id(&s6, &debs), id);
        // wheels count by content; none keeps the id of an image without pip
        let w = WheelRef { filename: "x-1-py3-none-any.whl".into(), sha256: "d".repeat(64), size: 1 };
        assert_eq!(recipe_id_with_wheels(&spec, &debs, &[]), id);
        let with = recipe_id_with_wheels(&spec, &debs, std::slice::from_ref(&w));
        assert_ne!(with, id);
        let w2 = WheelRef { sha256: "e".repeat(64), ..w };
        assert_ne!(recipe_id_with_wheels(&spec, &debs, &[w2]), with);
    }

    #[test]
    fn test_suite_keeps_the_test_package() {
        let plain = ImageSpec::python_numpy();
        assert_eq!(plain.trim_rules(), TRIM_RULES.to_vec());
        let t = ImageSpec::cpython_tests();
        let rules = t.trim_rules();
        assert!(!rules.contains(&"usr/lib/python3.*/test"), "{rules:?}");
        assert_eq!(rules.len() + 1, TRIM_RULES.len());
        assert!(t.requested().iter().any(|p| p == CPYTHON_TESTSUITE));
    }

    #[test]
    fn requested_and_omitted() {
        let s = ImageSpec::python_numpy();
        let r = s.requested();
        for p in
            ["python3", "python3-numpy", "tzdata", "ca-certificates", "libc-bin", "netbase", "libblas3", "liblapack3"]
        {
            assert!(r.iter().any(|q| q == p), "{p} in {r:?}");
        }
        let o = s.omitted();
        assert!(o.iter().any(|q| q == "python3-pythran") && o.iter().any(|q| q == "libopenblas0-pthread"), "{o:?}");
        let d = ImageSpec::data();
        assert!(d.requested().iter().any(|q| q == "libopenblas0-pthread"));
        assert!(!d.omitted().iter().any(|q| q.starts_with("libopenblas")), "{:?}", d.omitted());
        // asking for an omitted package by name keeps it
        let mut p = ImageSpec::python_numpy();
        p.packages.push("perl".into());
        assert!(!p.omitted().iter().any(|q| q == "perl"));
        assert_eq!(Blas::parse("openblas"), Some(Blas::OpenBlas));
        assert_eq!(Blas::parse(Blas::Any.name()), Some(Blas::Any));
        assert_eq!(Blas::parse("mkl"), None);
    }

    #[test]
    fn spec_validation() {
        assert!(ImageSpec::python_numpy().validate().is_ok());
        let mut s = ImageSpec::python_numpy();
        s.packages.push("-o=Dir::Etc=/x".into());
        assert!(s.validate().is_err());
        for p in ["etc/x", "/", "/etc/../x", "/etc//x", "/etc/x/"] {
            let mut s = ImageSpec::python_numpy();
            s.extra_files[0].guest_path = p.into();
            assert!(s.validate().is_err(), "{p}");
        }
    }
}
