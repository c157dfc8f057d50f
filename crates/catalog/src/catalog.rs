//! Named templates: the shipped recipes (`python`, `data`), built on first use,
//! and every template of a data directory by id, so that one process serves many
//! templates at once and a session stays on the template it was created from
//! whatever the default becomes.
//!
//! A template is named by a recipe (image packages + preload); its *id* is the hash
//! of what determines its content (`template::template_id`). Sessions record the id;
//! `Catalog::by_id` opens any template that is on disk (its image named by the
//! template's state file), whether or not a recipe names it now.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use forkbox_api::ErrorCode;
pub use forkbox_image::{Blas, PipSource};
use forkbox_image::{BuildError, BuildOptions, ImageSpec};
use forkbox_vmm::Cpu;
use serde::{Deserialize, Serialize};

use forkbox_engine::net_secrets::{SealedSecret, SecretInfo};
use forkbox_engine::template::{templates_dir, Template, TemplateInfo};
use forkbox_engine::{Engine, EngineError, NetPolicy};

use crate::shared::{ArtifactKind, Shared, SharedArtifacts, SharedError, SharedStats};

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
    /// Who may see and use it (None: everyone).
    pub owner: Option<String>,
    /// Shipped, built from a request, or made from a checkpoint.
    pub kind: RecipeKind,
    /// The Debian packages asked for beyond the base image (custom templates).
    pub apt: Vec<String>,
    /// The template's id once built (custom templates: recorded on disk).
    pub template_id: Option<String>,
    /// Its egress policy layer: every sandbox forked from it (one-shot execs,
    /// new sessions) gets it inside the server's and the key's, so it only narrows.
    pub network: Option<NetPolicy>,
    /// Its secrets (sealed): every sandbox forked from it gets them, over the
    /// key's and under the session's of the same name.
    pub secrets: Vec<SealedSecret>,
}

/// Where a recipe comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecipeKind {
    Shipped,
    /// `forkbox template build NAME --apt/--pip`, or an owner's request for one of its own.
    Custom,
    /// A session's state at one of its checkpoints.
    Checkpoint {
        session: String,
        checkpoint: i64,
    },
}

impl RecipeKind {
    pub fn name(&self) -> &'static str {
        match self {
            RecipeKind::Shipped => "shipped",
            RecipeKind::Custom => "custom",
            RecipeKind::Checkpoint { .. } => "checkpoint",
        }
    }
}

/// What a custom template is built from (`forkbox template build NAME ...`, or an owner's request).
#[derive(Clone, Debug, Default)]
pub struct CustomTemplate {
    pub name: String,
    /// Debian packages beyond the base image (python3, numpy, the userland).
    pub apt: Vec<String>,
    /// pip requirement specs, installed as binary wheels.
    pub pip: Vec<String>,
    /// Run before the snapshot (default `import numpy`).
    pub preload: Option<String>,
    pub blas: Blas,
    /// The template's egress policy layer (see [`Recipe::network`]).
    pub network: Option<NetPolicy>,
    /// The template's secrets (see [`Recipe::secrets`]).
    pub secrets: Vec<SealedSecret>,
}

/// Most template builds pending at once on this server.
pub const MAX_PENDING_BUILDS: usize = 4;
/// Longest preload of a custom template.
pub const MAX_PRELOAD_BYTES: usize = 64 << 10;
/// Most Debian packages a custom template may ask for.
pub const MAX_APT_PACKAGES: usize = 64;

/// A template name: 1 to 63 of `a-z 0-9 . _ -`, starting with a letter or digit.
pub fn validate_name(name: &str) -> Result<(), CatalogError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CatalogError::Invalid(format!(
            "invalid template name {name:?}: 1 to 63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
        )))
    }
}

/// The on-disk record of a custom template (`<home>/custom-templates/<hex key>.json`).
/// Format 2 added `network`, format 3 `secrets`; an older record reads as one without them.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct CustomRecord {
    /// Format of this record ([`RECORD_FORMAT`]; [`READABLE_RECORD_FORMATS`] are read).
    format: u32,
    name: String,
    owner: Option<String>,
    kind: String,
    apt: Vec<String>,
    pip: Vec<String>,
    preload: String,
    blas: String,
    index_url: Option<String>,
    find_links: Vec<String>,
    no_index: bool,
    session: Option<String>,
    checkpoint: Option<i64>,
    template_id: Option<String>,
    description: String,
    /// Format 2: the template's egress policy layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    network: Option<NetPolicy>,
    /// Format 3: the template's secrets, sealed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    secrets: Vec<SealedSecret>,
}

const RECORD_FORMAT: u32 = 3;
const READABLE_RECORD_FORMATS: [u32; 3] = [1, 2, 3];

/// The catalog key of a template: its name, or `<owner>/<name>` for an owner's own.
fn key_of(owner: Option<&str>, name: &str) -> String {
    match owner {
        Some(o) => format!("{o}/{name}"),
        None => name.to_string(),
    }
}

fn records_dir(home: &Path) -> PathBuf {
    home.join("custom-templates")
}

fn record_path(home: &Path, key: &str) -> PathBuf {
    records_dir(home).join(format!("{}.json", hex::encode(key.as_bytes())))
}

impl Recipe {
    fn record(&self) -> CustomRecord {
        let (session, checkpoint) = match &self.kind {
            RecipeKind::Checkpoint { session, checkpoint } => (Some(session.clone()), Some(*checkpoint)),
            _ => (None, None),
        };
        CustomRecord {
            format: RECORD_FORMAT,
            name: self.name.clone(),
            owner: self.owner.clone(),
            kind: self.kind.name().into(),
            apt: self.apt.clone(),
            pip: self.spec.pip.clone(),
            preload: self.preload.clone(),
            blas: self.spec.blas.name().into(),
            index_url: self.spec.pip_source.index_url.clone(),
            find_links: self.spec.pip_source.find_links.clone(),
            no_index: self.spec.pip_source.no_index,
            session,
            checkpoint,
            template_id: self.template_id.clone(),
            description: self.description.clone(),
            network: self.network.clone(),
            secrets: self.secrets.clone(),
        }
    }

    fn from_record(r: CustomRecord) -> Option<Recipe> {
        if !READABLE_RECORD_FORMATS.contains(&r.format) {
            return None;
        }
        let kind = match (r.kind.as_str(), r.session, r.checkpoint) {
            ("custom", _, _) => RecipeKind::Custom,
            ("checkpoint", Some(session), Some(checkpoint)) => RecipeKind::Checkpoint { session, checkpoint },
            _ => return None,
        };
        let mut spec = forkbox_engine::default_image_spec();
        spec.packages.extend(r.apt.iter().cloned());
        spec.blas = Blas::parse(&r.blas)?;
        spec.pip = r.pip;
        spec.pip_source = PipSource { index_url: r.index_url, find_links: r.find_links, no_index: r.no_index };
        Some(Recipe {
            name: r.name,
            description: r.description,
            spec,
            preload: r.preload,
            owner: r.owner,
            kind,
            apt: r.apt,
            template_id: r.template_id,
            network: r.network,
            secrets: r.secrets,
        })
    }
}

