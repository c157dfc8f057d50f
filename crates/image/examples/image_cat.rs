//! Print one file of an image to stdout: `cargo run -p forkbox-image --example image_cat -- IMAGE /etc/passwd`
//! (symlinks are not followed: give the real path).

use std::io::Write;

use forkbox_image::Image;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(img), Some(path)) = (args.get(1), args.get(2)) else {
        return Err("usage: image_cat IMAGE PATH".into());
    };
    let img = Image::open(std::path::Path::new(img))?;
    let mut ino = Image::ROOT;
    for c in path.split('/').filter(|c| !c.is_empty()) {
        ino = img.lookup(ino, c.as_bytes()).ok_or("no such path")?;
    }
    let bytes = img.content(ino).or_else(|| img.read_link(ino)).ok_or("not a file or symlink")?;
    std::io::stdout().write_all(bytes)?;
    Ok(())
}
