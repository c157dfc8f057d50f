//! Templates of a data directory: list them, build one (the warm state every fork starts from).

use std::path::{Path, PathBuf};

use forkbox_engine::{Engine, Template, TemplateInfo};

use crate::RuntimeError;

/// The templates under `home`: each directory with its info, or why it cannot be read.
pub fn list(home: &Path) -> Vec<(PathBuf, Result<TemplateInfo, String>)> {
    forkbox_engine::template::list(home)
}

/// Where the templates of `home` live.
pub fn dir(home: &Path) -> PathBuf {
    forkbox_engine::template::templates_dir(home)
}

/// The template of `image` with `preload` run before the snapshot, under `home`
/// (made if missing); its info and directory. Blocking.
pub fn ensure(home: &Path, image: &Path, preload: &str) -> Result<(TemplateInfo, PathBuf), RuntimeError> {
    let engine = Engine::open(image)
        .map_err(|e| RuntimeError::Open { what: "opening the image", message: format!("{}: {e}", image.display()) })?
        .with_preload(preload);
    let t = Template::ensure(&engine, home)?;
    Ok((t.info.clone(), t.dir.clone()))
}