/// The templates forkbox ships.
pub fn builtin_recipes() -> Vec<Recipe> {
    vec![
        Recipe {
            name: "python".into(),
            description: "Python 3.11 + numpy (reference BLAS)".into(),
            spec: forkbox_engine::default_image_spec(),
            preload: "import numpy".into(),
            owner: None,
            kind: RecipeKind::Shipped,
            apt: Vec::new(),
            template_id: None,
            network: None,
            secrets: Vec::new(),
        },
        Recipe {
            name: "data".into(),
            description: "Python 3.11 + numpy, pandas, scipy, matplotlib (Agg), Pillow, scikit-learn, statsmodels, seaborn, \
                          sympy, networkx, requests, beautifulsoup4, lxml, openpyxl, PyYAML, tqdm, tabulate (OpenBLAS, one thread); \
                          pandas, matplotlib.pyplot and scipy preloaded"
                .into(),
            spec: forkbox_engine::with_agent(ImageSpec::data()),
            preload: DATA_PRELOAD.into(),
            owner: None,
            kind: RecipeKind::Shipped,
            apt: Vec::new(),
            template_id: None,
            network: None,
            secrets: Vec::new(),
        },
        Recipe {
            name: "cpython-tests".into(),
            description: "Python 3.11 + CPython's regression tests (Debian's libpython3.11-testsuite, the `test` package), \
                          for scripts/cpython-tests; unittest and test.support preloaded"
                .into(),
            spec: forkbox_engine::with_agent(ImageSpec::cpython_tests()),
            preload: "import unittest, test.support, test.support.os_helper".into(),
            owner: None,
            kind: RecipeKind::Shipped,
            apt: Vec::new(),
            template_id: None,
            network: None,
            secrets: Vec::new(),
        },
    ]
}

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("no template named {0:?}")]
    UnknownTemplate(String),
    #[error("template {0} is not in this data directory")]
    NotOnDisk(String),
    #[error("template {name} is being built (started {secs} s ago); retry when it is listed as ready")]
    Building { name: String, secs: u64 },
    #[error("building the image of template {name}: {source}")]
    Build { name: String, source: BuildError },
    #[error("template {name}: {source}")]
    Engine { name: String, source: EngineError },
    #[error("{0}")]
    Invalid(String),
    #[error("a template named {0:?} exists already")]
    Exists(String),
    #[error("{0}")]
    TooManyBuilds(String),
    #[error("{0}")]
    Quota(String),
    #[error("recording template {name}: {source}")]
    Record { name: String, source: std::io::Error },
    /// The cluster's shared templates (bucket + database) failed: fetching,
    /// publishing or locking template `name` or what it needs.
    #[error("template {name}: {source}")]
    Shared { name: String, source: SharedError },
}

impl CatalogError {
    /// The API error code.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            CatalogError::UnknownTemplate(_) | CatalogError::NotOnDisk(_) => ErrorCode::TemplateNotFound,
            CatalogError::Building { .. } => ErrorCode::TemplateNotReady,
            CatalogError::Engine { source: e @ EngineError::Storage { .. }, .. } => e.error_code(),
            CatalogError::Build { .. } | CatalogError::Engine { .. } => ErrorCode::TemplateUnavailable,
            CatalogError::Invalid(_) => ErrorCode::InvalidRequest,
            CatalogError::Exists(_) => ErrorCode::TemplateExists,
            CatalogError::TooManyBuilds(_) => ErrorCode::TooManyBuilds,
            CatalogError::Quota(_) => ErrorCode::QuotaExceeded,
            CatalogError::Record { .. } => ErrorCode::StorageError,
            CatalogError::Shared { source, .. } => source.error_code(),
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
    /// That recipe's egress policy layer (None: none of its own; always None
    /// when opened by id, as a session resuming records its layers itself).
    pub network: Option<NetPolicy>,
    /// That recipe's secrets (empty when opened by id, as for `network`).
    pub secrets: Vec<SealedSecret>,
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

    /// A template opened by id only: no recipe, so no policy layer or secrets of its own.
    fn by_id(engine: Engine, template: Template) -> Arc<Loaded> {
        Arc::new(Loaded {
            engine: Arc::new(engine),
            template: Arc::new(template),
            name: None,
            network: None,
            secrets: Vec::new(),
        })
    }
}

/// One template and its state, as the template list shows it (on the wire:
/// [`forkbox_api::wire::templates::TemplateBody`], which it converts into).
#[derive(Clone, Debug)]
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
    /// `shipped`, `custom` (built from packages) or `checkpoint` (a session's state).
    pub source: String,
    /// pip requirement specs (custom templates).
    pub pip: Vec<String>,
    /// While `building`: the step (`queued`, `image: <what it does>`, `template`) and seconds since it started.
    pub progress: Option<String>,
    /// While `building`: the fraction of the step done (0 to 1), where known (downloading and
    /// unpacking the image's packages).
    pub fraction: Option<f64>,
    pub elapsed_seconds: Option<u64>,
    /// The session and checkpoint it was made from (`checkpoint` templates).
    pub from_session: Option<String>,
    pub from_checkpoint: Option<i64>,
    /// Its egress policy layer (None: none of its own).
    pub network: Option<NetPolicy>,
    /// Its secrets: names and destinations, never values.
    pub secrets: Vec<SecretInfo>,
}

impl From<Listing> for forkbox_api::wire::templates::TemplateBody {
    fn from(t: Listing) -> Self {
        forkbox_api::wire::templates::TemplateBody {
            name: t.name,
            description: t.description,
            status: t.status,
            id: t.id,
            default: t.default,
            packages: t.packages,
            preload: t.preload,
            image_bytes: t.image_bytes,
            error: t.error,
            source: t.source,
            pip: t.pip,
            progress: t.progress,
            fraction: t.fraction,
            elapsed_seconds: t.elapsed_seconds,
            from_session: t.from_session,
            from_checkpoint: t.from_checkpoint,
            network: t.network.as_ref().and_then(|p| serde_json::to_value(p).ok()),
            secrets: t.secrets,
        }
    }
}

