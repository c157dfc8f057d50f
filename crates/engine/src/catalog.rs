//! Named templates: the shipped recipes (`python`, `data`), built on first use,
//! and every template of a data directory by id, so that one process serves many
//! templates at once and a session stays on the template it was created from
//! whatever the default becomes.
//!
//! A template is named by a recipe (image packages + preload); its *id* is the hash
//! of what determines its content (`template::template_id`). Sessions record the id;
//! `Catalog::by_id` opens any template that is on disk (its image named by the
//! template's state file), whether or not a recipe names it now.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use forkbox_api::ErrorCode;
use forkbox_image::{BuildError, BuildOptions, ImageSpec};
use forkbox_vmm::Cpu;
use serde::Serialize;

use crate::error::EngineError;
use crate::template::{templates_dir, Template, TemplateInfo};
use crate::Engine;

/// The template a server and the CLI use unless told otherwise.
pub const DEFAULT_TEMPLATE: &str = "python";

/// The `data` template's preload: the data stack imported and warmed (a figure drawn
/// to PNG once, so the first plot of a fork does not pay for font and Agg setup).
/// matplotlib builds its font cache behind a `threading.Timer` (a warning after 5 s):
/// the guest has no threads, so a no-op Timer stands in while pyplot is imported.
pub const DATA_PRELOAD: &str = "\
import numpy, pandas, scipy, scipy.optimize, scipy.stats, matplotlib
import threading as _threading
class _NoTimer:
    def __init__(self, *a, **k): pass
    def start(self): pass
    def cancel(self): pass
_Timer, _threading.Timer = _threading.Timer, _NoTimer
try:
    import matplotlib.pyplot
finally:
    _threading.Timer = _Timer
del _threading, _Timer, _NoTimer
import io as _io
_f = matplotlib.pyplot.figure()
_f.gca().plot([0, 1], [0, 1])
_f.savefig(_io.BytesIO(), format='png')
matplotlib.pyplot.close(_f)
del _f, _io";

/// How to make a named template.
#[derive(Clone, Debug)]
pub struct Recipe {
    pub name: String,
    pub description: String,
    /// The image, agent included.
    pub spec: ImageSpec,
    pub preload: String,
}

/// The templates forkbox ships.
pub fn builtin_recipes() -> Vec<Recipe> {
    vec![
        Recipe {
            name: "python".into(),
            description: "Python 3.11 + numpy (reference BLAS)".into(),
            spec: crate::default_image_spec(),
            preload: "import numpy".into(),
        },
        Recipe {
            name: "data".into(),
            description: "Python 3.11 + numpy, pandas, scipy, matplotlib (Agg), Pillow, scikit-learn, statsmodels, seaborn, \
                          sympy, networkx, requests, beautifulsoup4, lxml, openpyxl, PyYAML, tqdm, tabulate (OpenBLAS, one thread); \
                          pandas, matplotlib.pyplot and scipy preloaded"
                .into(),
            spec: crate::with_agent(ImageSpec::data()),
            preload: DATA_PRELOAD.into(),
        },
        Recipe {
            name: "cpython-tests".into(),
            description: "Python 3.11 + CPython's regression tests (Debian's libpython3.11-testsuite, the `test` package), \
                          for scripts/cpython-tests; unittest and test.support preloaded"
                .into(),
            spec: crate::with_agent(ImageSpec::cpython_tests()),
            preload: "import unittest, test.support, test.support.os_helper".into(),
        },
    ]
}

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("no template named {0:?}")]
    UnknownTemplate(String),
    #[error("template {0} is not in this data directory")]
    NotOnDisk(String),
    #[error("template {name} is being built (started {secs} s ago); retry when GET /v1/templates says ready")]
    Building { name: String, secs: u64 },
    #[error("building the image of template {name}: {source}")]
    Build { name: String, source: BuildError },
    #[error("template {name}: {source}")]
    Engine { name: String, source: EngineError },
}

impl CatalogError {
    /// The API error code.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            CatalogError::UnknownTemplate(_) | CatalogError::NotOnDisk(_) => ErrorCode::TemplateNotFound,
            CatalogError::Building { .. } => ErrorCode::TemplateNotReady,
            CatalogError::Build { .. } | CatalogError::Engine { .. } => ErrorCode::TemplateUnavailable,
        }
    }

    pub fn code(&self) -> &'static str {
        self.error_code().as_str()
    }
}

