//! Recreate an image's tree on the host (for debugging / chroot checks):
//! `cargo run -p forkbox-image --example image_extract -- IMAGE DESTDIR`

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use forkbox_image::{Image, NodeKind};

fn extract(img: &Image, dir: u32, dest: &Path) -> std::io::Result<()> {
    for (name, c) in img.children(dir) {
        let p = dest.join(std::ffi::OsStr::from_bytes(name));
        let Some(m) = img.meta(c) else { continue };
        let mtime = UNIX_EPOCH + Duration::from_secs(m.mtime.max(0) as u64);
        match m.kind {
            NodeKind::Dir => {
                fs::create_dir(&p)?;
                extract(img, c, &p)?;
                fs::set_permissions(&p, fs::Permissions::from_mode(m.perm))?;
                fs::File::open(&p)?.set_modified(mtime)?;
            }
            NodeKind::File => {
                fs::write(&p, img.content(c).unwrap_or_default())?;
                fs::set_permissions(&p, fs::Permissions::from_mode(m.perm))?;
                fs::File::options().write(true).open(&p)?.set_modified(mtime)?;
            }
            NodeKind::Symlink => symlink(std::ffi::OsStr::from_bytes(img.read_link(c).unwrap_or_default()), &p)?,
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(img), Some(dest)) = (args.get(1), args.get(2)) else {
        return Err("usage: image_extract IMAGE DESTDIR".into());
    };
    let img = Image::open(Path::new(img))?;
    fs::create_dir(dest)?;
    extract(&img, Image::ROOT, Path::new(dest))?;
    Ok(())
}