/// By template key: the image build's step and the fraction of it done.
type BuildDetail = Arc<Mutex<HashMap<String, (&'static str, Option<f64>)>>>;

#[derive(Clone)]
enum BuildState {
    Building(Instant, &'static str),
    Failed(String),
}

/// What an owner has in the catalog when it asks for one more template of
/// its own: what the caller's admission rules ([`Catalog::set_owner_rules`]) decide on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnerUsage {
    /// Its own templates now.
    pub templates: usize,
    /// The name asked for is one of them already (a failed build being replaced).
    pub replaces: bool,
    /// Its template builds pending now.
    pub pending_builds: usize,
}

/// Admission of an owner's new template: `Err` (`Quota`, `TooManyBuilds`) refuses it.
pub type OwnerRules = dyn Fn(OwnerUsage) -> Result<(), CatalogError> + Send + Sync;

/// Named recipes plus every template opened so far, by id. Cheap to share (`Arc`).
pub struct Catalog {
    home: PathBuf,
    cpu: Arc<Cpu>,
    /// By key (the name; `<owner>/<name>` for an owner's own).
    recipes: RwLock<BTreeMap<String, Recipe>>,
    /// Where pip looks for the wheels of templates built by request.
    pip_source: RwLock<PipSource>,
    /// Package layers installed at run time (same pip source), shared by every engine.
    packages: Arc<forkbox_image::packages::PackageStore>,
    default: Mutex<String>,
    progress: bool,
    by_id: Mutex<HashMap<String, Arc<Loaded>>>,
    by_name: Mutex<HashMap<String, Arc<Loaded>>>,
    builds: Mutex<HashMap<String, BuildState>>,
    /// Within a build's step: what the image build is doing and the fraction of it done, if known.
    build_detail: BuildDetail,
    /// One build at a time (apt, dpkg-deb and a template boot each use the whole machine).
    build_lock: Mutex<()>,
    /// Held while a new template is checked against the limits and recorded.
    admit_lock: Mutex<()>,
    /// What an owner may add (`set_owner_rules`; none: no limit per owner).
    owner_rules: RwLock<Option<Arc<OwnerRules>>>,
    /// In a cluster: where templates, images and package layers are shared
    /// (`set_shared`); None: this data directory is the only copy.
    shared: RwLock<Option<Arc<Shared>>>,
    /// One open (fetch, build, publish) of a template id at a time.
    opening: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl Catalog {
    /// The shipped recipes over `home`; nothing is built or opened yet.
    pub fn new(home: &Path) -> Result<Catalog, EngineError> {
        Catalog::with_recipes(home, builtin_recipes())
    }

    pub fn with_recipes(home: &Path, recipes: Vec<Recipe>) -> Result<Catalog, EngineError> {
        let mut recipes: BTreeMap<String, Recipe> = recipes.into_iter().map(|r| (r.name.clone(), r)).collect();
        // The custom templates recorded in the data directory.
        if let Ok(rd) = std::fs::read_dir(records_dir(home)) {
            for e in rd.flatten() {
                let p = e.path();
                let rec = std::fs::read(&p).ok().and_then(|b| serde_json::from_slice::<CustomRecord>(&b).ok());
                match rec.and_then(Recipe::from_record) {
                    Some(r) if validate_name(&r.name).is_ok() => {
                        let key = key_of(r.owner.as_deref(), &r.name);
                        recipes.entry(key).or_insert(r);
                    }
                    _ => tracing::warn!(path = %p.display(), "unreadable custom template record; ignored"),
                }
            }
        }
        Ok(Catalog {
            home: home.to_path_buf(),
            cpu: Arc::new(Cpu::new()?),
            recipes: RwLock::new(recipes),
            pip_source: RwLock::new(PipSource::default()),
            packages: Arc::new(forkbox_image::packages::PackageStore::new(home)),
            default: Mutex::new(DEFAULT_TEMPLATE.into()),
            progress: false,
            by_id: Mutex::new(HashMap::new()),
            by_name: Mutex::new(HashMap::new()),
            builds: Mutex::new(HashMap::new()),
            build_detail: BuildDetail::default(),
            build_lock: Mutex::new(()),
            admit_lock: Mutex::new(()),
            owner_rules: RwLock::new(None),
            shared: RwLock::new(None),
            opening: Mutex::new(HashMap::new()),
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

    /// Share templates with the other nodes of a cluster through `artifacts`
    /// (see `crate::shared`): every template opened from now on is the
    /// published one (fetched, or built once and published), and so are the
    /// images and package layers they need. Call before anything is opened.
    pub fn set_shared(&self, artifacts: Arc<dyn SharedArtifacts>) {
        let shared = Arc::new(Shared::new(artifacts, &self.home));
        *self.shared.write().unwrap_or_else(|p| p.into_inner()) = Some(shared.clone());
        // The names this data directory had before it joined (first record of a key wins).
        let local: Vec<(String, Recipe)> = self
            .recipes
            .read()
            .map(|m| {
                m.iter().filter(|(_, r)| r.kind != RecipeKind::Shipped).map(|(k, r)| (k.clone(), r.clone())).collect()
            })
            .unwrap_or_default();
        for (key, recipe) in local {
            let Ok(body) = serde_json::to_string(&recipe.record()) else { continue };
            let k = key.clone();
            if let Err(e) = shared.off(move |sh| sh.sh.put_template_record(&k, &body, false)) {
                tracing::warn!(template = %key, "publishing the template's name to the cluster: {e}");
            }
        }
        self.sync_records();
    }

    /// In a cluster: take in the named templates the other nodes recorded
    /// (new names, and records that changed: a rebuilt template is reopened).
    /// The cluster's records are the authority; if the database cannot be
    /// reached now, this node keeps the names it knows.
    fn sync_records(&self) {
        let Some(sh) = self.shared() else { return };
        let records = match sh.off(|sh| sh.sh.template_records()) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("reading the cluster's template names: {e}");
                return;
            }
        };
        let mut recipes = self.recipes.write().unwrap_or_else(|p| p.into_inner());
        for (key, body) in records {
            let rec = serde_json::from_str::<CustomRecord>(&body).ok().and_then(Recipe::from_record);
            // A record must name what its key says (a shipped name is never replaced).
            let Some(r) = rec.filter(|r| {
                validate_name(&r.name).is_ok()
                    && key_of(r.owner.as_deref(), &r.name) == key
                    && recipes.get(&key).is_none_or(|old| old.kind != RecipeKind::Shipped)
            }) else {
                tracing::warn!(template = %key, "unreadable template record in the cluster's database; ignored");
                continue;
            };
            let changed = match recipes.get(&key) {
                None => true,
                Some(old) => serde_json::to_string(&old.record()).ok().as_deref() != Some(body.as_str()),
            };
            if changed {
                let rebuilt = recipes.get(&key).is_some_and(|old| {
                    old.spec != r.spec
                        || old.preload != r.preload
                        || old.network != r.network
                        || old.secrets != r.secrets
                        || old.kind != r.kind
                });
                if rebuilt {
                    if let Ok(mut m) = self.by_name.lock() {
                        m.remove(&key);
                    }
                }
                recipes.insert(key, r);
            }
        }
    }

    /// What this node fetched, built and published (None: not in a cluster).
    pub fn shared_stats(&self) -> Option<SharedStats> {
        self.shared().map(|s| s.stats())
    }

    fn shared(&self) -> Option<Arc<Shared>> {
        self.shared.read().ok().and_then(|s| s.clone())
    }

    fn opening_lock(&self, id: &str) -> Arc<Mutex<()>> {
        let mut m = self.opening.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, l| Arc::strong_count(l) > 1);
        m.entry(id.to_string()).or_default().clone()
    }

    /// Where this catalog's engines fetch package layers they lack (the
    /// cluster's shared artifacts; None: not in a cluster).
    fn layer_source(&self) -> Option<Arc<dyn forkbox_engine::LayerSource>> {
        self.shared().map(|sh| Arc::new(crate::shared::SharedLayers(sh)) as Arc<dyn forkbox_engine::LayerSource>)
    }

    /// An engine over the image at `path` with this catalog's CPU, package
    /// layers and shared artifacts.
    fn engine_for(&self, path: &Path, preload: &str) -> Result<Engine, EngineError> {
        Ok(Engine::open_with_cpu(self.cpu.clone(), path)?
            .with_preload(preload.to_string())
            .with_packages(self.packages.clone())
            .with_layer_source(self.layer_source()))
    }

    /// Resolve and download `specs` (and their dependencies) for a run-time
    /// install (see `PackageStore::resolve`); in a cluster each layer is also
    /// published before any sandbox mounts it, so that a checkpoint referring
    /// to it is resumable on every node. Blocking (pip).
    pub fn resolve_packages(&self, specs: &[String]) -> Result<Vec<forkbox_engine::packages::Package>, EngineError> {
        self.resolve_packages_within(specs, forkbox_image::packages::MAX_LAYER_BYTES)
    }

    /// [`Self::resolve_packages`], a layer built now unpacking to at most
    /// `budget` bytes (what is left of its owner's disk quota).
    pub fn resolve_packages_within(
        &self,
        specs: &[String],
        budget: u64,
    ) -> Result<Vec<forkbox_engine::packages::Package>, EngineError> {
        let pkgs = self.packages.resolve_within(specs, budget)?;
        if let Some(sh) = self.shared() {
            for p in &pkgs {
                let Some(path) = self.packages.layer_path(&p.sha256) else { continue };
                let id = p.sha256.clone();
                sh.off(move |sh| sh.publish_layer(&id, &path))?;
            }
        }
        Ok(pkgs)
    }

    /// Remove the package layers on disk that neither `referenced` (the
    /// layers the sessions' lineages mount) nor any template on disk (its
    /// saved state's file system) refers to; see `PackageStore::gc`. Their ids.
    pub fn gc_packages(&self, referenced: &BTreeSet<String>, min_age: std::time::Duration) -> Vec<String> {
        let mut keep = referenced.clone();
        if let Ok(rd) = std::fs::read_dir(templates_dir(&self.home)) {
            for e in rd.flatten() {
                let state = e.path().join(forkbox_snapshot::bundle::STATE_FILE);
                if !state.is_file() {
                    continue;
                }
                match forkbox_snapshot::read_state(&state) {
                    Ok(snap) => keep.extend(snap.process.vfs.layer_ids()),
                    Err(err) => {
                        // Unreadable: keep every layer rather than guess.
                        tracing::warn!(template = %e.file_name().to_string_lossy(), error = %err, "package GC skipped");
                        return Vec::new();
                    }
                }
            }
        }
        self.packages.gc(&keep, min_age)
    }

    /// Where pip looks for the wheels of templates built by request (`serve --pip-index-url/--pip-find-links`).
    /// The rules an owner's new template (`create`, `add_from_snapshot` with
    /// an owner) must pass, checked with the catalog's admission lock held.
    pub fn set_owner_rules(&self, rules: Arc<OwnerRules>) {
        *self.owner_rules.write().unwrap_or_else(|p| p.into_inner()) = Some(rules);
    }

    pub fn set_pip_source(&self, source: PipSource) -> Result<(), CatalogError> {
        source.validate().map_err(CatalogError::Invalid)?;
        self.packages.set_source(source.clone()).map_err(|e| CatalogError::Invalid(e.to_string()))?;
        *self.pip_source.write().unwrap_or_else(|p| p.into_inner()) = source;
        Ok(())
    }

    /// The package layers of run-time installs (`%pip install`, or a request to install into a session).
    pub fn packages(&self) -> &Arc<forkbox_image::packages::PackageStore> {
        &self.packages
    }

    fn has_recipe(&self, key: &str) -> bool {
        self.recipes.read().is_ok_and(|m| m.contains_key(key))
    }

    /// The key an owner's request for `name` means: its own template of that name,
    /// else a shipped or shared one. None (`owner`): the shared namespace only.
    pub fn key_for(&self, owner: Option<&str>, name: &str) -> Result<String, CatalogError> {
        // A '/' would name another owner's template.
        if name.contains('/') {
            return Err(CatalogError::UnknownTemplate(name.into()));
        }
        if let Some(o) = owner {
            let own = key_of(Some(o), name);
            if self.has_recipe(&own) {
                return Ok(own);
            }
            if !self.has_recipe(name) && self.ready(name).is_none() && self.shared().is_some() {
                // Perhaps made on another node of the cluster.
                self.sync_records();
                if self.has_recipe(&own) {
                    return Ok(own);
                }
            }
        }
        Ok(name.to_string())
    }

    pub fn default_name(&self) -> String {
        self.default.lock().map(|d| d.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Set the default template (it must be a known name).
    pub fn set_default(&self, name: &str) -> Result<(), CatalogError> {
        if !self.has_recipe(name) && !self.by_name.lock().is_ok_and(|m| m.contains_key(name)) {
            return Err(CatalogError::UnknownTemplate(name.into()));
        }
        if let Ok(mut d) = self.default.lock() {
            *d = name.to_string();
        }
        Ok(())
    }

    pub fn recipe(&self, name: &str) -> Option<Recipe> {
        self.recipes.read().ok().and_then(|m| m.get(name).cloned())
    }

    /// Register an already open template under a name (`serve --image FILE`, tests).
    pub fn insert(&self, name: &str, engine: Arc<Engine>, template: Arc<Template>) -> Arc<Loaded> {
        // Its sessions' package layers are this data directory's (unless it has a store already).
        let _ = engine.packages.set(self.packages.clone());
        if let Some(source) = self.layer_source() {
            engine.set_layer_source(source);
        }
        let loaded =
            Arc::new(Loaded { engine, template, name: Some(name.to_string()), network: None, secrets: Vec::new() });
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
        let recipe = match self.recipe(&name) {
            Some(r) => r,
            None => {
                // Perhaps made on another node of the cluster.
                self.sync_records();
                self.recipe(&name).ok_or_else(|| CatalogError::UnknownTemplate(name.clone()))?
            }
        };
        let started = match self.builds.lock().ok().and_then(|m| m.get(&name).cloned()) {
            Some(BuildState::Building(t, _)) => t,
            _ => Instant::now(),
        };
        self.set_build(&name, Some(BuildState::Building(started, "queued")));
        let _one = self.build_lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = self.ready(&name) {
            self.set_build(&name, None);
            return Ok(l);
        }
        self.set_build(&name, Some(BuildState::Building(started, "image")));
        let r = self.open_recipe(&name, &recipe, started);
        match &r {
            Ok(l) => {
                self.set_build(&name, None);
                if recipe.kind != RecipeKind::Shipped && recipe.template_id.as_deref() != Some(l.id()) {
                    let mut rec = recipe.clone();
                    rec.template_id = Some(l.id().to_string());
                    if let Err(e) = self.save(&name, rec, true) {
                        tracing::warn!(template = %name, "{e}");
                    }
                }
            }
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
        if !self.has_recipe(&name) {
            // Perhaps made on another node of the cluster.
            self.sync_records();
            if !self.has_recipe(&name) {
                return Err(CatalogError::UnknownTemplate(name));
            }
        }
        let state = self.builds.lock().ok().and_then(|m| m.get(&name).cloned());
        match state {
            Some(BuildState::Building(t, _)) => {
                return Err(CatalogError::Building { name, secs: t.elapsed().as_secs() });
            }
            // A failed build is tried again by the next request that needs it.
            Some(BuildState::Failed(_)) | None => {}
        }
        // A template already on disk opens in about a second: do it inline.
        if self.on_disk(&name) {
            return self.get(Some(&name));
        }
        self.start_build(&name);
        Err(CatalogError::Building { name, secs: 0 })
    }

    /// Build the template of key `name` on a background thread (its state: `builds`).
    fn start_build(self: &Arc<Self>, name: &str) {
        let name = name.to_string();
        self.set_build(&name, Some(BuildState::Building(Instant::now(), "queued")));
        let me = self.clone();
        let n = name.clone();
        // Never under an exec thread's seccomp filter: a build runs apt-get, dpkg, ldconfig.
        let spawned = forkbox_engine::jail::spawn_unjailed(format!("build-{name}"), move || match me.get(Some(&n)) {
            Ok(l) => tracing::info!(template = %n, id = %l.id(), "template built"),
            Err(e) => tracing::warn!(template = %n, "template build failed: {e}"),
        });
        if let Err(e) = spawned {
            self.set_build(&name, Some(BuildState::Failed(e.to_string())));
        }
    }

    /// Write the record of the custom template `key` and put it in the catalog.
    /// In a cluster it is recorded in the cluster's database first (`replace`:
    /// over an existing record; else a key another node recorded meanwhile is
    /// `Exists`), so that every node knows the name.
    fn save(&self, key: &str, recipe: Recipe, replace: bool) -> Result<(), CatalogError> {
        let dir = records_dir(&self.home);
        let err = |source| CatalogError::Record { name: recipe.name.clone(), source };
        if let Some(sh) = self.shared() {
            let body = serde_json::to_string(&recipe.record()).map_err(|e| err(std::io::Error::other(e)))?;
            let k = key.to_string();
            let put = sh.off(move |sh| sh.sh.put_template_record(&k, &body, replace));
            match put {
                Ok(true) => {}
                Ok(false) => return Err(CatalogError::Exists(recipe.name.clone())),
                Err(source) => return Err(CatalogError::Shared { name: recipe.name.clone(), source }),
            }
        }
        std::fs::create_dir_all(&dir).map_err(err)?;
        let path = record_path(&self.home, key);
        let tmp = path.with_extension("tmp");
        let body = serde_json::to_vec_pretty(&recipe.record()).map_err(|e| err(std::io::Error::other(e)))?;
        std::fs::write(&tmp, body).map_err(err)?;
        std::fs::rename(&tmp, &path).map_err(err)?;
        if let Ok(mut m) = self.recipes.write() {
            m.insert(key.to_string(), recipe);
        }
        Ok(())
    }

    /// Forget the custom template `key` (its record; the template files stay for its sessions).
    fn forget(&self, key: &str) {
        if let Some(sh) = self.shared() {
            let k = key.to_string();
            if let Err(e) = sh.off(move |sh| sh.sh.delete_template_record(&k)) {
                tracing::warn!(template = %key, "forgetting the template in the cluster: {e}");
            }
        }
        let _ = std::fs::remove_file(record_path(&self.home, key));
        if let Ok(mut m) = self.recipes.write() {
            m.remove(key);
        }
        if let Ok(mut m) = self.by_name.lock() {
            m.remove(key);
        }
    }

    /// Check that `owner` may add a template named `name` (a new key, within its
    /// limits); `replace`: an existing one of its own may be replaced (the CLI's
    /// rebuild), else only a failed one. The key.
    fn admit(&self, owner: Option<&str>, name: &str, replace: bool) -> Result<String, CatalogError> {
        validate_name(name)?;
        // In a cluster: the names and counts of every node.
        self.sync_records();
        let key = key_of(owner, name);
        let recipes = self.recipes.read().map(|m| m.clone()).unwrap_or_default();
        let builds = self.builds.lock().map(|m| m.clone()).unwrap_or_default();
        let failed = matches!(builds.get(&key), Some(BuildState::Failed(_)));
        if owner.is_some() && recipes.contains_key(name) {
            // A shipped or shared name is not shadowed.
            return Err(CatalogError::Exists(name.into()));
        }
        if let Some(r) = recipes.get(&key) {
            if r.kind == RecipeKind::Shipped
                || matches!(builds.get(&key), Some(BuildState::Building(..)))
                || !(replace || failed)
            {
                return Err(CatalogError::Exists(name.into()));
            }
        }
        let rules = self.owner_rules.read().unwrap_or_else(|p| p.into_inner()).clone();
        if let (Some(o), Some(rules)) = (owner, rules) {
            let prefix = format!("{o}/");
            let templates = recipes.keys().filter(|k| k.starts_with(&prefix)).count();
            let pending_builds = builds
                .iter()
                .filter(|(k, st)| k.starts_with(&prefix) && matches!(st, BuildState::Building(..)))
                .count();
            rules(OwnerUsage { templates, replaces: recipes.contains_key(&key), pending_builds })?;
        }
        let pending = builds.values().filter(|st| matches!(st, BuildState::Building(..))).count();
        if pending >= MAX_PENDING_BUILDS {
            return Err(CatalogError::TooManyBuilds(format!(
                "{pending} template builds are pending on this server (at most {MAX_PENDING_BUILDS}); retry later"
            )));
        }
        Ok(key)
    }

    fn custom_recipe(
        &self,
        owner: Option<&str>,
        t: &CustomTemplate,
        pip_source: PipSource,
    ) -> Result<Recipe, CatalogError> {
        if t.apt.len() > MAX_APT_PACKAGES {
            return Err(CatalogError::Invalid(format!("at most {MAX_APT_PACKAGES} apt packages")));
        }
        let preload = t.preload.clone().unwrap_or_else(|| "import numpy".into());
        if preload.len() > MAX_PRELOAD_BYTES || preload.contains('\0') {
            return Err(CatalogError::Invalid(format!("preload must be at most {MAX_PRELOAD_BYTES} bytes of text")));
        }
        let mut spec = forkbox_engine::default_image_spec();
        spec.packages.extend(t.apt.iter().cloned());
        spec.blas = t.blas;
        spec.pip = t.pip.clone();
        spec.pip_source = pip_source;
        forkbox_image::check_spec(&spec).map_err(|e| CatalogError::Invalid(e.to_string()))?;
        let mut parts = vec!["Python 3.11 + numpy".to_string()];
        if !t.apt.is_empty() {
            parts.push(format!("apt: {}", t.apt.join(" ")));
        }
        if !t.pip.is_empty() {
            parts.push(format!("pip: {}", t.pip.join(" ")));
        }
        Ok(Recipe {
            name: t.name.clone(),
            description: parts.join("; "),
            spec,
            preload,
            owner: owner.map(str::to_string),
            kind: RecipeKind::Custom,
            apt: t.apt.clone(),
            template_id: None,
            network: t.network.clone(),
            secrets: t.secrets.clone(),
        })
    }

    /// Add a custom template and build it on a background thread: `owner`'s own
    /// (visible to it only), with the server's pip source. Its state: `listing`.
    pub fn create(self: &Arc<Self>, owner: &str, t: &CustomTemplate) -> Result<Listing, CatalogError> {
        let _one = self.admit_lock.lock().unwrap_or_else(|p| p.into_inner());
        let key = self.admit(Some(owner), &t.name, false)?;
        let source = self.pip_source.read().map(|s| s.clone()).unwrap_or_default();
        let recipe = self.custom_recipe(Some(owner), t, source)?;
        // Admitted over an existing key only if its build failed here: then replaced.
        let failed = self.has_recipe(&key);
        self.save(&key, recipe, failed)?;
        if let Ok(mut m) = self.by_name.lock() {
            m.remove(&key);
        }
        self.start_build(&key);
        self.listing(Some(owner), &t.name).ok_or_else(|| CatalogError::UnknownTemplate(t.name.clone()))
    }

    /// Add (or rebuild) a custom template shared by every owner and build it now
    /// (blocking: `forkbox template build NAME --apt/--pip`).
    pub fn build_shared(&self, t: &CustomTemplate, pip_source: PipSource) -> Result<Arc<Loaded>, CatalogError> {
        let key = {
            let _one = self.admit_lock.lock().unwrap_or_else(|p| p.into_inner());
            let key = self.admit(None, &t.name, true)?;
            let recipe = self.custom_recipe(None, t, pip_source)?;
            let old = self.recipe(&key);
            let changed = |o: &Recipe| {
                o.spec != recipe.spec
                    || o.preload != recipe.preload
                    || o.network != recipe.network
                    || o.secrets != recipe.secrets
            };
            if old.as_ref().is_some_and(changed) || old.is_none() {
                self.save(&key, recipe, true)?;
                if let Ok(mut m) = self.by_name.lock() {
                    m.remove(&key);
                }
            }
            key
        };
        let r = self.get(Some(&key));
        if r.is_err() {
            self.forget(&key);
        }
        r
    }

    /// A template of `owner` (None: shared) named `name` from a parked sandbox of
    /// template `base` (a session's checkpoint `checkpoint`, resumed): see
    /// [`Template::snapshot_sandbox`].
    pub fn add_from_sandbox(
        &self,
        owner: Option<&str>,
        name: &str,
        base: &Loaded,
        sb: &forkbox_engine::Sandbox,
        session: &str,
        checkpoint: i64,
    ) -> Result<Listing, CatalogError> {
        self.add_from_snapshot(owner, name, base, session, checkpoint, Vec::new(), |id, preload, memory, state| {
            base.template.snapshot_into(&base.engine, sb, memory, state, id, preload)
        })
    }

    /// [`Self::add_from_sandbox`] with the template's files written by `write`
    /// (its id, its preload note, then its new empty `memory` and `state`
    /// files, as [`Template::snapshot_into`] writes them: in this process or in
    /// a sandbox worker given the two files). This process syncs and names
    /// them, makes the memory read-only, then loads and verifies the template.
    #[allow(clippy::too_many_arguments)]
    pub fn add_from_snapshot(
        &self,
        owner: Option<&str>,
        name: &str,
        base: &Loaded,
        session: &str,
        checkpoint: i64,
        secrets: Vec<SealedSecret>,
        write: impl FnOnce(&str, &str, &mut std::fs::File, &mut std::fs::File) -> Result<(), EngineError>,
    ) -> Result<Listing, CatalogError> {
        let _one = self.admit_lock.lock().unwrap_or_else(|p| p.into_inner());
        let key = self.admit(owner, name, false)?;
        let note = format!("# the state of session {session} at checkpoint {checkpoint}");
        let id = {
            use sha2::{Digest, Sha256};
            let mut h = Sha256::new();
            for part in [base.id(), &key, session, &checkpoint.to_string(), &unique()] {
                h.update((part.len() as u64).to_le_bytes());
                h.update(part.as_bytes());
            }
            hex::encode(&h.finalize()[..16])
        };
        let dir = templates_dir(&self.home).join(&id);
        let err = |source| CatalogError::Engine { name: name.into(), source };
        let io = |what: &'static str, p: &std::path::Path| {
            let p = p.to_path_buf();
            move |e| EngineError::Snapshot(forkbox_snapshot::StateError::io(what, &p, e))
        };
        let built = (|| -> Result<Template, EngineError> {
            std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
            let (mp, sp) = (dir.join("memory"), dir.join("state"));
            let mut memory = std::fs::File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&mp)
                .map_err(io("create", &mp))?;
            let mut state = std::fs::File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&sp)
                .map_err(io("create", &sp))?;
            write(&id, &note, &mut memory, &mut state)?;
            memory.sync_all().map_err(io("fsync", &mp))?;
            state.sync_all().map_err(io("fsync", &sp))?;
            use std::os::unix::fs::PermissionsExt;
            memory.set_permissions(std::fs::Permissions::from_mode(0o444)).map_err(io("fchmod", &mp))?;
            if let Ok(d) = std::fs::File::open(&dir) {
                let _ = d.sync_all();
            }
            Template::load(&base.engine, &dir)
        })();
        let template = match built {
            Ok(t) => t,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(err(e));
            }
        };
        if let Some(sh) = self.shared() {
            // Published before anyone can use it: every node can resume its sessions.
            let (tid, iid) = (id.clone(), base.engine.image.id().to_string());
            if let Err(source) = sh.off(move |sh| sh.publish_template(&tid, &iid)) {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(CatalogError::Shared { name: name.into(), source });
            }
        }
        let spec = forkbox_engine::default_image_spec();
        let recipe = Recipe {
            name: name.into(),
            description: format!(
                "the state of session {session} at checkpoint {checkpoint} (on template {})",
                base.name.as_deref().map_or(base.id(), |n| n.rsplit('/').next().unwrap_or(n))
            ),
            spec,
            preload: note,
            owner: owner.map(str::to_string),
            kind: RecipeKind::Checkpoint { session: session.into(), checkpoint },
            apt: Vec::new(),
            template_id: Some(id.clone()),
            // A checkpoint template has no layer of its own (its session's layers are the session's).
            network: None,
            // Its memory holds its session's placeholders: their values go with it.
            secrets: secrets.clone(),
        };
        // Admitted over an existing key only if its build failed here: then replaced.
        let failed = self.has_recipe(&key);
        if let Err(e) = self.save(&key, recipe, failed) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let loaded = Arc::new(Loaded {
            engine: base.engine.clone(),
            template: Arc::new(template),
            name: Some(key.clone()),
            network: None,
            secrets,
        });
        if let Ok(mut m) = self.by_id.lock() {
            m.insert(id, loaded.clone());
        }
        if let Ok(mut m) = self.by_name.lock() {
            m.insert(key, loaded);
        }
        self.listing(owner, name).ok_or_else(|| CatalogError::UnknownTemplate(name.into()))
    }

    /// True if the named recipe's image and template are both on disk (nothing to download).
    fn on_disk(&self, name: &str) -> bool {
        let Some(r) = self.recipe(name) else { return false };
        if r.kind != RecipeKind::Shipped {
            return r.template_id.is_some_and(|id| templates_dir(&self.home).join(id).join("state").exists());
        }
        let Ok(Some(image_id)) = forkbox_image::built_id(&r.spec, &self.home) else { return false };
        let tid = forkbox_engine::template::template_id(
            &image_id,
            &r.preload,
            &forkbox_snapshot::CpuFingerprint::of(&self.cpu).digest(),
        );
        templates_dir(&self.home).join(tid).join("state").exists()
    }

    fn set_build(&self, name: &str, st: Option<BuildState>) {
        if let Ok(mut d) = self.build_detail.lock() {
            d.remove(name);
        }
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

    fn open_recipe(&self, key: &str, recipe: &Recipe, started: Instant) -> Result<Arc<Loaded>, CatalogError> {
        let name = key.to_string();
        // Errors name the template as its owner knows it (not by its key).
        let shown = recipe.name.clone();
        let t0 = Instant::now();
        if let RecipeKind::Checkpoint { .. } = recipe.kind {
            let id = recipe.template_id.clone().ok_or_else(|| CatalogError::NotOnDisk(name.clone()))?;
            let l = self.by_id(&id)?;
            let loaded = Arc::new(Loaded {
                engine: l.engine.clone(),
                template: l.template.clone(),
                name: Some(name.clone()),
                network: recipe.network.clone(),
                secrets: recipe.secrets.clone(),
            });
            if let Ok(mut m) = self.by_name.lock() {
                m.insert(name, loaded.clone());
            }
            return Ok(loaded);
        }
        let detail = self.build_detail.clone();
        let key = name.clone();
        let report = forkbox_image::Report(Arc::new(move |step, fraction| {
            if let Ok(mut d) = detail.lock() {
                d.insert(key.clone(), (step, fraction));
            }
        }));
        let build_image = || {
            let opts = BuildOptions { home: self.home.clone(), progress: self.progress, report: Some(report.clone()) };
            forkbox_image::build(&recipe.spec, &opts)
                .map_err(|source| CatalogError::Build { name: shown.clone(), source })
        };
        let engine_err = |source| CatalogError::Engine { name: shown.clone(), source };
        let cpu_digest = forkbox_snapshot::CpuFingerprint::of(&self.cpu).digest();
        let existing = |tid: &str| self.by_id.lock().ok().and_then(|m| m.get(tid).cloned());
        let (engine, template, image_reused) = match self.shared() {
            None => {
                let built = build_image()?;
                let engine = self.engine_for(&built.path, &recipe.preload).map_err(engine_err)?;
                let tid = forkbox_engine::template::template_id(engine.image.id(), &engine.preload, &cpu_digest);
                match existing(&tid) {
                    Some(l) => (l.engine.clone(), l.template.clone(), built.reused),
                    None => {
                        self.set_build(&name, Some(BuildState::Building(started, "template")));
                        if self.progress && !templates_dir(&self.home).join(&tid).join("state").exists() {
                            eprintln!("forkbox: booting template {name} and snapshotting it ...");
                        }
                        let template = Template::ensure(&engine, &self.home).map_err(engine_err)?;
                        (Arc::new(engine), Arc::new(template), built.reused)
                    }
                }
            }
            // In a cluster: the id from the recipe (apt resolves, nothing is built),
            // then the published template, or one built once for the cluster.
            Some(sh) => {
                let image_id = forkbox_image::resolve_id(&recipe.spec, &self.home)
                    .map_err(|source| CatalogError::Build { name: shown.clone(), source })?;
                let tid = forkbox_engine::template::template_id(&image_id, &recipe.preload, &cpu_digest);
                match existing(&tid) {
                    Some(l) => (l.engine.clone(), l.template.clone(), true),
                    None => {
                        self.set_build(&name, Some(BuildState::Building(started, "template")));
                        let build = || build_image().map(|b| b.reused);
                        let (engine, template) =
                            self.shared_template(&sh, &tid, &image_id, &recipe.preload, &shown, &build)?;
                        (Arc::new(engine), Arc::new(template), true)
                    }
                }
            }
        };
        let loaded = Arc::new(Loaded {
            engine,
            template,
            name: Some(name.clone()),
            network: recipe.network.clone(),
            secrets: recipe.secrets.clone(),
        });
        if let Ok(mut m) = self.by_id.lock() {
            // By id it is no recipe's: without the recipe's policy.
            m.entry(loaded.id().to_string()).or_insert_with(|| {
                Arc::new(Loaded {
                    engine: loaded.engine.clone(),
                    template: loaded.template.clone(),
                    name: loaded.name.clone(),
                    network: None,
                    secrets: Vec::new(),
                })
            });
        }
        if let Ok(mut m) = self.by_name.lock() {
            m.insert(name.clone(), loaded.clone());
        }
        tracing::info!(template = %name, id = %loaded.id(), image_reused, elapsed = ?t0.elapsed(), "template ready");
        Ok(loaded)
    }

    /// In a cluster: template `tid` (of image `image_id` and `preload`) as the
    /// cluster has it. Published: fetched, or the local copy checked and
    /// replaced if it differs. Not published: built here once for the whole
    /// cluster under its lock (a node that finds another building it waits,
    /// then fetches it): its image fetched if published, else built
    /// (`build_image`: true if an image on disk was reused) and published;
    /// then the template booted (or a valid local one kept) and published.
    fn shared_template(
        &self,
        sh: &Arc<Shared>,
        tid: &str,
        image_id: &str,
        preload: &str,
        shown: &str,
        build_image: &dyn Fn() -> Result<bool, CatalogError>,
    ) -> Result<(Engine, Template), CatalogError> {
        let err = |source| CatalogError::Shared { name: shown.to_string(), source };
        let engine_err = |source| CatalogError::Engine { name: shown.to_string(), source };
        let one = self.opening_lock(tid);
        let _one = one.lock().unwrap_or_else(|e| e.into_inner());
        let lookup = |kind: ArtifactKind, id: &str| {
            let id = id.to_string();
            sh.off(move |sh| sh.lookup(kind, &id)).map_err(err)
        };
        if let Some(a) = lookup(ArtifactKind::Template, tid)? {
            return self.open_published(sh, &a, shown);
        }
        let id = tid.to_string();
        let _cluster = sh.off(move |sh| sh.sh.lock(ArtifactKind::Template, &id)).map_err(err)?;
        if let Some(a) = lookup(ArtifactKind::Template, tid)? {
            return self.open_published(sh, &a, shown);
        }
        // Ours to build. Its image first: the published one, or built here and published.
        {
            let iid = image_id.to_string();
            let _image = sh.off(move |sh| sh.sh.lock(ArtifactKind::Image, &iid)).map_err(err)?;
            match lookup(ArtifactKind::Image, image_id)? {
                Some(a) => {
                    sh.off(move |sh| sh.install_image(&a)).map_err(err)?;
                }
                None => {
                    if !build_image()? {
                        sh.built_image();
                    }
                    let iid = image_id.to_string();
                    sh.off(move |sh| sh.publish_image(&iid)).map_err(err)?;
                }
            }
        }
        let engine = self.engine_for(&sh.image_path(image_id), preload).map_err(engine_err)?;
        if engine.image.id() != image_id {
            return Err(err(SharedError::Corrupt {
                kind: "image",
                id: image_id.to_string(),
                why: format!("the file is image {}", engine.image.id()),
            }));
        }
        let dir = templates_dir(&self.home).join(tid);
        let boots = !dir.join("state").exists();
        if self.progress && boots {
            eprintln!("forkbox: booting template {shown} and snapshotting it (for the cluster) ...");
        }
        let template = Template::ensure(&engine, &self.home).map_err(engine_err)?;
        if boots {
            sh.built_template();
        }
        let (id, iid) = (tid.to_string(), image_id.to_string());
        let replaced = sh.off(move |sh| sh.publish_template(&id, &iid)).map_err(err)?;
        let template = if replaced { Template::load(&engine, &dir).map_err(engine_err)? } else { template };
        Ok((engine, template))
    }

    /// Open the published template `a`: its image made the published one
    /// (fetched unless the local file is it), its directory likewise, then
    /// loaded (verified) from disk.
    fn open_published(
        &self,
        sh: &Arc<Shared>,
        a: &crate::shared::Artifact,
        shown: &str,
    ) -> Result<(Engine, Template), CatalogError> {
        let err = |source| CatalogError::Shared { name: shown.to_string(), source };
        let corrupt = |why: String| err(SharedError::Corrupt { kind: "template", id: a.id.clone(), why });
        let image_id = a.needs.clone().ok_or_else(|| corrupt("its record names no image".into()))?;
        let iid = image_id.clone();
        let image = sh
            .off(move |sh| sh.lookup(ArtifactKind::Image, &iid))
            .map_err(err)?
            .ok_or_else(|| corrupt(format!("it needs image {image_id}, which is not published")))?;
        sh.off(move |sh| sh.install_image(&image)).map_err(err)?;
        let published = a.clone();
        sh.off(move |sh| sh.install_template(&published)).map_err(err)?;
        let dir = templates_dir(&self.home).join(&a.id);
        let info = forkbox_engine::template::read_info(&dir).map_err(corrupt)?;
        let engine_err = |source| CatalogError::Engine { name: shown.to_string(), source };
        let engine = self.engine_for(&sh.image_path(&image_id), &info.preload).map_err(engine_err)?;
        let template = Template::load(&engine, &dir).map_err(engine_err)?;
        Ok((engine, template))
    }

    /// In a cluster: publish this node's template `id`, which is not published
    /// (made before the node joined), so that every node can resume its
    /// sessions; what is published then. Refused if its image is not the
    /// cluster's (published with other bytes).
    fn publish_local(&self, sh: &Arc<Shared>, id: &str) -> Result<crate::shared::Artifact, CatalogError> {
        let err = |source| CatalogError::Shared { name: id.to_string(), source };
        let dir = templates_dir(&self.home).join(id);
        let info = forkbox_engine::template::read_info(&dir).map_err(|_| CatalogError::NotOnDisk(id.into()))?;
        let tid = id.to_string();
        let _cluster = sh.off(move |sh| sh.sh.lock(ArtifactKind::Template, &tid)).map_err(err)?;
        let iid = info.image_id.clone();
        let _image = sh.off(move |sh| sh.sh.lock(ArtifactKind::Image, &iid)).map_err(err)?;
        let (tid, iid) = (id.to_string(), info.image_id.clone());
        sh.off(move |sh| {
            if let Some(a) = sh.lookup(ArtifactKind::Template, &tid)? {
                return Ok(a);
            }
            sh.publish_template(&tid, &iid)?;
            sh.lookup(ArtifactKind::Template, &tid)?
                .ok_or_else(|| SharedError::Failed(format!("template {tid} was published and is not recorded")))
        })
        .map_err(err)
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
        if let Some(sh) = self.shared() {
            // In a cluster: the published template (fetched if this node lacks it
            // or has another copy); one only here is published first.
            let one = self.opening_lock(id);
            let _one = one.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(l) = self.by_id.lock().ok().and_then(|m| m.get(id).cloned()) {
                return Ok(l);
            }
            let tid = id.to_string();
            let found = sh
                .off(move |sh| sh.lookup(ArtifactKind::Template, &tid))
                .map_err(|source| CatalogError::Shared { name: id.into(), source })?;
            let a = match found {
                Some(a) => a,
                None => self.publish_local(&sh, id)?,
            };
            let (engine, template) = self.open_published(&sh, &a, id)?;
            let loaded = Loaded::by_id(engine, template);
            let mut m = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
            return Ok(m.entry(id.to_string()).or_insert(loaded).clone());
        }
        let dir = templates_dir(&self.home).join(id);
        let info: TemplateInfo =
            forkbox_engine::template::read_info(&dir).map_err(|_| CatalogError::NotOnDisk(id.into()))?;
        let image = forkbox_image::image_path(&self.home, &info.image_id);
        if !image.exists() {
            return Err(CatalogError::NotOnDisk(id.into()));
        }
        let engine = self
            .engine_for(&image, &info.preload)
            .map_err(|source| CatalogError::Engine { name: id.into(), source })?;
        let template =
            Template::load(&engine, &dir).map_err(|source| CatalogError::Engine { name: id.into(), source })?;
        let loaded = Loaded::by_id(engine, template);
        let mut m = self.by_id.lock().unwrap_or_else(|p| p.into_inner());
        Ok(m.entry(id.to_string()).or_insert(loaded).clone())
    }

    /// Every named template with its state (the operator's view: all owners', by key).
    pub fn list(&self) -> Vec<Listing> {
        self.list_for(None, true)
    }

    /// The templates `owner` may see and use: shipped, shared and its own (by name).
    pub fn list_visible(&self, owner: &str) -> Vec<Listing> {
        self.list_for(Some(owner), false)
    }

    /// One template as `owner` sees it (None: the shared namespace).
    pub fn listing(&self, owner: Option<&str>, name: &str) -> Option<Listing> {
        let key = self.key_for(owner, name).ok()?;
        if !self.has_recipe(&key) && self.ready(&key).is_none() {
            // Perhaps made on another node of the cluster.
            self.sync_records();
        }
        self.list_keys(&[key], owner.is_none()).into_iter().next()
    }

    fn list_for(&self, owner: Option<&str>, all: bool) -> Vec<Listing> {
        self.sync_records();
        let mut keys: Vec<String> = self.recipes.read().map(|m| m.keys().cloned().collect()).unwrap_or_default();
        if let Ok(m) = self.by_name.lock() {
            keys.extend(m.keys().filter(|n| !self.has_recipe(n)).cloned());
        }
        keys.retain(|k| {
            all || !k.contains('/') || owner.is_some_and(|o| k.strip_prefix(o).is_some_and(|r| r.starts_with('/')))
        });
        keys.sort();
        keys.dedup();
        self.list_keys(&keys, all)
    }

    fn list_keys(&self, keys: &[String], by_key: bool) -> Vec<Listing> {
        let default = self.default_name();
        let builds = self.builds.lock().map(|m| m.clone()).unwrap_or_default();
        let details = self.build_detail.lock().map(|m| m.clone()).unwrap_or_default();
        keys.iter()
            .filter(|k| self.has_recipe(k) || self.ready(k).is_some())
            .map(|key| {
                let ready = self.ready(key);
                let recipe = self.recipe(key);
                let (status, error, progress, elapsed) = match (&ready, builds.get(key)) {
                    (Some(_), _) => ("ready", None, None, None),
                    (None, Some(BuildState::Building(t, step))) => {
                        ("building", None, Some(step.to_string()), Some(t.elapsed().as_secs()))
                    }
                    (None, Some(BuildState::Failed(e))) => ("failed", Some(e.clone()), None, None),
                    (None, None) => ("available", None, None, None),
                };
                // Within the image step: what the build does now, and how far (where known).
                let (progress, fraction) = match (progress, details.get(key)) {
                    (Some(step), Some((what, fraction))) if step == "image" => {
                        (Some(format!("image: {what}")), *fraction)
                    }
                    (progress, _) => (progress, None),
                };
                let (from_session, from_checkpoint) = match recipe.as_ref().map(|r| &r.kind) {
                    Some(RecipeKind::Checkpoint { session, checkpoint }) => (Some(session.clone()), Some(*checkpoint)),
                    _ => (None, None),
                };
                let name = if by_key { key.clone() } else { key.rsplit('/').next().unwrap_or(key).to_string() };
                Listing {
                    default: *key == default,
                    description: recipe
                        .as_ref()
                        .map(|r| r.description.clone())
                        .unwrap_or_else(|| "an image given by path".into()),
                    status: status.into(),
                    id: ready.as_ref().map(|l| l.id().to_string()),
                    packages: recipe
                        .as_ref()
                        .map(|r| if r.kind == RecipeKind::Shipped { r.spec.packages.clone() } else { r.apt.clone() })
                        .unwrap_or_default(),
                    preload: ready
                        .as_ref()
                        .map(|l| l.template.info.preload.clone())
                        .or_else(|| recipe.as_ref().map(|r| r.preload.clone()))
                        .unwrap_or_default(),
                    image_bytes: ready
                        .as_ref()
                        .map(|l| l.engine.image_path.clone())
                        .or_else(|| {
                            // Built earlier (a custom template's record names it): its image's size.
                            let id = recipe.as_ref()?.template_id.clone()?;
                            let info = forkbox_engine::template::read_info(&templates_dir(&self.home).join(id)).ok()?;
                            Some(forkbox_image::image_path(&self.home, &info.image_id))
                        })
                        .and_then(|p| std::fs::metadata(p).ok())
                        .map(|m| m.len()),
                    error,
                    source: recipe.as_ref().map_or("shipped", |r| r.kind.name()).into(),
                    pip: recipe.as_ref().map(|r| r.spec.pip.clone()).unwrap_or_default(),
                    progress,
                    fraction,
                    elapsed_seconds: elapsed,
                    from_session,
                    from_checkpoint,
                    network: recipe.as_ref().and_then(|r| r.network.clone()),
                    secrets: recipe
                        .as_ref()
                        .map(|r| r.secrets.iter().map(SealedSecret::info).collect())
                        .unwrap_or_default(),
                    name,
                }
            })
            .collect()
    }
}

/// Not a secret: makes two templates of the same checkpoint distinct.
fn unique() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record as format 1 wrote it (before `network`): still read, with no policy.
    const FORMAT_1: &str = r#"{
  "format": 1,
  "name": "demo",
  "owner": "alice",
  "kind": "custom",
  "apt": ["jq"],
  "pip": ["fbxdemo"],
  "preload": "import fbxdemo",
  "blas": "reference",
  "index_url": null,
  "find_links": ["/wheels"],
  "no_index": true,
  "session": null,
  "checkpoint": null,
  "template_id": "0123abcd",
  "description": "Python 3.11 + numpy; apt: jq; pip: fbxdemo"
}"#;

    #[test]
    fn format_1_records_read_without_a_policy() {
        let rec: CustomRecord = serde_json::from_str(FORMAT_1).expect("format 1 parses");
        let r = Recipe::from_record(rec).expect("format 1 is readable");
        assert_eq!((r.name.as_str(), r.owner.as_deref(), r.kind.clone()), ("demo", Some("alice"), RecipeKind::Custom));
        assert_eq!(
            (r.apt, r.spec.pip, r.template_id.as_deref()),
            (vec!["jq".to_string()], vec!["fbxdemo".to_string()], Some("0123abcd"))
        );
        assert_eq!(r.network, None);
    }

    #[test]
    fn records_keep_the_policy_and_unknown_formats_are_refused() {
        let mut rec: CustomRecord = serde_json::from_str(FORMAT_1).expect("parses");
        let policy = NetPolicy {
            mode: forkbox_engine::NetMode::Allowlist,
            allow: vec!["example.com:443".parse().expect("rule")],
            deny: vec!["*:25".parse().expect("rule")],
            max_bytes_per_second: Some(1 << 20),
        };
        let mut r = Recipe::from_record(rec.clone()).expect("readable");
        r.network = Some(policy.clone());
        let written = serde_json::to_value(r.record()).expect("json");
        assert_eq!(written["format"], 3);
        assert_eq!(
            written["network"],
            serde_json::json!({
                "mode": "allowlist",
                "allow": ["example.com:443"],
                "deny": ["*:25"],
                "max_bytes_per_second": 1 << 20
            })
        );
        let back: CustomRecord = serde_json::from_value(written).expect("parses");
        assert_eq!(Recipe::from_record(back).expect("readable").network, Some(policy));
        // Without a policy, no `network` is written (and it reads as None).
        r.network = None;
        assert!(serde_json::to_value(r.record()).expect("json").get("network").is_none());
        // A format-2 record (no secrets) still reads.
        rec.format = 2;
        assert!(Recipe::from_record(rec.clone()).is_some_and(|r| r.secrets.is_empty()));
        rec.format = 4;
        assert!(Recipe::from_record(rec).is_none(), "a newer format must not be misread");
    }

    #[test]
    fn records_keep_the_sealed_secrets_and_only_them() {
        let rec: CustomRecord = serde_json::from_str(FORMAT_1).expect("parses");
        let mut r = Recipe::from_record(rec).expect("readable");
        assert!(serde_json::to_value(r.record()).expect("json").get("secrets").is_none());
        let secret = SealedSecret {
            name: "TOKEN".into(),
            placeholder: "fbx_secret_00112233445566778899aabbccddeeff".into(),
            hosts: vec!["api.example.com".into()],
            ports: vec![443],
            sealed: "bm9uY2UtYW5kLWNpcGhlcnRleHQ=".into(),
            tls: true,
        };
        r.secrets = vec![secret.clone()];
        let written = serde_json::to_value(r.record()).expect("json");
        assert_eq!(written["secrets"][0]["sealed"], "bm9uY2UtYW5kLWNpcGhlcnRleHQ=");
        let back: CustomRecord = serde_json::from_value(written).expect("parses");
        assert_eq!(Recipe::from_record(back).expect("readable").secrets, vec![secret]);
    }
}