/// A template ready to fork, with the engine of its image.
pub struct Loaded {
    pub engine: Arc<Engine>,
    pub template: Arc<Template>,
    /// The recipe name it was opened under (None: opened by id only).
    pub name: Option<String>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("id", &self.id()).field("name", &self.name).finish()
    }
}

impl Loaded {
    pub fn id(&self) -> &str {
        &self.template.info.id
    }
}

/// What `GET /v1/templates` lists.
#[derive(Clone, Debug, Serialize)]
pub struct Listing {
    pub name: String,
    pub description: String,
    /// `ready` (built and open), `available` (built on first use), `building`, `failed`.
    pub status: String,
    /// The template id, once built.
    pub id: Option<String>,
    pub default: bool,
    /// Debian packages asked for (their dependencies come along).
    pub packages: Vec<String>,
    pub preload: String,
    /// Image file size, once built.
    pub image_bytes: Option<u64>,
    /// The build error, when `failed`.
    pub error: Option<String>,
}

#[derive(Clone)]
enum BuildState {
    Building(Instant),
    Failed(String),
}

/// Named recipes plus every template opened so far, by id. Cheap to share (`Arc`).
pub struct Catalog {
    home: PathBuf,
    cpu: Arc<Cpu>,
    recipes: BTreeMap<String, Recipe>,
    default: Mutex<String>,
    progress: bool,
    by_id: Mutex<HashMap<String, Arc<Loaded>>>,
    by_name: Mutex<HashMap<String, Arc<Loaded>>>,
    builds: Mutex<HashMap<String, BuildState>>,
    /// One build at a time (apt, dpkg-deb and a template boot each use the whole machine).
    build_lock: Mutex<()>,
}

impl Catalog {
    /// The shipped recipes over `home`; nothing is built or opened yet.
    pub fn new(home: &Path) -> Result<Catalog, EngineError> {
        Catalog::with_recipes(home, builtin_recipes())
    }

    pub fn with_recipes(home: &Path, recipes: Vec<Recipe>) -> Result<Catalog, EngineError> {
        Ok(Catalog {
            home: home.to_path_buf(),
            cpu: Arc::new(Cpu::new()?),
            recipes: recipes.into_iter().map(|r| (r.name.clone(), r)).collect(),
            default: Mutex::new(DEFAULT_TEMPLATE.into()),
            progress: false,
            by_id: Mutex::new(HashMap::new()),
            by_name: Mutex::new(HashMap::new()),
            builds: Mutex::new(HashMap::new()),
            build_lock: Mutex::new(()),
        })
    }

    /// Show progress bars on stderr while building (a terminal's CLI or `serve`).
    pub fn with_progress(mut self, on: bool) -> Catalog {
        self.progress = on;
        self
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    pub fn default_name(&self) -> String {
        self.default.lock().map(|d| d.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Set the default template (it must be a known name).
    pub fn set_default(&self, name: &str) -> Result<(), CatalogError> {
        if !self.recipes.contains_key(name) && !self.by_name.lock().is_ok_and(|m| m.contains_key(name)) {
            return Err(CatalogError::UnknownTemplate(name.into()));
        }
        if let Ok(mut d) = self.default.lock() {
            *d = name.to_string();
        }
        Ok(())
    }

    pub fn recipe(&self, name: &str) -> Option<&Recipe> {
        self.recipes.get(name)
    }

    /// Register an already open template under a name (`serve --image FILE`, tests).
    pub fn insert(&self, name: &str, engine: Arc<Engine>, template: Arc<Template>) -> Arc<Loaded> {
        let loaded = Arc::new(Loaded { engine, template, name: Some(name.to_string()) });
        if let Ok(mut m) = self.by_id.lock() {
            m.insert(loaded.id().to_string(), loaded.clone());
        }
        if let Ok(mut m) = self.by_name.lock() {
            m.insert(name.to_string(), loaded.clone());
        }
        loaded
    }

    /// The named template if it is open already (never builds).
    pub fn ready(&self, name: &str) -> Option<Arc<Loaded>> {
        self.by_name.lock().ok().and_then(|m| m.get(name).cloned())
    }

    /// The named template (None: the default), built now if needed (blocking: minutes
    /// for a cold `data`, ~1 s when its image and template are on disk).
    pub fn get(&self, name: Option<&str>) -> Result<Arc<Loaded>, CatalogError> {
        let name = name.map_or_else(|| self.default_name(), str::to_string);
        if let Some(l) = self.ready(&name) {
            return Ok(l);
        }
        let recipe = self.recipes.get(&name).ok_or_else(|| CatalogError::UnknownTemplate(name.clone()))?.clone();
        let _one = self.build_lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = self.ready(&name) {
            return Ok(l);
        }
        self.set_build(&name, Some(BuildState::Building(Instant::now())));
        let r = self.open_recipe(&recipe);
        match &r {
            Ok(_) => self.set_build(&name, None),
            Err(e) => self.set_build(&name, Some(BuildState::Failed(e.to_string()))),
        }
        r
    }

    /// The named template if it is open, else start building it on a background thread
    /// and say so (`template_not_ready`): for request handlers, which must not wait minutes.
    pub fn get_or_start(self: &Arc<Self>, name: Option<&str>) -> Result<Arc<Loaded>, CatalogError> {
        let name = name.map_or_else(|| self.default_name(), str::to_string);
        if let Some(l) = self.ready(&name) {
            return Ok(l);
        }
        if !self.recipes.contains_key(&name) {
            return Err(CatalogError::UnknownTemplate(name));
        }
        let state = self.builds.lock().ok().and_then(|m| m.get(&name).cloned());
        match state {
            Some(BuildState::Building(t)) => {
                return Err(CatalogError::Building { name, secs: t.elapsed().as_secs() });
            }
            // A failed build is tried again by the next request that needs it.
            Some(BuildState::Failed(_)) | None => {}
        }
        // A template already on disk opens in about a second: do it inline.
        if self.on_disk(&name) {
            return self.get(Some(&name));
        }
        self.set_build(&name, Some(BuildState::Building(Instant::now())));
        let me = self.clone();
        let n = name.clone();
        // Never under an exec thread's seccomp filter: a build runs apt-get, dpkg, ldconfig.
        let spawned = crate::jail::spawn_unjailed(format!("build-{name}"), move || {
            match me.get(Some(&n)) {
                Ok(l) => tracing::info!(template = %n, id = %l.id(), "template built"),
                Err(e) => tracing::warn!(template = %n, "template build failed: {e}"),
            }
        });
        if let Err(e) = spawned {
            self.set_build(&name, Some(BuildState::Failed(e.to_string())));
        }
        Err(CatalogError::Building { name, secs: 0 })
    }

    /// True if the named recipe's image and template are both on disk (nothing to download).
    fn on_disk(&self, name: &str) -> bool {
        let Some(r) = self.recipes.get(name) else { return false };
        let Ok(Some(image_id)) = forkbox_image::built_id(&r.spec, &self.home) else { return false };
        let tid = crate::template::template_id(&image_id, &r.preload, &forkbox_snapshot::CpuFingerprint::of(&self.cpu).digest());
        templates_dir(&self.home).join(tid).join("state").exists()
    }

    fn set_build(&self, name: &str, st: Option<BuildState>) {
        if let Ok(mut m) = self.builds.lock() {
            match st {
                Some(s) => {
                    m.insert(name.to_string(), s);
                }
                None => {
                    m.remove(name);
                }
            }
        }
    }

    fn open_recipe(&self, recipe: &Recipe) -> Result<Arc<Loaded>, CatalogError> {
        let name = recipe.name.clone();
        let t0 = Instant::now();
        let built = forkbox_image::build(&recipe.spec, &BuildOptions { home: self.home.clone(), progress: self.progress })
            .map_err(|source| CatalogError::Build { name: name.clone(), source })?;
        let engine = Engine::open_with_cpu(self.cpu.clone(), &built.path)
            .map_err(|source| CatalogError::Engine { name: name.clone(), source })?
            .with_preload(recipe.preload.clone());
        let tid = crate::template::template_id(engine.image.id(), &engine.preload, &forkbox_snapshot::CpuFingerprint::of(&engine.cpu).digest());
        let existing = self.by_id.lock().ok().and_then(|m| m.get(&tid).cloned());
        let loaded = match existing {
            Some(l) => Arc::new(Loaded { engine: l.engine.clone(), template: l.template.clone(), name: Some(name.clone()) }),
            None => {
                if self.progress && !templates_dir(&self.home).join(&tid).join("state").exists() {
                    eprintln!("forkbox: booting template {name} and snapshotting it ...");
                }
                let template = Template::ensure(&engine, &self.home)
                .map_err(|source| CatalogError::Engine { name: name.clone(), source })?;
                Arc::new(Loaded { engine: Arc::new(engine), template: Arc::new(template), name: Some(name.clone()) })
            }
        };
        if let Ok(mut m) = self.by_id.lock() {
            m.entry(loaded.id().to_string()).or_insert_with(|| loaded.clone());
        }
        if let Ok(mut m) = self.by_name.lock() {
            m.insert(name.clone(), loaded.clone());
        }
        tracing::info!(template = %name, id = %loaded.id(), image_reused = built.reused, elapsed = ?t0.elapsed(), "template ready");
        Ok(loaded)
    }

    /// A template by id (what a session records): open already, or opened from
    /// `<home>/templates/<id>` with the image its state file names.
    pub fn by_id(&self, id: &str) -> Result<Arc<Loaded>, CatalogError> {
        if let Some(l) = self.by_id.lock().ok().and_then(|m| m.get(id).cloned()) {
            return Ok(l);
        }
        // Ids are hex; never let one name a path outside the templates directory.
        if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CatalogError::NotOnDisk(id.into()));
        }
        let dir = templates_dir(&self.home).join(id);
        let info: TemplateInfo = crate::template::read_info(&dir).map_err(|_| CatalogError::NotOnDisk(id.into()))?;
        let image = forkbox_image::image_path(&self.home, &info.image_id);
        if !image.exists() {
            return Err(CatalogError::NotOnDisk(id.into()));
        }
        let engine = Engine::open_with_cpu(self.cpu.clone(), &image)
            .map_err(|source| CatalogError::Engine { name: id.into(), source })?
            .with_preload(info.preload.clone());
        let template = Template::load(&engine, &dir).map_err(|source| CatalogError::Engine { name: id.into(), source })?;
        let loaded = Arc::new(Loaded { engine: Arc::new(engine), template: Arc::new(template), name: None });
        let mut m = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
        Ok(m.entry(id.to_string()).or_insert(loaded).clone())
    }

    /// Every named template with its state.
    pub fn list(&self) -> Vec<Listing> {
        let default = self.default_name();
        let builds = self.builds.lock().map(|m| m.clone()).unwrap_or_default();
        let mut names: Vec<String> = self.recipes.keys().cloned().collect();
        if let Ok(m) = self.by_name.lock() {
            names.extend(m.keys().filter(|n| !self.recipes.contains_key(*n)).cloned());
        }
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let ready = self.ready(&name);
                let recipe = self.recipes.get(&name);
                let (status, error) = match (&ready, builds.get(&name)) {
                    (Some(_), _) => ("ready", None),
                    (None, Some(BuildState::Building(_))) => ("building", None),
                    (None, Some(BuildState::Failed(e))) => ("failed", Some(e.clone())),
                    (None, None) => ("available", None),
                };
                Listing {
                    default: name == default,
                    description: recipe.map(|r| r.description.clone()).unwrap_or_else(|| "an image given by path".into()),
                    status: status.into(),
                    id: ready.as_ref().map(|l| l.id().to_string()),
                    packages: recipe.map(|r| r.spec.packages.clone()).unwrap_or_default(),
                    preload: ready
                        .as_ref()
                        .map(|l| l.template.info.preload.clone())
                        .or_else(|| recipe.map(|r| r.preload.clone()))
                        .unwrap_or_default(),
                    image_bytes: ready.as_ref().and_then(|l| std::fs::metadata(&l.engine.image_path).ok()).map(|m| m.len()),
                    error,
                    name,
                }
            })
            .collect()
    }
}
